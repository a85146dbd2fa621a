"""The ``torch.compile`` backend ``"fusegraph"`` (registered as a ``torch_dynamo_backends``
entry point): AOTAutograd gives it the forward and backward ATen graphs; in each, the
regions fusegraph's engines cover are claimed (partition.py: converted, split and chosen
by the region layer, Inductor the incumbent) and replaced by calls into fusegraph plans;
the rest is compiled by Inductor (``options={"rest": "eager"}``: run as ATen ops).

    torch.compile(model, backend="fusegraph")                       # floor on: measured
    torch.compile(model, backend="fusegraph", options={"floor": False})  # claim all
    torch.compile(model, backend="fusegraph", mode="reduce-overhead")    # CUDA graphs

With Inductor as the rest, the ops fusegraph converts are kept whole through Inductor's
decompositions (a layer norm stays ``native_layer_norm``) so that they can be claimed.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.report import Row
from fusegraph.torch import aten
from fusegraph.torch.partition import Options, partition

log = logging.getLogger("fusegraph.torch")

_ROWS: contextvars.ContextVar[list[Row] | None] = contextvars.ContextVar("fusegraph_torch_rows", default=None)
_COUNTER = itertools.count()


@contextlib.contextmanager
def collecting() -> Iterator[list[Row]]:
    """Report rows of every graph compiled inside the block (explainer.py)."""
    rows: list[Row] = []
    token = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)


def _claim(gm: torch.fx.GraphModule, opts: Options, kind: str) -> None:
    rows = partition(gm, opts, f"{kind}{next(_COUNTER)}")
    sink = _ROWS.get()
    if sink is not None:
        sink.extend(rows)


def _kind(gm: torch.fx.GraphModule) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return "bw" if any(n.startswith("tangents") for n in names) else "fw"


def _keep_whole() -> dict[Any, Any]:
    """Inductor's decompositions without the ops fusegraph converts."""
    from torch._inductor.decomposition import select_decomp_table

    return {op: fn for op, fn in select_decomp_table().items() if op not in aten.CONVERTERS}


def _decompose_rest(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """The ops kept whole for fusegraph that it did not claim, decomposed as Inductor would
    have (so Inductor fuses them instead of calling them as fallbacks, which it refuses for an
    op with a decomposition: ``aten.t`` under a dynamic batch on the H100). Re-traced on the
    graph's fake inputs, symbolic sizes included."""
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    left = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in aten.CONVERTERS}
    # Re-traced with Inductor's whole table, not only the kept ops' entries: a decomposition
    # can itself produce a kept op (native_layer_norm_backward -> aten.transpose.int), which
    # Inductor would then make a fallback -- an error where the CI variable is set
    needed = table if any(op in table for op in left) else {}
    if not needed or any(not isinstance(x, torch.Tensor | torch.SymInt) for x in inputs):
        return gm
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(inputs)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            traced: torch.fx.GraphModule = make_fx(torch.fx.Interpreter(gm).run, decomposition_table=needed)(*inputs)
    except Exception as exc:  # keep them whole
        log.info("unclaimed ops kept whole for Inductor (%s: %s)", type(exc).__name__, exc)
        return gm
    traced.meta.update(gm.meta)
    return traced


def fusegraph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                      options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    opts = Options.of(options)
    if opts.rest == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(graph: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            _claim(graph, opts, _kind(graph))
            return compile_fx_inner(_decompose_rest(graph, inputs), inputs, **kwargs)

        import torch._functorch.config as functorch_config

        patches = {"triton.cudagraphs": True} if mode in ("reduce-overhead", "max-autotune") else None
        # AOTAutograd's cache keys the graph, not inner_compile: a graph Inductor compiled
        # before (this process or an earlier one, on disk) came back as Inductor's code,
        # nothing claimed (found by benchmarks/bench_torch.py: inductor timed first)
        with functorch_config.patch(enable_autograd_cache=False):
            compiled: Callable[..., Any] = compile_fx(gm, example_inputs, inner_compile=inner,  # type: ignore[assignment]
                                                      config_patches=patches, decompositions=_keep_whole())
        return compiled
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def eager(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        _claim(graph, opts, _kind(graph))
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=eager, bw_compiler=eager, inference_compiler=eager)(gm, example_inputs)  # type: ignore[no-any-return]


backend = fusegraph_backend

"""The plan's graph function compiled by Inductor without Dynamo.

``torch.compile`` of the plan's function guards, on every call, everything its trace read:
the graph's nodes, attributes and tables as well as the inputs. On a GPU that cost 50 us a
call on an 8-op chain (H100) -- as much as the fused kernel. Tracing the function once with
``make_fx`` turns the graph into a plain FX graph of aten ops with nothing of fusegraph left
in it, and ``torch._inductor.compile`` (Inductor's entry for graphs captured without Dynamo)
compiles that into a callable that checks only its inputs' sizes and strides: about 6 us a
call on the CPU where the ``torch.compile`` path took 39.

The compiled callable is specialized to the declared shapes, strides and dtypes of the
inputs; the plan passes it only tensors laid out as declared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fusegraph.engines.expanded_copy import copy_strided
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.errors import CompileError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr

log = logging.getLogger("fusegraph.engines.torch")

Positional = Callable[[Sequence[Tensor]], Sequence[Tensor]]


def positional(
    fn: Callable[[dict[str, Tensor]], dict[str, Tensor]], in_names: Sequence[str], out_names: Sequence[str]
) -> Callable[..., list[Tensor]]:
    """``fn`` (a dict of inputs by name -> a dict of outputs) as a function of positional
    tensors returning a list: the form make_fx traces and Inductor compiles."""
    ins, outs = list(in_names), list(out_names)

    def run(*xs: Tensor) -> list[Tensor]:
        res = fn(dict(zip(ins, xs, strict=True)))
        return [res[n] for n in outs]

    return run


def compile_graph(
    graph: Graph,
    fn: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    in_names: Sequence[str],
    out_names: Sequence[str],
    example: Sequence[Tensor],
    options: dict[str, Any] | None = None,
    variant: tuple[Any, ...] = (),
) -> Positional:
    """Traces ``fn`` on ``example`` (tensors laid out as the graph declares) and compiles it
    with Inductor (``options``: torch._inductor.config patches); raises CompileError naming
    the graph when either step fails. One compile per graph content, layout, options and
    ``variant`` (what the lowering traces differently: fp32_matmul=bf16x3) in a process
    (``COMPILED``): a model's repeated layers share it."""
    key = (graph.key(), tuple(in_names), tuple(out_names),
           tuple((tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device)) for x in example),
           tuple(sorted((options or {}).items())), variant)
    hit = COMPILED.get(key)
    if hit is not None:
        return hit
    try:
        compiled = inductor_compile(positional(fn, in_names, out_names), example, options)
    except Exception as exc:
        raise CompileError(
            f"torch engine: Inductor could not compile graph '{graph.name}': {type(exc).__name__}",
            diagnostic=str(exc),
        ) from exc
    COMPILED[key] = compiled
    return compiled


# Inductor's callables by (graph content key, input and output names, example layouts,
# options). A compiled callable allocates its outputs on every call and keeps no state
# between calls, so plans of one graph share it: ViT-B/16's twelve identical layer-norm
# regions each loaded the compiled module and tuned its kernels on their first call again
# (about 0.4 s each, H200). Inductor's own FX graph cache serves other processes.
COMPILED: dict[tuple[Any, ...], Positional] = {}


def inductor_compile(
    run: Callable[..., list[Tensor]], example: Sequence[Tensor], options: dict[str, Any] | None = None
) -> Positional:
    """``run`` (positional tensors -> a list) traced once on ``example`` with make_fx and
    compiled by ``torch._inductor.compile``; raises whatever either step raises."""
    torch = _torch()
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.inference_mode(False), torch.no_grad():
        gm = make_fx(run, tracing_mode="real")(*example)
        with torch._guards.tracing(_cache_context()):
            return torch._inductor.compile(gm, list(example), options=options)  # type: ignore[no-any-return]


def _cache_context() -> Any:
    """A tracing context whose fake mode has a shape environment. Inductor's FX graph cache
    keys its guards on one and is bypassed without ("No shape env"), as a graph compiled
    outside Dynamo has none: every process then recompiled every graph (ViT-B/16's twelve
    layer-norm regions, 8.7 s of each session's setup on an H200). Static shapes: the
    callable is specialized to the declared shapes anyway."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    return torch._guards.TracingContext(mode)


def compiled_strides(t: TensorAttr) -> tuple[int, ...]:
    """The strides a compiled function takes ``t`` in: as declared, unless the declaration
    is a broadcast or overlapping view (valid for inputs), which is taken densely -- the
    function computes on values, and a dense copy of such a view holds them all."""
    if layout.self_overlapping(t.shape, t.strides):
        return layout.packed_strides(t.shape)
    return tuple(t.strides)


def as_declared(t: TensorAttr, value: Tensor, strides: tuple[int, ...]) -> Tensor:
    """``value`` in ``strides`` (compiled_strides of ``t``): itself when they match, else a copy."""
    if layout.same_strides(t.shape, value.stride(), strides):
        return value
    return copy_strided(_torch().empty_strided(t.shape, strides, dtype=value.dtype, device=value.device), value)

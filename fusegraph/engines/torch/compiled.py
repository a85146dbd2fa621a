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

A plan the caller keeps can be packaged as AOTInductor code in fusegraph's cache
(``persist``, aoti_cache.py): a later process loads it through torch's C++ loader in tens
of milliseconds, without importing Dynamo or Inductor (their import alone took ~5 s of a
warm Swin-T ONNX session's setup on an H200, their re-tracing and code generation much
more). Packaging is not done at build: an AOTInductor compile took ~40 s of a cold
ResNet-50 session on an H200 for one region that then lost its measurement.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fusegraph.engines.expanded_copy import copy_strided
from fusegraph.engines.torch import aoti_cache
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.errors import CompileError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.cache_dir import cache_enabled

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
    (``COMPILED``): a model's repeated layers share it.

    Where fusegraph's cache holds an AOTInductor package of the same code (aoti_cache.py),
    it is loaded instead: no Dynamo or Inductor import. Otherwise the graph is compiled in
    process and the package is made only when asked (``persist``: the ONNX door asks for the
    regions it keeps; making one costs an AOTInductor compile, 5-40 s)."""
    key = (graph.key(), tuple(in_names), tuple(out_names),
           tuple((tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device)) for x in example),
           tuple(sorted((options or {}).items())), variant)
    hit = COMPILED.get(key)
    if hit is not None:
        return hit
    packs = cache_enabled() and aoti_cache.packs(example[0].device if example else None)
    disk = aoti_cache.region_key(graph.key(), in_names, out_names, example, options, variant) if packs else ""
    compiled: Positional | None = aoti_cache.cached(disk, example[0].device if example else None) if disk else None
    if compiled is not None:
        log.info("graph '%s': compiled plan loaded from the cache (%s)", graph.name, disk)
    else:
        try:
            gm = trace(positional(fn, in_names, out_names), example)
            compiled = compile_traced(gm, example, options)
        except Exception as exc:
            raise CompileError(
                f"torch engine: Inductor could not compile graph '{graph.name}': {type(exc).__name__}",
                diagnostic=str(exc),
            ) from exc
        if disk:
            _TRACED[id(compiled)] = _Traced(graph.name, disk, gm, [_spec(x) for x in example], options)
    COMPILED[key] = compiled
    return compiled


@dataclasses.dataclass(frozen=True)
class _Traced:
    """What ``persist`` needs to package a graph compiled in process: its traced FX graph and
    its inputs' layouts (example tensors are made again then, not held)."""

    name: str
    disk: str
    gm: Any
    example: list[tuple[tuple[int, ...], tuple[int, ...], Any, Any]]  # sizes, strides, dtype, device
    options: dict[str, Any] | None


# Compiled in process, not yet packaged: by the id of the compiled callable (COMPILED keeps
# every such callable alive, so an id names one callable for the process's life).
_TRACED: dict[int, _Traced] = {}
_PERSIST_LOCK = threading.Lock()


def _spec(x: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], Any, Any]:
    return tuple(x.shape), tuple(x.stride()), x.dtype, x.device


def persist(compiled: Positional) -> str:
    """Packages ``compiled`` (a ``compile_graph`` result) for later processes, where it was
    compiled in process with the cache on; '' where there is nothing to do (loaded from a
    package, packaged already, the cache off). A refusal (export or AOTInductor failed, or
    the package disagreed) is logged and kept, so no later process tries again."""
    with _PERSIST_LOCK:
        traced = _TRACED.pop(id(compiled), None)
    if traced is None:
        return ""
    torch = _torch()
    example = [torch.empty_strided(sz, st, dtype=dt, device=dev) for sz, st, dt, dev in traced.example]
    for x in example:
        if x.is_floating_point():
            x.normal_()
        else:
            x.zero_()
    kept = _package(traced.name, traced.gm, example, traced.options, traced.disk)
    return f"AOTInductor package kept ({traced.disk[:16]})" if kept is not None else "no AOTInductor package"


# Compiled callables by (graph content key, input and output names, example layouts,
# options). A compiled callable allocates its outputs on every call and keeps no state
# between calls, so plans of one graph share it: ViT-B/16's twelve identical layer-norm
# regions each loaded the compiled module and tuned its kernels on their first call again
# (about 0.4 s each, H200). Other processes load the package kept on disk (or, where there
# is none, Inductor's own FX graph cache serves them).
COMPILED: dict[tuple[Any, ...], Positional] = {}


def _package(name: str, gm: Any, example: Sequence[Tensor], options: dict[str, Any] | None,
             disk: str) -> Positional | None:
    """``gm``'s AOTInductor package, compiled and kept under ``disk``; None where it cannot
    be made -- found now (logged, and the refusal kept for later processes) or before."""
    refused = aoti_cache.refusal(disk)
    if refused:
        log.info("graph '%s': compiling in process (no AOTInductor package: %s)", name, refused)
        return None
    if _torch()._guards.TracingContext.try_get() is not None:  # no export inside a compile of torch's
        log.info("graph '%s': compiling in process (built inside a torch compile)", name)
        return None
    if not aoti_cache.can_keep():
        log.info("graph '%s': compiling in process (the cache directory cannot be written)", name)
        return None
    t0 = time.perf_counter()
    try:
        compiled = aoti_cache.build(gm, example, options, disk)
    except Exception as exc:  # export or AOTInductor refused the graph, or its outputs disagreed
        why = _reason(exc)
        log.warning("graph '%s': no AOTInductor package (%s); compiling in process, and remembering the refusal",
                    name, why)
        aoti_cache.remember_refusal(disk, why)
        return None
    log.info("graph '%s': AOTInductor package compiled in %.1f s (%s)", name, time.perf_counter() - t0, disk)
    return compiled


def trace(run: Callable[..., list[Tensor]], example: Sequence[Tensor]) -> Any:
    """``run`` (positional tensors -> a list) as an FX graph of aten ops, traced once on
    ``example`` with make_fx: nothing of fusegraph is left in it."""
    torch = _torch()
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.inference_mode(False), torch.no_grad():
        return make_fx(run, tracing_mode="real")(*example)


def compile_traced(gm: Any, example: Sequence[Tensor], options: dict[str, Any] | None = None) -> Positional:
    """A traced graph compiled in process by ``torch._inductor.compile``."""
    torch = _torch()
    with torch.inference_mode(False), torch.no_grad(), torch._guards.tracing(_cache_context()):
        return torch._inductor.compile(gm, list(example), options=options)  # type: ignore[no-any-return]


def inductor_compile(
    run: Callable[..., list[Tensor]], example: Sequence[Tensor], options: dict[str, Any] | None = None
) -> Positional:
    """``run`` (positional tensors -> a list) traced once on ``example`` with make_fx and
    compiled by ``torch._inductor.compile``; raises whatever either step raises."""
    return compile_traced(trace(run, example), example, options)


def _reason(exc: BaseException) -> str:
    """An exception as one short line for the log and the cache."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:240]}" if first else type(exc).__name__


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

"""The floor over a whole ATen graph. Each claimed region won against Inductor's code for
the same nodes, timed alone; the graph can still lose. Inductor fuses across the region's
border when nothing is claimed (a claimed region splits its kernels in two), each region
call adds host time, and a region timed in the measuring thread can mislead: on a CPU,
Inductor's OpenMP kernels slow down by 2-10x in a second thread while the caller's team
still exists (a tiny GPT-2 training step kept 42% of its nodes on fusegraph and ran 2.4x
slower than Inductor on two cores). So once the regions are chosen, the graph with its
claimed regions is compiled and timed against the graph with none, both as they will run,
on the compiling thread with real tensors, and the faster one is returned; ties go to
Inductor. The verdict is cached like a region's, keyed by the graph's code, its inputs'
shapes and the claimed regions: a later process measures nothing, and compiles the graph
without its regions only where that side won (the claimed side is compiled first, since
what was claimed is part of the key).

One level up, each Dynamo graph's verdict is stored too (``inductors_own_key``): the step
check's (step_floor.py: Inductor's own compile, eager, and fusegraph's trace where it kept
regions, timed as a step), or "no region kept" where no step was timed. A later compile of
the same graph, options, device and versions builds only the side named, with no trace of
fusegraph's own unless the trace won (compile_backend.py)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.measure import measure
from fusegraph.regions.verdicts import Verdict, VerdictStore, verdict_key
from fusegraph.torch import aten

log = logging.getLogger("fusegraph.torch")

INCUMBENT = "graph"  # the incumbent's name in verdict keys: the whole graph unclaimed
INDUCTORS_OWN = "Inductor's own compile"  # the incumbent's name in a Dynamo graph's verdict key


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A second module over a copy of ``gm``'s graph (node metadata shared, not copied:
    fake values deep-copy badly), so the claimed rewrite leaves the copy whole."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def random_strided(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Fresh data in a declared layout: floats random, the rest zero (ids, seeds, counts).
    The storage the strides reach is filled, then viewed: an input with a zero stride (an
    expanded value: a mean's gradient) cannot be written element by element."""
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
    flat = torch.empty(extent, dtype=dtype, device=device)
    flat = flat.normal_() if flat.is_floating_point() else flat.zero_()
    return flat.as_strided(tuple(shape), tuple(strides))


def real_inputs(inputs: Sequence[Any]) -> list[Any]:
    """Fresh tensors shaped like the example inputs (fake or real), symbolic sizes at their
    hints, strides kept."""
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            out.append(random_strided([aten.hint(d) for d in x.shape], [aten.hint(s) for s in x.stride()],
                                      x.dtype, x.device))
        elif isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
            out.append(aten.hint(x))
        else:
            out.append(x)
    return out


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on a CUDA ``device``: the device's own free memory and
    what PyTorch's caching allocator holds unused (it hands those out first)."""
    return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
               - torch.cuda.memory_allocated(device))


def room(inputs: Sequence[Any], device: torch.device, copies: int = 2) -> str:
    """Why the graph cannot be timed whole on this device ('' when it can): its inputs are
    allocated again for each of the ``copies`` sides timed (a forward graph's parameters, a
    backward graph's saved activations), each copy within 1/``copies`` of the device's free
    memory (half for the two sides of a graph check)."""
    if device.type != "cuda":
        return ""
    need = sum(math.prod(aten.hint(d) for d in x.shape) * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    free = free_memory(device)
    if need <= free // copies:
        return ""
    share = "half" if copies == 2 else f"1/{copies}"
    return f"its inputs take {need / 2**30:.1f} GiB, over {share} of the {free / 2**30:.1f} GiB free"


def graph_key(original: torch.fx.GraphModule, inputs: Sequence[Any], claimed: Sequence[str]) -> str:
    """The graph's content: its code, its inputs' metadata, what fusegraph claimed in it."""
    metas: list[object] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            metas.append((str(x.dtype), [aten.hint(d) for d in x.shape], [aten.hint(s) for s in x.stride()], x.device.type))
        else:
            metas.append(type(x).__name__)
    text = repr((original.code, metas, sorted(claimed)))
    return hashlib.sha256(text.encode()).hexdigest()


def _dynamo_meta(x: Any, traced: Any) -> object:
    """An example input's metadata, sizes and strides as traced (a dynamic size by its
    symbol, so every batch of one dynamic graph has one key)."""
    if isinstance(x, torch.Tensor):
        like = traced if isinstance(traced, torch.Tensor) else x
        return (str(x.dtype), [str(d) for d in like.shape], [str(s) for s in like.stride()], str(x.device),
                x.requires_grad, type(x).__name__)
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return (type(x).__name__, str(x))
    return (type(x).__name__, repr(x) if isinstance(x, int | float | bool | str | None) else "")


def inductors_own_key(gm: torch.fx.GraphModule, inputs: Sequence[Any], settings: dict[str, Any],
                      device_name: str, versions: dict[str, str]) -> str:
    """A Dynamo graph's verdict key: its code, its example inputs' metadata (parameters
    included: Dynamo lifts them to inputs), the modules and attributes it calls, the global
    state its trace depends on (grad mode, inference mode) and the caller's ``settings``
    (the backend's options, the mode)."""
    traced = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    if len(traced) != len(inputs):
        traced = [None] * len(inputs)
    called: list[object] = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            called.append((n.target, repr(gm.get_submodule(str(n.target)))))
        elif n.op == "get_attr":
            value = getattr(gm, str(n.target), None)
            called.append((n.target, _dynamo_meta(value, None) if isinstance(value, torch.Tensor) else type(value).__name__))
    # the code generated from the graph, not ``gm.code``: reading that makes a lazy Dynamo
    # module generate its code now, before AOTAutograd's cache adds a field to it, and the
    # changed attribute order changed the cache key Inductor's own compile of the graph
    # computes from what ``torch.compile(model)`` computes (the key leaves the module as it is)
    source = gm.graph.python_code(root_module="self").src
    text = repr((source, [_dynamo_meta(x, t) for x, t in zip(inputs, traced, strict=True)], called,
                 torch.is_grad_enabled(), torch.is_inference_mode_enabled(), global_state()))
    content = hashlib.sha256(text.encode()).hexdigest()
    return verdict_key(content, device_name, INDUCTORS_OWN, versions, settings)


def math_state() -> dict[str, object]:
    """How float32 math runs without it showing in an ATen graph's code: TF32 for matmuls
    and convolutions, the float32 matmul precision, deterministic algorithms. Both sides of
    a region's or an ATen graph's verdict run under them (a float32 GEMM on TF32 tensor
    cores runs several times faster), so each setting has verdicts of its own. Autocast
    needs no place here: its casts are in the ATen graph's code."""
    return {"f32_matmul": torch.get_float32_matmul_precision(), "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32, "deterministic": torch.are_deterministic_algorithms_enabled()}


def global_state() -> tuple[object, ...]:
    """The global state a Dynamo graph's code does not show but its step time depends on,
    as Dynamo's own guards see it: autocast (on for which device types, to which dtype; a
    graph compiled under bf16 autocast has the same code as the float32 one), the default
    dtype, and the float32 matmul and convolution settings (TF32). Without it, ViT-B/16's
    batch-1 inference under bf16 autocast and in float32 shared one verdict on an H200
    (eager 5.155 vs Inductor's own 5.618 ms), and under bf16 the eager it chose ran 7.20 ms
    where Inductor's own took 5.57."""
    autocast = tuple(
        (kind, torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind)))
        for kind in ("cpu", "cuda")
    )
    return (autocast, str(torch.get_default_dtype()), *math_state().values())


@contextlib.contextmanager
def outside_the_compile(device: torch.device, *, grad: bool = False) -> Iterator[None]:
    """Real tensors, ATen called directly (no Python dispatcher), autograd off (an ATen
    graph runs inside AOTAutograd's function) or as ``grad`` says (a Dynamo graph's compile,
    run as a step: step_floor.py): the state the compiled graph runs in, not the tracing
    state it was compiled in."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with unset_fake_temporarily(), no_python_dispatcher(), torch.set_grad_enabled(grad), on_device:
        yield


def _boxed(fn: Callable[..., Any], args: list[Any]) -> Callable[[], object]:
    # a compiled graph takes its arguments as one list, which it may empty
    return lambda: fn(list(args))


def _key(original: torch.fx.GraphModule, inputs: Sequence[Any], claimed: Sequence[str], margin: float,
         device_name: str, versions: dict[str, str]) -> str:
    return verdict_key(graph_key(original, inputs, claimed), device_name, INCUMBENT, versions,
                       {"margin": margin, **math_state()})


def stored(original: torch.fx.GraphModule, inputs: Sequence[Any], claimed: Sequence[str], *, margin: float,
           store: VerdictStore, device_name: str, versions: dict[str, str]) -> Verdict | None:
    """The verdict ``settle`` stored for this graph, if any, read without compiling either side."""
    return store.lookup(_key(original, inputs, claimed, margin, device_name, versions))


def settle(
    claimed_fn: Callable[..., Any],
    compile_original: Callable[[], Callable[..., Any]],
    key_parts: tuple[torch.fx.GraphModule, Sequence[Any], Sequence[str]],
    device: torch.device,
    *,
    engine: str,
    margin: float,
    warmup_s: float,
    store: VerdictStore | None,
    device_name: str,
    versions: dict[str, str],
    verified_only: bool = False,
) -> tuple[Callable[..., Any], Verdict]:
    """The compiled graph to run (the claimed one or the original) and the verdict that
    chose it. A claimed graph that fails when timed loses; the original is compiled only
    where it may be returned. ``verified_only``: the regions were measured on device time,
    so a graph that cannot be timed whole is not kept on their word."""
    original, inputs, claimed = key_parts
    key = _key(original, inputs, claimed, margin, device_name, versions)
    cached = store.lookup(key) if store is not None else None
    if cached is not None and cached.fusegraph:
        return claimed_fn, cached
    if cached is not None:
        return compile_original(), cached
    room_left = room(inputs, device)
    if room_left and verified_only:
        log.info("graph with %d claimed regions: not timed whole (%s); their device-time verdicts do not count "
                 "host cost, so nothing is claimed", len(claimed), room_left)
        return compile_original(), Verdict(False, "refused", f"not timed whole: {room_left}; the regions were timed "
                                           "on the device only", engine, incumbent=INCUMBENT)
    if room_left:
        log.info("graph with %d claimed regions: not timed whole (%s); the regions' verdicts stand", len(claimed),
                 room_left)
        return claimed_fn, Verdict(True, "claimed", f"not timed whole: {room_left}", engine, incumbent=INCUMBENT)
    base_fn = compile_original()
    with outside_the_compile(device):
        args = real_inputs(inputs)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        verdict = measure(_boxed(claimed_fn, args), _boxed(base_fn, args), incumbent=INCUMBENT, engine=engine,
                          margin=margin, sync=sync, warmup_s=warmup_s)
        del args
    log.info("graph with %d claimed regions: %s", len(claimed), verdict.describe())
    if store is not None:
        store.record(key, verdict)
        store.flush()
    return (claimed_fn if verdict.fusegraph else base_fn), verdict

"""Inductor's own compile replayed as CUDA graphs: a step-check candidate (step_floor.py)
for a Dynamo graph whose step leaves the GPU idle while the host launches kernels.

Why: on an H200 (torch 2.11, bf16 training, benchmarks/profile_step.py) the device ran
kernels for 45% of Inductor's ViT-B/16 step, 33% of ResNet-50's and 40% of a UNet block's:
the rest was the host launching Inductor's kernels one by one. ``torch.compile(model,
mode="reduce-overhead")`` captures them in CUDA graphs and took ViT-B/16's step from 19.7
to 12.8 ms and ResNet-50's from 23.3 to 12.6 (bench_torch.py, one process, interleaved).
A user must ask for that mode, because its outputs live in a memory pool the next replay
overwrites: in a probe (same H200), training with ``zero_grad(set_to_none=False)``, with
gradient accumulation, reading ``.grad`` after another forward, or keeping an earlier
step's outputs, each raised "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run" (the gradients autograd had taken into ``.grad`` were the
graph's own outputs). This candidate keeps the default mode's semantics instead: what the
user receives is never the pool's. The outputs are cloned out of it, and the gradients
the compiled backward hands to autograd are cloned before autograd accumulates them
(``Owned``), so a step holds nothing of the pool once its backward ran; the cost is one
copy of the outputs and of the gradients per step, which the step check times with the
rest.

The candidate is compiled only where it can win (``eligible``, ``device_share``): on a CUDA
device, static shapes, no process group of more than one rank (CUDA graphs around
collectives are left to the user's ``mode``), and where the device ran kernels less than
SHARE of Inductor's own step: it is a second Inductor compile (Inductor's caches key CUDA
graphs apart; only the Triton kernels come from the first's: on a cold H200 ViT-B/16 the
two took 36.5 s, Inductor's whole first step 27.7), which a step already fed by the host
should not pay."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

NAME = "Inductor's own compile in CUDA graphs"
# below this share of the step spent running kernels, CUDA graphs may save more than the
# margin and the copies they add (a step at 0.9 could gain up to 11%)
SHARE = 0.9
# Inductor's options for its own compile in CUDA graphs, as ``mode="reduce-overhead"`` sets
# them (compile_backend.py compiles it as it compiles Inductor's own, so the two share the
# AOTAutograd settings a later run's cache lookup depends on)
PATCHES = {"triton.cudagraphs": True}


def eligible(example_inputs: Sequence[Any]) -> str:
    """Why the candidate is not tried for a graph of these inputs ('' where it is)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not any(x.device.type == "cuda" for x in tensors):
        return "not on a CUDA device"
    if any(free_symbols(x) for x in tensors) or any(isinstance(x, torch.SymInt) for x in example_inputs):
        return "dynamic sizes (CUDA graphs record one graph per size)"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return "a process group is running (CUDA graphs around collectives are the user's mode to ask for)"
    return ""


def device_share(step: Callable[[], None], wall_ms: float, device: torch.device) -> float | None:
    """The share of a step's wall time (``wall_ms``, timed as the user runs it) the device
    spends running its kernels: the step is queued behind a device-side sleep, so the
    events around it see the kernels back to back, without the gaps the host leaves
    between them. Kept only where the sleep, timed on the device, outlasted the host's
    launches. A step that waits for the device on the host (a sync) cannot be queued ahead:
    its share comes out near 1, and CUDA graphs could not capture it anyway. None where no
    sleep covered the launches."""
    sync = torch.cuda.synchronize
    before = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    # cycles per ms of the device's sleep, measured once its kernel is loaded (a first
    # launch loads it lazily, which a timing around it would count as sleep)
    for _ in range(2):
        sync(device)
        before.record()
        torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]
        start.record()
        sync(device)
    per_ms = 1_000_000 / max(float(before.elapsed_time(start)), 1e-3)
    for factor in (2.0, 6.0):
        sync(device)
        before.record()
        torch.cuda._sleep(int(per_ms * (factor * wall_ms + 5.0)))  # type: ignore[no-untyped-call]
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        sync(device)
        if float(before.elapsed_time(start)) > host_ms:  # every launch was queued while the device slept
            return min(1.0, float(start.elapsed_time(end)) / wall_ms)
    return None


class Owned(torch.autograd.Function):
    """A compiled graph whose results, and the gradients its backward hands autograd, are
    fresh tensors. The graph runs on the caller's own inputs (a parameter's address, which
    the CUDA graph recorded, and an input's in-place updates, such as batch norm's running
    statistics, stay the caller's), its autograd graph held here: the caller's backward
    reaches it through this function's, which asks it for the inputs' gradients
    (``torch.autograd.grad``: nothing is accumulated there) and hands autograd copies."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            outs = fn(*args)
        ctx.outs = list(outs)
        ctx.leaves = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        ctx.inputs = [args[i] for i in ctx.leaves]
        ctx.count = len(args)
        fresh = [o.clone() if isinstance(o, torch.Tensor) else o for o in ctx.outs]
        ctx.mark_non_differentiable(*[f for f, o in zip(fresh, ctx.outs, strict=True)
                                      if isinstance(o, torch.Tensor) and not o.requires_grad])
        return tuple(fresh)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        pairs = [(o, g) for o, g in zip(ctx.outs, grads, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        inputs: list[torch.Tensor | None] = [None] * ctx.count
        if pairs and ctx.inputs:
            got = torch.autograd.grad([o for o, _ in pairs], ctx.inputs, [g for _, g in pairs], allow_unused=True)
            made = [g for g in got if g is not None]
            copies = iter(torch._foreach_mul(made, 1.0) if made else [])  # out of the graph's pool, batched
            for i, g in zip(ctx.leaves, got, strict=True):
                inputs[i] = next(copies) if g is not None else None
        ctx.outs = ctx.inputs = None
        return (None, *inputs)


def owned(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a compiled Dynamo graph under CUDA graphs: Inductor's own compile with
    PATCHES) returning what the user may keep."""

    def run(*args: Any) -> Any:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return list(Owned.apply(fn, *args))  # type: ignore[no-untyped-call]
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in fn(*args)]

    return run

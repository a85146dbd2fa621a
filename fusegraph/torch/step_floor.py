"""The floor over a whole Dynamo graph: fusegraph's own trace, with the regions it kept,
against Inductor's own compile of the same graph, each timed as a training step runs it.

graph_floor.py compares each ATen graph with its claimed regions against the same graph
with none, both from fusegraph's trace. That trace keeps the ops fusegraph converts whole
through Inductor's decompositions, so AOTAutograd's partitioner saves and recomputes other
tensors than under Inductor's own compile (a tiny ResNet-50's forward saved 138 tensors
instead of 99): a cost no check inside the trace can see. On an H200, ResNet-50 training
kept two regions worth ~0.02 ms of a 23 ms step and ran at 0.95x Inductor. So where the
trace kept regions, Inductor's own compile is built too and both are run as a step runs
them -- fresh inputs (those whose examples require grad require it too, as parameters
do), the forward, then the backward of every floating output that requires grad with
fixed random gradients (the forward alone where nothing does: inference, ``no_grad``) --
interleaved, medians, the region layer's margin (ties go to Inductor's own).

Nothing the user holds is touched: the inputs are fresh tensors (a Dynamo graph that owns
parameters of its own, not lifted to inputs, is not checked: its backward would write
their ``.grad``), the caller's saved-tensor hooks are set aside while the steps run, and
the random number generators are restored afterwards (the steps draw random inputs and
run dropout; Dynamo restores them around a compile as well, the backend called alone
does not)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.measure import measure
from fusegraph.regions.verdicts import Verdict
from fusegraph.torch import graph_floor

log = logging.getLogger("fusegraph.torch")

ENGINE = "fusegraph's trace"  # the candidate's name in the verdict
# timed rounds at least: a step (tens of ms on a GPU) fills a round alone, and timing's
# default five samples are few for a verdict that decides the whole training run
ROUNDS = 10
OWN_WON = ("the step timed whole: fusegraph's trace was not faster than Inductor's own compile of the Dynamo "
           "graph (ties go to Inductor's own), which runs it")
TRACE_WON = "the step timed whole: fusegraph's trace ran faster than Inductor's own compile"


def device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def why_not(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """Why the step cannot be timed here ('' when it can)."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return "the Dynamo graph holds parameters or buffers of its own (its backward would change theirs)"
    if any(isinstance(x, torch.Tensor) and x.is_sparse for x in example_inputs):
        return "a sparse input"
    return graph_floor.room(example_inputs, device_of(example_inputs))


def reason(verdict: Verdict) -> str:
    """The verdict in a report row: both step times where measured."""
    side = TRACE_WON if verdict.fusegraph else OWN_WON
    if verdict.fusegraph_ms is not None and verdict.incumbent_ms is not None:
        times = f"{ENGINE} {verdict.fusegraph_ms:.3f} ms vs Inductor's own {verdict.incumbent_ms:.3f} ms"
        return f"{side} ({times}; {verdict.source}; {verdict.why})"
    return f"{side} ({verdict.describe()})"


def _fresh(example_inputs: Sequence[Any]) -> list[Any]:
    """Fresh tensors like the examples, requiring grad where they do (leaves, as parameters are)."""
    args = graph_floor.real_inputs(example_inputs)
    for i, (x, a) in enumerate(zip(example_inputs, args, strict=True)):
        if isinstance(x, torch.Tensor) and x.requires_grad and isinstance(a, torch.Tensor):
            args[i] = a.detach().requires_grad_()
    return args


class _Step:
    """One side run as a training step: the forward on its own fresh inputs, then the
    backward of the floating outputs that require grad (gradients drawn at the first call,
    then fixed). Each call starts with the leaves' ``.grad`` unset, as after
    ``zero_grad(set_to_none=True)``."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[Any]) -> None:
        self.fn = fn  # called as Dynamo calls it, positionally (a ``_boxed_call`` it bears is its inner function's)
        self.args = _fresh(example_inputs)
        self.leaves = [a for a in self.args if isinstance(a, torch.Tensor) and a.requires_grad]
        self.grads: list[torch.Tensor] | None = None
        self.backward = False  # whether a call ran a backward

    def __call__(self) -> None:
        from torch.utils._pytree import tree_leaves

        for leaf in self.leaves:
            leaf.grad = None
        out = self.fn(*self.args)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad
                and o.is_floating_point()]
        if not outs:
            return
        if self.grads is None:
            self.grads = [torch.empty_like(o).normal_() for o in outs]
        torch.autograd.backward(outs, self.grads)
        self.backward = True


@contextlib.contextmanager
def _without_saved_tensors_hooks() -> Iterator[None]:
    """The caller's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``: a
    count, an offload) set aside while the check's steps run, so they see none of its
    tensors, and put back in their order."""
    hooks = torch._C._autograd
    stack: list[Any] = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


def time_steps(claimed: Callable[..., Any], own: Callable[..., Any], example_inputs: Sequence[Any], *,
               margin: float, warmup_s: float) -> Verdict:
    """Both compiled Dynamo graphs timed as a step runs them (module docstring); raises where
    either cannot run. Each side runs one step first, outside the timing: a backward that
    Inductor lowers at its first call is compiled there, as in a real first step."""
    device = device_of(example_inputs)
    devices = [device] if device.type == "cuda" else []
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"))
        stack.enter_context(graph_floor.outside_the_compile(device, grad=torch.is_grad_enabled()))
        stack.enter_context(_without_saved_tensors_hooks())
        sides = {"claimed": _Step(claimed, example_inputs), "own": _Step(own, example_inputs)}
        for step in sides.values():
            step()
            if sync is not None:
                sync()
        if sides["claimed"].backward != sides["own"].backward:
            raise RuntimeError("the two compiles disagree on whether the step has a backward")
        verdict = measure(sides["claimed"], sides["own"], incumbent=graph_floor.INDUCTORS_OWN, engine=ENGINE,
                          margin=margin, sync=sync, warmup_s=warmup_s, min_rounds=ROUNDS)
        del sides
        if sync is not None:
            sync()
    return verdict


def settle(claimed: Callable[..., Any], compile_own: Callable[[], Callable[..., Any]], gm: torch.fx.GraphModule,
           example_inputs: Sequence[Any], *, margin: float, warmup_s: float) -> tuple[Callable[..., Any], Verdict | None]:
    """The compiled Dynamo graph to return and the verdict that chose it; None where the
    check could not run (the log says why): the claimed trace stands, as before the check."""
    cannot = why_not(gm, example_inputs)
    if cannot:
        log.info("fusegraph's trace kept regions; not timed against Inductor's own compile: %s", cannot)
        return claimed, None
    try:
        own = compile_own()
        verdict = time_steps(claimed, own, example_inputs, margin=margin, warmup_s=warmup_s)
    except Exception as exc:  # never the user's compile
        log.warning("fusegraph's trace kept regions; the step check against Inductor's own compile did not run "
                    "(%s: %s); the trace is kept", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return claimed, None
    log.info("%s", reason(verdict))
    return (claimed if verdict.fusegraph else own), verdict

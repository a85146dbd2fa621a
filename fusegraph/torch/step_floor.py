"""The step check: a whole Dynamo graph timed as a training step runs it, in every way the
user could have run it, and the fastest runs. The candidates:

- **Inductor's own compile** of the Dynamo graph (what ``torch.compile(model)`` gives: the
  incumbent; ties, and anything within the region layer's margin, go to it);
- **eager**: the Dynamo graph module run as it is, as ``backend="eager"`` returns it
  (autograd runs the ATen ops one by one). On an H200, bf16 ResNet-50 training (batch 64,
  channels-last) ran faster in PyTorch eager than under Inductor in every run made
  (eager / Inductor ms: 21.04/22.37, 20.64/21.29, 21.91/23.28), so a floor that only
  compared fusegraph with Inductor handed the user Inductor's slower step;
- **fusegraph's trace**, where it kept regions. graph_floor.py compares each ATen graph with
  its claimed regions against the same graph with none, both from fusegraph's trace. That
  trace keeps the ops fusegraph converts whole through Inductor's decompositions, so
  AOTAutograd's partitioner saves and recomputes other tensors than under Inductor's own
  compile (a tiny ResNet-50's forward saved 138 tensors instead of 99): a cost no check
  inside the trace can see (an H200 ResNet-50 step kept two regions worth ~0.02 ms of 23 ms
  and ran at 0.95x Inductor).

Each is run as a step runs it -- fresh inputs (those whose examples require grad require
it too, as parameters do), the forward, then the backward of every floating output that
requires grad with fixed random gradients (the forward alone where nothing does: inference,
``no_grad``) -- interleaved, medians (select/timing.py). The cost over Inductor's own
compile: one more step per candidate per timing round, no other compile.

Nothing the user holds is touched: the inputs are fresh tensors (a Dynamo graph that owns
parameters of its own, not lifted to inputs, is not checked: its backward would write
their ``.grad``), the caller's saved-tensor hooks are set aside while the steps run, and
the random number generators are restored afterwards (the steps draw random inputs and
run dropout; Dynamo restores them around a compile as well, the backend called alone
does not).

The verdict is a region verdict (regions/verdicts.py) under the Dynamo graph's key:
``fusegraph`` where the trace won, else ``incumbent`` names the side that runs (Inductor's
own compile, or eager); ``why`` holds every candidate's step time."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.verdicts import Verdict
from fusegraph.select import timing
from fusegraph.torch import cuda_graphs, graph_floor, phases
from fusegraph.torch.phases import phase

log = logging.getLogger("fusegraph.torch")

OWN, EAGER, TRACE, GRAPHED = "own", "eager", "trace", "graphed"  # the candidates' names in the timing
# who takes a tie: the incumbent, then what the user could call without fusegraph (eager;
# Inductor's own in CUDA graphs, which holds a memory pool and copies its results out)
ORDER = (OWN, EAGER, GRAPHED, TRACE)
NAMES = {OWN: graph_floor.INDUCTORS_OWN, EAGER: "eager", TRACE: "fusegraph's trace", GRAPHED: cuda_graphs.NAME}
ENGINE = NAMES[TRACE]  # the fusegraph candidate's name in the verdict
# timed rounds at least: a step (tens of ms on a GPU) fills a round alone, and timing's
# default five samples are few for a verdict that decides the whole training run
ROUNDS = 10
TIMED = "the step timed whole: "
OWN_WON = "Inductor's own compile of the Dynamo graph runs it"
EAGER_WON = 'eager runs it (the Dynamo graph as it is, as backend="eager" runs it)'
TRACE_WON = "fusegraph's trace runs it"
GRAPHED_WON = "Inductor's own compile, replayed as CUDA graphs (its results copied out of their pool), runs it"
RUNS = {OWN: OWN_WON, EAGER: EAGER_WON, TRACE: TRACE_WON, GRAPHED: GRAPHED_WON}
WHERE = {OWN: "inductor", EAGER: "torch.eager", GRAPHED: "inductor"}  # a report row's ``where`` for a side that is not fusegraph


def device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


# DDP's graph split: its compiled pieces' first call returns fake outputs, which it then
# reads; a step timed at compile time would take that call (on two H200s every such check
# failed and DDP then ran the real code on fake tensors: "Cannot access data pointer"). The
# check waits for the first real call there instead (ddp_split.py).
FAKIFIED = "DDP's graph split reads the compiled graph's first call (fake outputs), which a timed step would take"


def fakified_first_call() -> bool:
    """Whether the graph being compiled is a piece of DDP's graph split, whose compiled
    function's first call (AOTAutograd's) returns fake outputs for DDP to read."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return context is not None and bool(getattr(context, "fakify_first_call", False))


def why_not(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], sides: int = 2) -> str:
    """Why the step cannot be timed here ('' when it can), with ``sides`` candidates."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return "the Dynamo graph holds parameters or buffers of its own (its backward would change theirs)"
    if any(isinstance(x, torch.Tensor) and x.is_sparse for x in example_inputs):
        return "a sparse input"
    return graph_floor.room(example_inputs, device_of(example_inputs), copies=sides) or (
        FAKIFIED if fakified_first_call() else "")


def winner(verdict: Verdict) -> str:
    """The candidate a verdict names (a "concluded" one, no step timed: Inductor's own)."""
    if verdict.fusegraph:
        return TRACE
    return next((side for side in (EAGER, GRAPHED) if verdict.incumbent == NAMES[side]), OWN)


def reason(verdict: Verdict) -> str:
    """The verdict in a report row: every step time where measured, and who runs it."""
    side = RUNS[winner(verdict)]
    if verdict.incumbent_ms is not None:
        return f"{TIMED}{verdict.why}; {side} ({verdict.source})"
    return f"{side} ({verdict.describe()})"


def _verdict(ms: Mapping[str, float], failed: Mapping[str, str], margin: float) -> Verdict:
    """The fastest of the candidates timed, with ties within ``margin`` going the ORDER's way."""
    won = timing.fastest({n: timing.Timing(n, t, t, (t,)) for n, t in ms.items()}, order=ORDER, tie_margin=margin)
    times = " vs ".join(f"{NAMES[n]} {ms[n]:.3f} ms" for n in sorted(ms, key=ms.__getitem__))
    why = f"{times} (medians; ties within {margin:.0%} go to {NAMES[OWN]}, then eager)"
    why += "".join(f"; {NAMES[n]} failed: {e}" for n, e in failed.items())
    other = won if won != TRACE else OWN  # the side the trace is set against
    return Verdict(won == TRACE, "measured", why, ENGINE, ms.get(TRACE), ms[other], NAMES[other])


@dataclasses.dataclass(frozen=True)
class Check:
    """A step check's outcome: its ``verdict``, each side's median step ``times`` (ms),
    the sides that ``failed`` (name -> error), whether the step had a ``backward``, and the
    bytes each side's forward ``saved`` for it (distinct storages, the inputs' not counted):
    what a side needs on the device beyond the inputs while its step runs."""

    verdict: Verdict
    times: Mapping[str, float]
    failed: Mapping[str, str]
    backward: bool
    saved: Mapping[str, int] = dataclasses.field(default_factory=dict)  # bytes each side saves for its backward


@dataclasses.dataclass(frozen=True)
class Settled:
    """The side chosen, the function that runs the graph (its compiled side, or one that
    chooses later: loop_trial.py, ddp_split.py), the candidates compiled and the check,
    where it ran (None: the log says why)."""

    side: str
    fn: Callable[..., Any]
    candidates: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    check: Check | None = None

    @property
    def verdict(self) -> Verdict | None:
        """The check's verdict, which chose ``side`` (None where no check ran)."""
        return self.check.verdict if self.check is not None else None


def _holds_values(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return type(x) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(x, FakeTensor) \
        and x.device.type != "meta"


def _fresh(example_inputs: Sequence[Any]) -> list[Any]:
    """Fresh tensors like the examples, requiring grad where they do (leaves, as parameters
    are): copies of the examples' values where they hold some (Dynamo passes the caller's
    own tensors: the weights as initialised or trained, the batch), else random. Random
    N(0, 1) weights are no stand-in on a CPU: in a layer norm + linear + GELU + linear
    training step (d 256, 2048 rows, float32, 2 cores) they drove the GELU backward's
    values into float32's denormal range, and Inductor's own step timed 75 ms against
    eager's 33, where on the module's own weights it took 26 against 29."""
    args = graph_floor.real_inputs(example_inputs)
    for i, (x, a) in enumerate(zip(example_inputs, args, strict=True)):
        if not isinstance(x, torch.Tensor) or not isinstance(a, torch.Tensor):
            continue
        if _holds_values(x):
            copy = x.detach().clone()
            if copy.stride() == a.stride():  # an expanded example (stride 0) keeps its random stand-in
                a = copy
        args[i] = a.detach().requires_grad_() if x.requires_grad else a
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
        self.layout: list[object] | None = None  # the first call's outputs' sizes and strides
        self.saved: dict[int, int] = {}  # the first forward's saved storages (address -> bytes), inputs' left out

    def __call__(self) -> None:
        from torch.utils._pytree import tree_leaves

        for leaf in self.leaves:
            leaf.grad = None
        # Autocast keeps the casts of leaves that require grad (the weights) until its
        # outermost context exits: the check runs inside the caller's one context, a user's
        # steps each enter their own. Kept, eager's steps reused the casts (ViT-B/16 batch-1
        # bf16 inference on an H200: eager timed 4.30 ms in the check, 6.17-6.49 ms as run,
        # against Inductor's own 4.78 / 4.73, whose casts are compiled in): cleared per step.
        torch.clear_autocast_cache()
        if self.layout is None:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                out = self.fn(*self.args)
            self.layout = layout(out)
            for a in self.args:
                if isinstance(a, torch.Tensor):
                    self.saved.pop(_storage(a)[0], None)
        else:
            out = self.fn(*self.args)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad
                and o.is_floating_point()]
        if not outs:
            return
        if self.grads is None:
            self.grads = [torch.empty_like(o).normal_() for o in outs]
        torch.autograd.backward(outs, self.grads)
        self.backward = True

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        address, size = _storage(t)
        if size:
            self.saved[address] = size
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's storage address and size in bytes ((0, 0) for one without a plain storage)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except Exception:  # a tensor subclass or a sparse tensor: not counted
        return 0, 0


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


def _time(candidates: Mapping[str, Callable[[], object]], **options: Any) -> Mapping[str, timing.Timing]:
    """The timing routine (select/timing.py), looked up at each call; tests replace this."""
    return timing.time_candidates(candidates, **options)


def layout(out: Any) -> list[object]:
    """A graph's outputs' sizes and strides (size hints where symbolic), in output order."""
    from torch.utils._pytree import tree_leaves

    from fusegraph.torch.aten import hint

    return [(tuple(hint(d) for d in o.shape), tuple(hint(d) for d in o.stride())) if isinstance(o, torch.Tensor)
            else type(o).__name__ for o in tree_leaves(out)]


@contextlib.contextmanager
def _checking(device: torch.device) -> Iterator[None]:
    """Where the check's steps run: outside the compile, the random generators restored
    afterwards, the caller's saved-tensor hooks set aside, the time counted as step timing."""
    devices = [device] if device.type == "cuda" else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(phase(phases.STEP_TIMING))  # the untimed first steps too
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"))
        stack.enter_context(graph_floor.outside_the_compile(device, grad=torch.is_grad_enabled()))
        stack.enter_context(_without_saved_tensors_hooks())
        yield


def time_steps(sides: Mapping[str, Callable[..., Any]], example_inputs: Sequence[Any], *, margin: float,
               warmup_s: float, expected: list[object] | None = None) -> Check:
    """The compiled Dynamo graphs (``sides``: name -> callable; OWN among them) timed as a
    step runs them (module docstring). Each side runs one step first, outside the timing: a
    backward that Inductor lowers at its first call is compiled there, as in a real first
    step. A side other than Inductor's own that raises, or whose outputs' layout is not
    ``expected`` (where given), loses, and the verdict says why (and the check's ``failed``
    names it); Inductor's own doing so raises (the check did not run)."""
    device = device_of(example_inputs)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    failed: dict[str, str] = {}
    with _checking(device):
        steps = {name: _Step(fn, example_inputs) for name, fn in sides.items()}
        for name, step in list(steps.items()):
            try:
                step()
                if sync is not None:
                    sync()
                if expected is not None and step.layout != expected:
                    raise RuntimeError(f"its outputs (sizes, strides) {step.layout} are not those the graph was "
                                       f"compiled to give, {expected}")
            except Exception as exc:
                if name == OWN:
                    raise
                log.info("the step check: %s failed its first step (%s: %s)", NAMES[name], type(exc).__name__, exc)
                failed[name] = f"{type(exc).__name__}: {exc}"
                del steps[name]
        if len({step.backward for step in steps.values()}) > 1:
            raise RuntimeError("the candidates disagree on whether the step has a backward")
        backward = any(step.backward for step in steps.values())
        errors: dict[str, Exception] = {}
        saved = {name: sum(step.saved.values()) for name, step in steps.items()}
        timings = _time(steps, sync=sync, warmup_s=warmup_s, min_rounds=ROUNDS, on_error=errors.__setitem__)
        failed.update({name: f"{type(exc).__name__}: {exc}" for name, exc in errors.items()})
        del steps
        if sync is not None:
            sync()
    if OWN not in timings:
        raise RuntimeError(f"{NAMES[OWN]} failed when timed: {failed.get(OWN, 'no time')}")
    times = {name: t.median_ms for name, t in timings.items()}
    return Check(_verdict(times, failed, margin), times, failed, backward, saved)


def trace_cannot_win(gain_ms: float, best: Verdict, margin: float) -> str:
    """Why fusegraph's trace cannot win the step against ``best`` (Inductor's own compile
    and eager timed first: its ``incumbent_ms`` is the faster one's step) where the regions
    it claimed save ``gain_ms`` at most, or '' where it might: the trace runs Inductor's
    code for all it did not claim and pays for what it claimed in the partitioner's choices,
    so its step takes no less than Inductor's own less that gain, and it must beat the
    faster side by more than the margin. Such a trace is not compiled (compile_backend.py):
    on an H200, ViT-B/16 training kept regions that lost the step, and compiling the trace
    and checking its ATen graphs took 40 s of an 80 s compile against Inductor's 30."""
    if best.incumbent_ms is None or math.isinf(gain_ms):
        return ""
    bound = margin * best.incumbent_ms
    if gain_ms > bound:
        return ""
    return (f"not compiled: the regions claimed save {gain_ms:.4f} ms together where measured, and the "
            f"step's fastest side ({best.incumbent}) takes {best.incumbent_ms:.3f} ms, so fusegraph's trace "
            f"could not beat it by the {margin:.0%} margin ({bound:.4f} ms)")


def compiled_sides(compile_own: Callable[[], Callable[..., Any]], eager: Callable[..., Any],
                   trace: Callable[..., Any] | None) -> dict[str, Callable[..., Any]] | None:
    """The candidates by name, Inductor's own compiled now; None where that compile failed
    and fusegraph's trace stands (without a trace the failure is raised: as without the
    check, Inductor's own compile is all there is)."""
    try:
        own = compile_own()
    except Exception:
        if trace is None:
            raise
        log.warning("Inductor's own compile of the Dynamo graph failed; fusegraph's trace is kept", exc_info=True)
        return None
    return {OWN: own, EAGER: eager, **({TRACE: trace} if trace is not None else {})}


def settle(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compile_own: Callable[[], Callable[..., Any]],
           eager: Callable[..., Any], trace: Callable[..., Any] | None = None, *, margin: float,
           warmup_s: float, graphed: Callable[[], Callable[..., Any]] | None = None) -> Settled:
    """The candidate chosen by the step timed once, at compile time (``eager``: the Dynamo
    graph module's forward, taken before any compile rewrote the module; ``trace``:
    fusegraph's, where it kept regions). Without a verdict (the check could not run; the
    log says why) the trace stands where there is one, as before the check, else
    Inductor's own compile. step_choice.py weighs it again on the loop's steps, or waits
    for real calls in DDP's graph split."""
    sides = 3 if trace is not None else 2
    cannot = why_not(gm, example_inputs, sides)
    if cannot:
        log.info("the Dynamo graph's step was not timed against eager and Inductor's own compile: %s", cannot)
        return Settled(TRACE, trace) if trace is not None else Settled(OWN, compile_own())
    candidates = compiled_sides(compile_own, eager, trace)
    if candidates is None:  # Inductor's own failed: the trace stands (compiled_sides raises without one)
        assert trace is not None
        return Settled(TRACE, trace)
    try:
        check = time_steps(candidates, example_inputs, margin=margin, warmup_s=warmup_s)
    except Exception as exc:  # never the user's compile
        kept = TRACE if trace is not None else OWN
        log.warning("the step check did not run (%s: %s); %s is kept", type(exc).__name__, exc, NAMES[kept],
                    exc_info=log.isEnabledFor(logging.DEBUG))
        return Settled(kept, candidates[kept], candidates)
    if graphed is not None:
        check = _with_graphs(check, candidates, graphed, example_inputs, margin=margin, warmup_s=warmup_s)
    log.info("%s", reason(check.verdict))
    won = winner(check.verdict)
    return Settled(won, candidates[won], candidates, check)


def _with_graphs(check: Check, candidates: dict[str, Callable[..., Any]], graphed: Callable[[], Callable[..., Any]],
                 example_inputs: Sequence[Any], *, margin: float, warmup_s: float) -> Check:
    """The check again with Inductor's own compile in CUDA graphs among the candidates
    (cuda_graphs.py), where Inductor's own step left the device idle for more than
    1 - SHARE of it; else the check as it was, its verdict saying why graphs were not tried.
    A failure to measure or compile them leaves the check as it was (the log says why)."""
    # one more side timed, whose graph pool adds to the copies of the inputs
    cannot = cuda_graphs.eligible(example_inputs) or graph_floor.room(example_inputs, device_of(example_inputs),
                                                                      copies=len(candidates) + 1)
    share: float | None = None
    if not cannot:
        device = device_of(example_inputs)
        try:
            with _checking(device):
                step = _Step(candidates[OWN], example_inputs)
                step()
                share = cuda_graphs.device_share(step, check.times[OWN], device)
        except Exception as exc:
            log.info("the device's share of the step was not measured (%s: %s)", type(exc).__name__, exc)
        if share is None:
            cannot = "the device's share of Inductor's own step could not be measured"
        elif share >= cuda_graphs.SHARE:
            cannot = (f"the device ran kernels {share:.0%} of Inductor's own step (CUDA graphs are tried below "
                      f"{cuda_graphs.SHARE:.0%})")
    if cannot:
        note = f"; {cuda_graphs.NAME} not tried: {cannot}"
        return dataclasses.replace(check, verdict=dataclasses.replace(check.verdict, why=check.verdict.why + note))
    try:
        candidates[GRAPHED] = graphed()
        again = time_steps(candidates, example_inputs, margin=margin, warmup_s=warmup_s)
    except Exception as exc:
        candidates.pop(GRAPHED, None)
        log.warning("%s was not compiled or timed (%s: %s); the check stands", cuda_graphs.NAME,
                    type(exc).__name__, exc)
        return check
    note = f"; the device ran kernels {share:.0%} of Inductor's own step, so {cuda_graphs.NAME} was tried"
    return dataclasses.replace(again, verdict=dataclasses.replace(again.verdict, why=again.verdict.why + note))

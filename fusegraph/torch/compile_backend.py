"""The ``torch.compile`` backend ``"fusegraph"`` (registered as a ``torch_dynamo_backends``
entry point): AOTAutograd gives it the forward and backward ATen graphs; in each, the
regions fusegraph's engines cover are claimed (partition.py: converted, split and chosen
by the region layer, Inductor the incumbent) and replaced by calls into fusegraph plans;
the rest is compiled by Inductor (``options={"rest": "eager"}``: run as ATen ops).

    torch.compile(model, backend="fusegraph")                       # floor on: measured
    torch.compile(model, backend="fusegraph", options={"floor": False})  # claim all
    torch.compile(model, backend="fusegraph", mode="reduce-overhead")    # CUDA graphs

With the floor on, a graph whose regions were claimed is then timed whole against the same
graph with nothing claimed (graph_floor.py), and the faster runs: regions that each won
alone can still lose together.

With Inductor as the rest, the ops fusegraph converts are kept whole through Inductor's
decompositions (a layer norm stays ``native_layer_norm``) so that they can be claimed.
Where no ATen graph of a Dynamo graph keeps a region, that trace is dropped and the Dynamo
graph gets Inductor's own compile (_Compile): the same code as ``torch.compile(model)``.
That conclusion is stored (dynamo_verdict.py): a later compile of the same Dynamo graph,
with the same options, mode, device and library versions, skips fusegraph's trace and goes
straight to Inductor's own compile. With the floor on and no CUDA graphs, the Dynamo graph is timed
as a step (step_floor.py) the ways the user could run it: first Inductor's own compile and
eager (the Dynamo graph as it is, ``backend="eager"``), before fusegraph's trace, whose
ATen graphs are not compiled where their claimed regions save too little to beat the
faster of those two; then, where the trace kept regions, the three together. The fastest
runs. That verdict is stored under the same key,
so a later compile builds only the side that won: eager compiles nothing at all. A compile
that left regions unmeasured (the floor's budget) stores it only where none of the regions
it measured won; otherwise the next compile measures more and stores it (_Compile.lasting).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.regions.choose import MEASURED_LATER
from fusegraph.regions.report import Row
from fusegraph.torch import phases, step_choice
from fusegraph.torch.decompositions import cacheable, decompose_rest, keep_whole
from fusegraph.torch.dynamo_verdict import (
    NO_REGION_EAGER,
    STORED_EAGER,
    STORED_GRAPHED,
    STORED_OWN,
    DynamoVerdict,
    dynamo_rows,
)
from fusegraph.torch.floor_budget import FloorBudget, budget_for
from fusegraph.torch.partition import Options, graph_device, partition
from fusegraph.torch.phases import phase

log = logging.getLogger("fusegraph.torch")

_ROWS: contextvars.ContextVar[list[Row] | None] = contextvars.ContextVar("fusegraph_torch_rows", default=None)
_COUNTER = itertools.count()


# the collectors open in any thread: on CUDA, autograd compiles and runs the backward graph
# in its own device thread, which does not see the caller's context variables
_OPEN: list[list[Row]] = []


@contextlib.contextmanager
def collecting() -> Iterator[list[Row]]:
    """Report rows of every graph compiled inside the block (explainer.py)."""
    rows: list[Row] = []
    token = _ROWS.set(rows)
    _OPEN.append(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)
        _OPEN.remove(rows)


def _sink() -> list[Row] | None:
    rows = _ROWS.get()
    if rows is None and _OPEN:
        rows = _OPEN[-1]
    return rows


def _claim(gm: torch.fx.GraphModule, opts: Options, kind: str, whole: bool = False,
           inputs: Sequence[Any] = (), gains: list[float] | None = None,
           budget: FloorBudget | None = None) -> tuple[list[Row], bool]:
    """The graph's regions claimed, and whether they were measured on device time: where
    the graph will be timed whole afterwards (``whole``) on a GPU with room for that
    (partition.py). Such regions still owe their host cost a measurement: _settle keeps
    them only where the whole graph was timed. ``gains``, ``budget``: see partition()."""
    device_time = False
    if whole:
        from fusegraph.torch.graph_floor import room

        device = graph_device(gm)
        device_time = device.type == "cuda" and not room(inputs, device)
    return partition(gm, opts, f"{kind}{next(_COUNTER)}", device_time=device_time, gains=gains,
                     budget=budget), device_time


def _report(rows: list[Row]) -> None:
    sink = _sink()
    if sink is not None:
        sink.extend(rows)


@dataclasses.dataclass(frozen=True)
class _Floor:
    """What the graph-level floor keys and stores a graph's verdict by (graph_floor.py)."""

    claimed: list[str]
    device: torch.device
    store: Any  # regions.verdicts.VerdictStore
    device_name: str
    versions: dict[str, str]

    @staticmethod
    def of(original: torch.fx.GraphModule, rows: list[Row]) -> _Floor:
        from fusegraph.engines.registry import REGISTRY
        from fusegraph.regions.verdicts import VerdictStore
        from fusegraph.select.device_id import device_id
        from fusegraph.select.tuning_db import engine_versions
        from fusegraph.torch.plans import PLANS

        device = graph_device(original)
        return _Floor([f"{r.node.split(':', 1)[-1]}|{r.where}" for r in rows if r.fusegraph], device, VerdictStore(),
                      device_id(PLANS.handle(device)), engine_versions(REGISTRY.available_engines()))


def _handed_back(rows: list[Row], verdict: Any, rest: str) -> list[Row]:
    return _not_kept(rows, f"handed back with the whole graph: {verdict.describe()}", rest)


def _not_kept(rows: list[Row], why: str, rest: str) -> list[Row]:
    return [dataclasses.replace(r, where=rest, why=f"{why} (the region: {r.why})") if r.fusegraph else r for r in rows]


def _stored_hand_back(original: torch.fx.GraphModule | None, inputs: Sequence[Any], rows: list[Row],
                      opts: Options) -> Any:
    """The graph-level verdict an earlier compile stored for this graph where it handed the
    claimed regions back (None otherwise): the first pass then compiles neither side."""
    if original is None or not any(r.fusegraph for r in rows):
        return None
    from fusegraph.torch import graph_floor

    floor = _Floor.of(original, rows)
    try:
        verdict = graph_floor.stored(original, inputs, floor.claimed, margin=opts.margin, store=floor.store,
                                     device_name=floor.device_name, versions=floor.versions)
    except Exception as exc:  # the usual path reads it again
        log.info("the stored graph verdict could not be read (%s: %s)", type(exc).__name__, exc)
        return None
    return verdict if verdict is not None and not verdict.fusegraph else None


def _settle(claimed_fn: Callable[..., Any], compile_original: Callable[[], Callable[..., Any]],
            original: torch.fx.GraphModule | None, inputs: Sequence[Any], rows: list[Row], opts: Options,
            rest: str, device_time: bool = False,
            verdicts: list[Any] | None = None) -> tuple[Callable[..., Any], list[Row]]:
    """The graph-level floor (graph_floor.py) where the floor is on and something was
    claimed; where the unclaimed graph wins, the rows returned say so. Regions measured on
    device time are handed back wherever the whole graph could not be timed. The verdict
    taken, if any, is appended to ``verdicts``."""
    if original is None or not any(r.fusegraph for r in rows):
        return claimed_fn, rows
    from fusegraph.torch import graph_floor

    floor = _Floor.of(original, rows)
    try:
        with phase(phases.GRAPH_CHECK):
            fn, verdict = graph_floor.settle(
                claimed_fn, compile_original, (original, inputs, floor.claimed), floor.device,
                engine="fusegraph regions", margin=opts.margin, warmup_s=opts.warmup_s, store=floor.store,
                device_name=floor.device_name, versions=floor.versions, verified_only=device_time)
    except Exception as exc:  # the claimed graph stands where the check itself cannot run
        log.warning("the graph-level check did not run (%s: %s); the %s graph is kept", type(exc).__name__, exc,
                    "unclaimed" if device_time else "claimed", exc_info=log.isEnabledFor(logging.DEBUG))
        if not device_time:
            return claimed_fn, rows
        from fusegraph.regions.verdicts import Verdict

        try:
            fn = compile_original()
        except Exception as again:  # nothing else to run: the claimed graph, whose regions each won
            log.warning("the unclaimed graph did not compile either (%s: %s); the claimed graph is kept",
                        type(again).__name__, again)
            return claimed_fn, rows
        verdict = Verdict(False, "refused", f"the graph check failed: {type(exc).__name__}: {exc}",
                          incumbent=graph_floor.INCUMBENT)
    if verdicts is not None:
        verdicts.append(verdict)
    return fn, (rows if verdict.fusegraph else _handed_back(rows, verdict, rest))


def _kind(gm: torch.fx.GraphModule) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return "bw" if any(n.startswith("tangents") for n in names) else "fw"


INDUCTORS_OWN = "no region kept in this graph: it runs Inductor's own compile"
NOT_MEASURED = ("not measured: an earlier compile of this graph left regions unmeasured too, so this "
                "compile's verdict is stored and the incumbent runs it")
NONE_WON = ("not measured: no region this compile measured won, so its verdict is stored and the incumbent "
            "runs it")


@dataclasses.dataclass
class _Compile:
    """One Dynamo graph's compile with Inductor as the rest. The first pass (``probing``)
    traces it as fusegraph must (ops it converts kept whole) and claims regions in each ATen
    graph, the backward lowered at once rather than at its first call; an ATen graph with
    nothing claimed is not compiled there (``skipped``). Where no graph keeps a region, the
    pass is dropped and the Dynamo graph goes to Inductor's own compile: the ops kept whole
    changed what AOTAutograd's partitioner saves for the backward and what it recomputes
    (a tiny ResNet-50's forward saved 138 tensors instead of 99), which cost a few percent
    even with every op re-decomposed afterwards (0.96x Inductor, ResNet-50 training on an
    H200 and on the CPU). The same cost stays where regions are kept: ResNet-50 training on
    an H200 kept two regions worth ~0.02 ms of a 23 ms step and ran at 0.95x Inductor, the
    per-ATen-graph check (graph_floor.py) unable to see it, since both of its sides come
    from this trace. So a trace that kept regions is then timed, forward and backward as a
    step, against Inductor's own compile of the Dynamo graph and eager (step_floor.py),
    and the fastest is returned. Where those two were timed first (``best``), a graph
    whose regions, with those claimed before it, save too little to win that step is not
    compiled at all (step_floor.trace_cannot_win). ``collect``: a trace compiling every graph keeps its rows
    too, for that check (the second trace after a backward claimed what its forward did not)."""

    probing: bool
    collect: bool = False
    kept: bool = False  # an ATen graph runs claimed regions
    skipped: bool = False  # an ATen graph was not compiled: nothing claimed in it, or all handed back
    redo: bool = False  # a graph kept regions after one was skipped: trace again, compiling each
    unmeasured: int = 0  # regions left unmeasured (the floor's budget): measured by a later compile
    failed: bool = False  # a graph check failed or could not time its graph: may go otherwise next time
    bounded: bool = False  # an earlier compile left regions unmeasured: this one's verdict is stored anyway
    measured: int = 0  # regions with a measured verdict, this compile's or a stored one
    won: bool = False  # a region won its floor (alone, before any graph-level check)
    rows: list[Row] = dataclasses.field(default_factory=list)
    best: Any = None  # the step check's verdict between Inductor's own and eager, taken before the trace
    gain: float = 0.0  # what the regions claimed so far save, measured alone (partition.py)
    budget: FloorBudget | None = None  # what the region floor may spend over the Dynamo graph (partition.py)

    @property
    def lasting(self) -> bool:
        """Whether this compile's verdict is stored: every verdict it took would be taken
        again, or measuring stops here: an earlier compile left regions unmeasured too
        (DynamoVerdict.explored_before), or regions were measured and none won, so the
        rest are not worth a second compile's trace and budget (every region of the five
        benchmark models' training lost or tied on an H200)."""
        return not self.failed and (not self.unmeasured or self.bounded or self.no_region_won)

    @property
    def no_region_won(self) -> bool:
        return self.measured > 0 and not self.won

    def settled(self, rows: list[Row]) -> list[Row]:
        """The rows as the compile's verdict leaves them: where it is stored with regions
        left unmeasured, no later compile measures them, and their rows say why."""
        if not (self.unmeasured and self.lasting):
            return rows
        why = NOT_MEASURED if self.bounded else NONE_WON
        return [dataclasses.replace(r, why=r.why.replace(MEASURED_LATER, why)) for r in rows]

    def report(self, rows: list[Row]) -> None:
        left = {(r.node.split(":", 1)[0], r.region) for r in rows if ": unmeasured" in r.why}
        self.unmeasured += len(left)
        self.measured += len({(r.node.split(":", 1)[0], r.region) for r in rows if r.region is not None
                              and (": measured" in r.why or ": cached" in r.why)})
        if self.probing or self.collect:
            self.rows.extend(rows)
        else:
            _report(rows)


def _skipped(args: list[Any]) -> Any:
    """Stands for an ATen graph the first pass did not compile; that pass's result is never run."""
    raise AssertionError("fusegraph: a graph left uncompiled by the first pass was run")


_skipped._boxed_call = True  # type: ignore[attr-defined]


def _inductor_inner(opts: Options, state: _Compile, patches: dict[str, Any] | None) -> Callable[..., Any]:
    """Inductor's ``inner_compile`` with fusegraph's regions claimed first (module docstring)."""
    from torch._inductor.compile_fx import compile_fx_inner

    from fusegraph.torch.graph_floor import copy_graph

    def inner(graph: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        # under CUDA graphs both sides would be captured and replayed: the regions' verdicts decide
        original = copy_graph(graph) if opts.floor and opts.whole_graph and patches is None else None
        gains: list[float] = []
        rows, device_time = _claim(graph, opts, _kind(graph), original is not None, inputs, gains, state.budget)
        claimed = any(r.fusegraph for r in rows)
        state.won = state.won or claimed
        if state.probing and claimed and state.best is not None:
            state.gain += sum(gains)
            from fusegraph.torch.step_floor import trace_cannot_win

            futile = trace_cannot_win(state.gain, state.best, opts.margin)
            if futile:  # as good as nothing claimed (the gain only grows: nothing was kept before)
                state.skipped = True
                state.report(_not_kept(rows, futile, "inductor"))
                return _skipped
        if state.probing and not state.kept:
            handed_back = _stored_hand_back(original, inputs, rows, opts)
            if not claimed or handed_back is not None:  # nothing claimed, or as good as that: not compiled
                state.skipped = True
                state.report(rows if handed_back is None else _handed_back(rows, handed_back, "inductor"))
                return _skipped
            if state.skipped and original is None:  # kept unmeasured, and the forward was not compiled
                state.redo = True
                return _skipped
        rest, settled = decompose_rest(graph, inputs)
        compiled = compile_fx_inner(rest, inputs, **cacheable(settled, kwargs))
        # each compile records its outputs' strides in the tracing context, which must
        # hold the strides of the one returned
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        strides: dict[str, list[Any]] = {}

        def compile_original() -> Any:
            if context is not None and context.output_strides is not None:
                strides["claimed"] = list(context.output_strides)
                context.output_strides.clear()
            assert original is not None
            whole, whole_settled = decompose_rest(original, inputs)
            return compile_fx_inner(whole, inputs, **cacheable(whole_settled, kwargs))

        verdicts: list[Any] = []
        chosen, rows = _settle(compiled, compile_original, original, inputs, rows, opts, "inductor", device_time,
                               verdicts)
        # a graph check that failed or could not time the graph (memory) may go otherwise next time
        if any(v.source not in ("measured", "cached") for v in verdicts):
            state.failed = True
        if chosen is compiled and context is not None and context.output_strides is not None and "claimed" in strides:
            context.output_strides[:] = strides["claimed"]
        kept = chosen is compiled and claimed
        if state.probing and state.skipped:  # an earlier graph (the forward) was not compiled
            state.redo = state.redo or kept  # handed back: as good as nothing claimed
            state.report(rows)
            return _skipped
        state.kept = state.kept or kept
        state.report(rows)
        return chosen

    return inner


def _with_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options,
                   mode: str | None) -> Callable[..., Any]:
    """Inductor compiles what fusegraph leaves; where nothing is claimed, Inductor's own
    compile of the Dynamo graph runs (_Compile). Costs one more AOTAutograd trace there
    (the first pass compiles nothing), once: with the floor on, that conclusion is stored
    (dynamo_verdict.py) and a later compile of the graph runs Inductor's own compile at
    once. With the floor on and no CUDA graphs (``checked``), the step check (step_floor.py)
    times eager against Inductor's own compile before the trace, and again with the trace
    where it kept regions; its verdict is stored instead: a later compile builds only the
    winner (eager: nothing).
    With the floor off every region fusegraph can build is claimed, so nothing is stored or
    read."""
    import torch._functorch.config as functorch_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    # Inductor's own options for the mode, as torch.compile(model, mode=mode) sets them (an
    # unknown mode is refused here, before any trace, with Inductor's message)
    own = list_mode_options(mode) if mode is not None else {}
    patches = {"triton.cudagraphs": True} if mode in ("reduce-overhead", "max-autotune") else None

    def trace(state: _Compile, **config: Any) -> Callable[..., Any]:
        # AOTAutograd's cache keys the graph, not inner_compile: a graph Inductor compiled
        # before (this process or an earlier one, on disk) came back as Inductor's code,
        # nothing claimed (found by benchmarks/bench_torch.py: inductor timed first)
        with functorch_config.patch(enable_autograd_cache=False, **config):
            return compile_fx(gm, example_inputs,  # type: ignore[return-value]
                              inner_compile=_inductor_inner(opts, state, patches), config_patches=patches,
                              decompositions=keep_whole())

    # under CUDA graphs every side would be captured and replayed: the regions' verdicts decide
    checked = opts.floor and opts.whole_graph and patches is None
    own_verdict: DynamoVerdict | None = None
    if opts.floor:
        try:
            own_verdict = DynamoVerdict.of(gm, example_inputs, opts, mode, checked)
        except Exception as exc:  # nothing stored or read: the usual path
            log.info("no Dynamo graph verdict key (%s: %s)", type(exc).__name__, exc)
    stored = own_verdict.lookup() if own_verdict is not None else None

    from fusegraph.torch import cuda_graphs, step_floor
    from fusegraph.torch.graph_floor import copy_graph

    own_s: list[float] = []  # how long Inductor's own compile took (the floor's "auto" budget)

    def compile_inductors(patches: dict[str, Any] | None = None) -> Callable[..., Any]:
        # the backward lowered now, not at its first call (the same graph: AOTAutograd
        # gives it the forward's strides either way): lowered lazily inside this compile,
        # as the timing's first step would, it sets Dynamo's compile metrics twice. The
        # setting is part of AOTAutograd's cache key, so a stored verdict's compile uses it
        # too: lowered lazily there, it missed the entry the check's compile saved (a GPT-2's
        # third run on an H200: 10.4 s against Inductor's 5.1)
        t0 = time.perf_counter()
        with functorch_config.patch(force_non_lazy_backward_lowering=True), phase(phases.OWN):
            fn = compile_fx(gm, example_inputs, config_patches={**own, **(patches or {})} or None)
        if patches is None:
            own_s.append(time.perf_counter() - t0)
        return fn  # type: ignore[return-value]

    def compile_own() -> Callable[..., Any]:
        return compile_inductors()

    def compile_graphed() -> Callable[..., Any]:  # a candidate of the step check on a GPU
        return cuda_graphs.owned(compile_inductors(cuda_graphs.PATCHES))

    graphed = compile_graphed if opts.cuda_graphs and step_floor.device_of(example_inputs).type == "cuda" else None
    if own_verdict is not None and stored is not None and not stored.fusegraph:
        side = step_floor.winner(stored)
        if side == step_floor.GRAPHED and graphed is not None:
            log.info("%s (%s)", STORED_GRAPHED, stored.describe())
            _report(dynamo_rows(gm, step_floor.WHERE[side], own_verdict.why(stored, STORED_GRAPHED)))
            return graphed()
        if side == step_floor.EAGER:  # nothing compiled at all
            log.info("%s (%s)", STORED_EAGER, stored.describe())
            _report(dynamo_rows(gm, step_floor.WHERE[side], own_verdict.why(stored, STORED_EAGER)))
            # the generated forward itself: a lazy module's forward read before its code exists
            # is a wrapper that checks for it at every call (nothing here keys Inductor's cache)
            gm.code  # noqa: B018
            return gm.forward
        if not checked or stored.incumbent_ms is not None:
            log.info("%s (%s)", STORED_OWN, stored.describe())
            _report(dynamo_rows(gm, "inductor", own_verdict.why(stored)))
            if checked:  # compiled as the step check compiled it, so AOTAutograd's cache has it
                return compile_own()
            with phase(phases.OWN):
                return compile_fx(gm, example_inputs, config_patches=own or None)  # type: ignore[return-value]
        # "no region kept", stored before eager was timed (or where the check could not run): timed now
        module = copy_graph(gm)  # before Inductor's pre-grad passes rewrite ``gm`` in place
        settled = step_choice.settle(gm, example_inputs, compile_own, module.forward, margin=opts.margin,
                                     warmup_s=opts.warmup_s, samples=opts.loop_steps, graphed=graphed,
                                     record=own_verdict.record_step)
        verdict = settled.verdict
        if verdict is not None and not step_choice.pending(settled.fn):
            own_verdict.record_step(verdict)
        why = own_verdict.why(stored, "fusegraph's trace: a stored verdict found no region kept")
        why += step_choice.later(settled.fn)
        _report(dynamo_rows(gm, step_floor.WHERE[settled.side],
                            f"{step_floor.reason(verdict)}; {why}" if verdict else why))
        return settled.fn
    eager = copy_graph(gm) if checked else None
    own_once = functools.cache(compile_own)  # the step check may ask for it twice: compiled once
    state = _Compile(probing=True, bounded=own_verdict is not None and stored is None and own_verdict.explored_before())
    best = None
    if eager is not None and stored is None and not step_floor.why_not(gm, example_inputs):
        # Inductor's own compile and eager first: the step they take bounds what the trace
        # must save, so a trace that cannot win is not compiled (_Compile). Both get ``gm``
        # itself: a copy_graph copy changes what AOTAutograd's partitioner saves (a tiny
        # ConvBN saved a transposed weight instead of the weight), and Inductor's pre-grad
        # passes, which rewrite it in place, give the same graph when run again.
        try:
            best = step_choice.settle(gm, example_inputs, own_once, eager.forward, margin=opts.margin,
                                      warmup_s=opts.warmup_s, samples=opts.loop_steps, graphed=graphed,
                                      record=_recorder(own_verdict, state))
        except Exception as exc:  # Inductor's own failed: the trace may still run, as before
            log.warning("Inductor's own compile of the Dynamo graph failed (%s: %s)", type(exc).__name__, exc)
        state.best = best.verdict if best is not None else None
    state.budget = budget_for(opts, step_floor.device_of(example_inputs), own_s[0] if own_s else None)
    try:
        with phase(phases.FIRST_PASS):
            first = trace(state, force_non_lazy_backward_lowering=True)
    except Exception as exc:  # the single trace of before, which compiles every graph as it comes
        log.warning("the first pass failed (%s: %s); traced again, every graph compiled", type(exc).__name__, exc,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        return trace(_Compile(probing=False, budget=state.budget))
    state.probing = False
    if state.redo:
        log.info("a backward graph claimed regions where its forward claimed none: traced again")
        if eager is None:
            return trace(_Compile(probing=False, budget=state.budget))
        # every graph compiled, then the step check
        state = _Compile(probing=False, collect=True, budget=state.budget, bounded=state.bounded)
        with phase(phases.FIRST_PASS):
            first = trace(state, force_non_lazy_backward_lowering=True)
    if state.kept:
        return _against_others(first, own_once, eager, gm, example_inputs, opts, state, own_verdict,
                               stored if checked else None, graphed)
    side, chosen, found = step_floor.OWN, None, None
    if best is None and eager is not None:
        best = step_choice.settle(gm, example_inputs, own_once, eager.forward, margin=opts.margin,
                                  warmup_s=opts.warmup_s, samples=opts.loop_steps, graphed=graphed,
                                  record=_recorder(own_verdict, state))
    if best is not None:
        side, chosen, found = best.side, best.fn, best.verdict
    if own_verdict is not None and not (chosen is not None and step_choice.pending(chosen)):
        _store(own_verdict, state, functools.partial(own_verdict.record_step, found) if found is not None
               else functools.partial(own_verdict.record, state.rows))
    # the node's own reason first (bench_torch.py groups and truncates them)
    end = f"{step_floor.reason(found)}; " if found is not None else ""
    end += NO_REGION_EAGER if side == step_floor.EAGER else INDUCTORS_OWN
    end += step_choice.later(chosen) if chosen is not None else ""
    _report([dataclasses.replace(r, where=step_floor.WHERE[side], why=f"{r.why}; {end}" if r.why else end)
             for r in state.settled(state.rows)])
    if chosen is not None:
        return chosen
    with phase(phases.OWN):
        return compile_fx(gm, example_inputs, config_patches=own or None)  # type: ignore[return-value]


def _against_others(first: Callable[..., Any], compile_own: Callable[[], Callable[..., Any]],
                    eager: torch.fx.GraphModule | None, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    opts: Options, state: _Compile, own_verdict: DynamoVerdict | None, stored: Any,
                    graphed: Callable[[], Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """A trace that kept regions timed as a step against Inductor's own compile of the
    Dynamo graph and against eager (step_floor.py; ``eager`` None: not checked, the floor
    off or CUDA graphs), unless a stored verdict already chose the trace; the rows say which
    ran and why. Where the check cannot run the trace stands, as before the check."""
    from fusegraph.torch import step_floor

    rows = state.settled(state.rows)
    if eager is None:
        _report(rows)
        return first
    if stored is not None:  # the trace won before: nothing else is compiled or timed
        log.info("fusegraph's trace: a stored verdict chose it (%s)", stored.describe())
        side, fn, verdict = step_floor.TRACE, first, stored
    else:
        settled = step_choice.settle(gm, example_inputs, compile_own, eager.forward, first, margin=opts.margin,
                                     warmup_s=opts.warmup_s, samples=opts.loop_steps, graphed=graphed,
                                     record=_recorder(own_verdict, state))
        side, fn, found = settled.side, settled.fn, settled.verdict
        if found is None:
            later = step_choice.later(fn)
            _report([dataclasses.replace(r, why=f"{r.why}{later}") if r.fusegraph else r for r in rows])
            return fn
        verdict = found
        if own_verdict is not None and not step_choice.pending(fn):
            _store(own_verdict, state, functools.partial(own_verdict.record_step, verdict))
    why = step_floor.reason(verdict) + step_choice.later(fn)
    if side == step_floor.TRACE:
        _report([dataclasses.replace(r, why=f"{r.why}; {why}") if r.fusegraph else r for r in rows])
    else:  # the node's own reason first, as with INDUCTORS_OWN
        _report([dataclasses.replace(r, where=step_floor.WHERE[side], why=f"{r.why}; {why}" if r.why else why)
                 for r in rows])
    return fn


def _store(own_verdict: DynamoVerdict, state: _Compile, record: Callable[[], None]) -> None:
    own_verdict.store_or_mark(record, lasting=state.lasting, unmeasured=0 if state.failed else state.unmeasured)


def _recorder(own_verdict: DynamoVerdict | None, state: _Compile) -> Callable[[Any], None] | None:
    """Where a step verdict taken later (step_choice.py) is stored, if it would last: the
    compile's ``lasting`` is read when the verdict comes, after the compile's trace."""
    if own_verdict is None:
        return None
    store = own_verdict

    def record(verdict: Any) -> None:
        _store(store, state, functools.partial(store.record_step, verdict))

    return record


def fusegraph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                      options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    opts = Options.of(options)
    if opts.rest == "inductor":
        from fusegraph.torch import step_floor

        if step_floor.fakified_first_call():
            # In DDP's graph split each piece's backward lowered lazily takes the next of
            # DDP's per-piece metadata in reverse order, one per piece: a piece that compiles
            # two sides (the step check), or none lazily, would shift the others'
            import torch._functorch.config as functorch_config

            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                return _with_inductor(gm, example_inputs, opts, mode)
        return _with_inductor(gm, example_inputs, opts, mode)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from fusegraph.torch.graph_floor import copy_graph

    def eager(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        original = copy_graph(graph) if opts.floor and opts.whole_graph else None
        rows, device_time = _claim(graph, opts, _kind(graph), original is not None, inputs)
        fn, rows = _settle(make_boxed_func(graph.forward), lambda: make_boxed_func(original.forward),  # type: ignore[union-attr]
                           original, inputs, rows, opts, "torch.eager", device_time)
        _report(rows)
        return fn

    return aot_autograd(fw_compiler=eager, bw_compiler=eager, inference_compiler=eager)(gm, example_inputs)  # type: ignore[no-any-return]


backend = fusegraph_backend

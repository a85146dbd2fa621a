"""One ATen graph (AOTAutograd's forward or backward) partitioned: converted to a fusegraph
graph (aten.py), split into regions by the region layer, each region's verdict taken
against the incumbent (Inductor's code for the same ATen nodes, or with the floor off none),
and each claimed region's ATen nodes replaced in place by one call of the custom op
``fusegraph::region`` (runtime.py). Deterministic: nodes are visited in graph order and
regions in the order the region layer gives them. Returns the report rows for every
ATen node: where it runs and why.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError, OptionError
from fusegraph.graph.order import ranked_order
from fusegraph.regions import Region, split
from fusegraph.regions.choose import Choice, Chooser
from fusegraph.regions.incumbent import CallableIncumbent
from fusegraph.regions.measure import MARGIN, measure
from fusegraph.regions.report import Row
from fusegraph.regions.verdicts import Verdict, VerdictStore
from fusegraph.torch import aten, phases, plans, runtime
from fusegraph.torch.floor_budget import FloorBudget
from fusegraph.torch.phases import phase
from fusegraph.torch.plans import PLANS

log = logging.getLogger("fusegraph.torch")

# ATen ops that move or alias data: not compute, so not counted in coverage
NOT_COMPUTE = frozenset({
    "getitem", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "detach", "alias",
    "unsqueeze", "squeeze", "as_strided", "_to_copy", "clone", "slice", "select", "split", "contiguous",
})


# The screen's factor (Options.screen). On the CPU (the 5 tiny models of bench_torch.py,
# training, OMP_NUM_THREADS=1, all three sides timed together per region): 221 regions, each
# plan 1.13-18.4x its ATen ops run eagerly, Inductor's code 0.20-1.88x them; none won against
# Inductor. The 211 at 1.5x or more would have been screened; each of them took at least
# 1.29x Inductor's time, so the screen dropped no winner there.
SCREEN = 1.5


@dataclass(frozen=True)
class Options:
    """The backend's ``options``: ``floor`` (measure each region against the incumbent; off
    claims every region fusegraph can build), ``incumbent`` ("inductor" or "eager": the
    region's ATen nodes as PyTorch runs them), ``rest`` (what compiles the unclaimed nodes:
    "inductor" or "eager"), ``engine`` (None: selection's choice on a GPU, torch on the CPU),
    ``margin`` (how much faster fusegraph must be), ``warmup_s`` (timing's warm-up bound),
    ``whole_graph`` (with the floor on, also time the graph with its claimed regions against
    the graph with none and run the faster: graph_floor.py), ``screen`` (with the floor on and
    Inductor the incumbent: a region whose plan takes at least this many times as long as its
    ATen ops run eagerly is not compiled by Inductor to be measured against it (_screen);
    0: every region is), ``budget`` (seconds the region floor may spend on regions without
    a stored verdict over one Dynamo graph's compile: floor_budget.py; None: no limit),
    ``loop_steps`` (the user's training steps timed per side where the step check leaves
    more than one side close: loop_trial.py; 0: the compile-time check alone), ``cuda_graphs``
    (on a GPU, the step check may also try Inductor's own compile replayed as CUDA graphs,
    its results copied out of their pool: cuda_graphs.py; False: never)."""

    floor: bool = True
    incumbent: str = "inductor"
    rest: str = "inductor"
    engine: str | None = None
    margin: float = MARGIN
    warmup_s: float = 0.3
    whole_graph: bool = True
    screen: float = SCREEN
    budget: float | str | None = "auto"
    loop_steps: int = 5
    cuda_graphs: bool = True

    @staticmethod
    def of(options: Mapping[str, Any] | None) -> Options:
        given = dict(options or {})
        known = set(Options.__dataclass_fields__)
        unknown = sorted(set(given) - known)
        if unknown:
            raise OptionError(f"fusegraph backend: unknown options {unknown} (it takes {sorted(known)})")
        opts = Options(**given)
        if opts.incumbent not in ("inductor", "eager") or opts.rest not in ("inductor", "eager"):
            raise OptionError("fusegraph backend: incumbent and rest are 'inductor' or 'eager'")
        if not isinstance(opts.screen, int | float) or opts.screen < 0:
            raise OptionError(f"fusegraph backend: screen is a factor >= 0 (0: off), got {opts.screen!r}")
        b = opts.budget
        if not (b is None or b == "auto" or (isinstance(b, int | float) and not isinstance(b, bool) and b >= 0)):
            raise OptionError(f"fusegraph backend: budget is 'auto', seconds >= 0 or None (no limit), got {b!r}")
        if not isinstance(opts.loop_steps, int) or isinstance(opts.loop_steps, bool) or opts.loop_steps < 0:
            raise OptionError(f"fusegraph backend: loop_steps is a count of steps >= 0, got {opts.loop_steps!r}")
        if not isinstance(opts.cuda_graphs, bool):
            raise OptionError(f"fusegraph backend: cuda_graphs is True or False, got {opts.cuda_graphs!r}")
        return opts


def op_name(n: torch.fx.Node) -> str:
    t = n.target
    if t is operator.getitem:
        return "getitem"
    schema = getattr(t, "_schema", None)
    return f"aten.{schema.name.split('::')[-1]}" if schema is not None else str(getattr(t, "__name__", t))


def is_compute(n: torch.fx.Node) -> bool:
    return op_name(n).removeprefix("aten.") not in NOT_COMPUTE


def _key_of(n: torch.fx.Node) -> aten.Key:
    if n.op == "call_function" and n.target is operator.getitem:
        src = n.args[0]
        assert isinstance(src, torch.fx.Node)
        idx: Any = n.args[1]
        return (src.name, int(idx))
    return (n.name, None)


def partition(gm: torch.fx.GraphModule, opts: Options, phase: str, *, device_time: bool = False,
              gains: list[float] | None = None, budget: FloorBudget | None = None) -> list[Row]:
    """Rewrites ``gm`` in place (claimed regions -> ``fusegraph::region`` calls); the rows
    say where every ATen node runs. ``device_time`` (a GPU graph that will be timed whole
    afterwards): each region is measured against its incumbent on device time alone
    (select/cuda_clock.py). Timed alone, a region's call is host-bound -- 40-110 us of
    Python and dispatch around a 30 us kernel -- while in a graph whose host runs ahead of
    the GPU that time overlaps the kernels before it; whether it does is the whole-graph
    check's to measure (graph_floor.py), which needs the regions whose kernels win.
    ``gains``: each claimed region's measured time saved (its incumbent's ms less
    fusegraph's; infinite where a region was claimed unmeasured) is appended there.
    ``budget``: what the region floor may still spend (FloorBudget), spent here."""
    rest = "inductor" if opts.rest == "inductor" else "torch.eager"
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    conv = aten.convert(gm.graph, f"{phase}")
    why: dict[str, str] = dict(conv.refused)
    region_of: dict[str, tuple[Choice, str]] = {}
    if conv.graph.nodes:
        try:
            conv.graph.validate()
            # a GPU's measured regions run on kernel engines (plans.py), which take no reshape or transpose
            kernel_only = graph_device(gm).type == "cuda" and opts.floor and not (opts.engine or plans.PLANS.engine)
            regions = split(conv.graph, opaque=conv.opaque, atoms=conv.atoms, movement=not kernel_only)
        except FusegraphError as exc:
            regions = None
            for name in conv.converted:
                why[name] = f"the converted graph did not validate: {exc}"
        if regions is not None:
            for rej in regions.rejected:
                for gnode in rej.nodes:
                    why.setdefault(conv.atoms[gnode], rej.reason)
            device = graph_device(gm)
            by_name = {n.name: n for n in nodes}
            index = _Index.of(conv, by_name)
            fx_of = {r.index: _fx_nodes(r, conv, by_name, index) for r in regions.regions}
            device_time = device_time and device.type == "cuda" and opts.floor
            choices = _choose(opts, device, regions.regions, device_time, budget) if regions.regions else []
            replaced: dict[aten.Key, torch.fx.Node] = {}
            for choice in choices:
                fx_names = fx_of[choice.region.index]
                for name in fx_names:
                    region_of[name] = (choice, "")
                if choice.claimed and opts.floor and not any(is_compute(by_name[n]) for n in fx_names):
                    # measured alone it can beat Inductor's one-op kernel; in the graph Inductor
                    # fuses it into its neighbours for free, and a call of its own costs more
                    for name in fx_names:
                        region_of[name] = (choice, "not kept: it only moves data (Inductor fuses that into its neighbours)")
                    continue
                if choice.claimed:
                    try:
                        _check_convex(gm, fx_names)
                        _replace(gm, choice.region, fx_names, conv, replaced, not opts.floor)
                        if gains is not None:
                            gains.append(_gain(choice.verdict))
                    except Exception as exc:  # never worse than not claiming
                        log.warning("region %d (%s) not claimed: %s", choice.region.index, choice.region.pattern, exc)
                        for name in fx_names:
                            region_of[name] = (choice, f"rewrite failed: {exc}")
            if any(c.claimed for c in choices):
                _sort(gm)
                gm.recompile()
    rows = []
    base = next(_REGION_BLOCKS) * 10_000  # region numbers unique across the graphs of a report
    for n in nodes:
        if n.target is operator.getitem:
            continue
        found = region_of.get(n.name)
        if found is not None:
            choice, failed = found
            claimed = choice.claimed and not failed
            where = f"fusegraph:{choice.verdict.engine}" if claimed else rest
            why_row = failed or choice.verdict.describe()
            if not failed and device_time and choice.verdict.source in ("measured", "cached"):
                why_row += " (device time; the host's share is judged with the whole graph)"
            rows.append(Row(f"{phase}:{n.name}", op_name(n), where, base + choice.region.index, choice.region.pattern,
                            why_row, is_compute(n)))
        else:
            rows.append(Row(f"{phase}:{n.name}", op_name(n), rest, None, "", why.get(n.name, "not converted"),
                            is_compute(n)))
    return rows


def _gain(verdict: Verdict) -> float:
    """What a claimed region saved where it was timed (on device time, or alone on the host:
    either way no less than it saves inside the graph, where Inductor also fuses across its
    borders); unknown (unmeasured, or the floor off) counts as unbounded."""
    if verdict.source in ("measured", "cached") and verdict.fusegraph_ms is not None \
            and verdict.incumbent_ms is not None:
        return max(verdict.incumbent_ms - verdict.fusegraph_ms, 0.0)
    return math.inf


def _choose(opts: Options, device: torch.device, regions: Sequence[Region], device_time: bool = False,
            budget: FloorBudget | None = None) -> list[Choice]:
    """The regions' verdicts, taken in a thread of their own: the floor measures on real
    tensors, outside the compile it sits in, as the compiled graph will run -- a forward graph
    is compiled under its fake mode (the incumbent failed on FakeTensors, every region was
    kept unmeasured), the incumbent's own Inductor compile must not add guards to the outer
    graph's shape environment (Dynamo then failed building its guards), and AOTAutograd's
    dispatch state (the Python dispatcher among its thread's dispatch keys) made every ATen
    call on either side go through Python (region calls timed ~60 us slower than they run).
    A new thread starts with none of it; gradients off, as inside AOTAutograd's graphs.

    On the CPU the timing itself comes back to the compiling thread (the one the graph will
    run on), outside the compile's fake mode and Python dispatcher as graph_floor.py times
    a whole graph: Inductor's OpenMP kernels ran 2-10x slower in the second thread while the
    caller's OpenMP team existed, so regions won there that lost in the graph."""
    import queue
    from concurrent.futures import Future, ThreadPoolExecutor

    from torch._dispatch.python import no_python_dispatcher

    from fusegraph.select import timing
    from fusegraph.torch.graph_floor import outside_the_compile

    jobs: queue.Queue[tuple[Any, dict[str, Any], Future[Any]]] = queue.Queue()

    def on_this_thread(candidates: Any, **kwargs: Any) -> Any:
        done: Future[Any] = Future()
        jobs.put((candidates, kwargs, done))
        return done.result()

    timer = on_this_thread if device.type == "cpu" else None

    def run() -> list[Choice]:
        # a new thread's current CUDA device is 0: the region's device, as the graph runs it
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), no_python_dispatcher(), on_device, phase(phases.REGION_FLOOR):
            chooser = _chooser(opts, device, timer, device_time)
            t0 = time.perf_counter()
            with phase(phases.SCREEN):
                screened = _screen(chooser, opts, regions, _inputs(device), budget)
            if budget is not None:  # the chooser gets what the screen left
                budget.spent_s += time.perf_counter() - t0
                chooser.budget_s, chooser.budget_total_s = budget.left_s, budget.seconds
            rest = [r for r in regions if r.index not in screened]
            t0 = time.perf_counter()
            chosen = {c.region.index: c for c in chooser.choose_all(rest, _inputs(device))} if rest else {}
            if budget is not None:
                budget.spent_s += time.perf_counter() - t0
            return [screened.get(r.index) or chosen[r.index] for r in regions]

    with ThreadPoolExecutor(1, thread_name_prefix="fusegraph-floor") as pool:
        chosen = pool.submit(run)
        while not chosen.done() or not jobs.empty():
            try:
                candidates, kwargs, done = jobs.get(timeout=0.005)
            except queue.Empty:
                continue
            try:
                with outside_the_compile(device):
                    done.set_result(timing.time_candidates(candidates, **kwargs))
            except BaseException as exc:  # handed to the chooser, which treats it as the timer's own
                done.set_exception(exc)
        return chosen.result()


EAGER_OPS = "its ATen ops run eagerly (the screen)"  # the screen's verdicts' incumbent


def _screen(chooser: Chooser, opts: Options, regions: Sequence[Region],
            inputs: Callable[[Region], Mapping[str, Any]], budget: FloorBudget | None = None) -> dict[int, Choice]:
    """The regions that need no Inductor compile to be decided, by index, each with its
    verdict: an Inductor compile per region was most of a cold compile (a tiny GPT-2 on the
    CPU: 23.8 of 35.8 s, for 29 regions that all lost). Before that compile, fusegraph's plan
    (built for the floor anyway) is timed against the region's ATen ops run eagerly, which
    cost nothing to prepare; where it takes ``opts.screen`` times as long or more, it could
    win only if Inductor's code for the same ops ran that much slower than eager's (times the
    margin), and the region is decided without Inductor: not claimed, the verdict stored under
    a key of its own with both times. A region whose stored verdict against Inductor exists,
    that fusegraph cannot build, or that passes the screen is left to the chooser, as before;
    one content key is screened once. Past the ``budget`` a region is left to the chooser,
    which leaves it unmeasured when it finds the budget spent too."""
    if not (opts.floor and opts.incumbent == "inductor" and opts.screen > 0):
        return {}
    deadline = time.perf_counter() + budget.left_s if budget is not None else math.inf
    found: dict[str, Verdict | None] = {}
    out: dict[int, Choice] = {}
    for region in regions:
        if region.key not in found:
            found[region.key] = _screen_one(chooser, opts, region, inputs, deadline)
        verdict = found[region.key]
        if verdict is not None:
            out[region.index] = Choice(region, verdict)
    if chooser.store is not None:
        chooser.store.flush()
    return out


def screen_key(chooser: Chooser, region: Region, screen: float) -> str:
    """The screen verdict's key: the chooser's settings, the screen's factor, the eager incumbent."""
    return chooser.key(region, incumbent=EAGER_OPS, extra={"screen": screen})


def _screen_one(chooser: Chooser, opts: Options, region: Region,
                inputs: Callable[[Region], Mapping[str, Any]], deadline: float = math.inf) -> Verdict | None:
    """The region's screen verdict, or None where the chooser decides it."""
    if chooser.stored(region):  # a verdict against Inductor decides it, as before
        return None
    key = screen_key(chooser, region, opts.screen)
    if chooser.store is not None and (stored := chooser.store.lookup(key)) is not None:
        return stored
    if time.perf_counter() >= deadline:  # the floor's budget is spent: nothing built
        return None
    built = chooser.build(region)
    if not isinstance(built, ExecutionPlan):  # refused: the chooser says why, nothing compiled either way
        return None
    pack = dict(inputs(region))
    eager = _incumbent_call(region, pack, replace(opts, incumbent="eager"))
    timed = measure(lambda: built.execute(pack), eager, incumbent=EAGER_OPS, engine=str(built.config),
                    margin=opts.margin, sync=chooser.sync, timer=chooser.timer, **dict(chooser.timing_options))
    if timed.source == "refused":  # fusegraph's plan failed when timed: no Inductor compile for that
        return timed
    if timed.fusegraph_ms is None or timed.incumbent_ms is None or timed.incumbent_ms <= 0:
        return None  # the eager ops failed: measured against Inductor as before
    ratio = timed.fusegraph_ms / timed.incumbent_ms
    if ratio < opts.screen:
        return None
    why = (f"screened: fusegraph's plan took {ratio:.2f}x its ATen ops run eagerly (screen {opts.screen:g}x), "
           f"so Inductor's code was not compiled for it: fusegraph would win only where that ran "
           f"{ratio * (1 + opts.margin):.2f}x slower than eager's ops")
    verdict = Verdict(False, "measured", why, timed.engine, timed.fusegraph_ms, timed.incumbent_ms, EAGER_OPS)
    log.info("region %d (%s): %s", region.index, region.pattern, verdict.describe())
    if chooser.store is not None:
        chooser.store.record(key, verdict)
    return verdict


def graph_device(gm: torch.fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _chooser(opts: Options, device: torch.device, timer: Any = None, device_time: bool = False) -> Chooser:
    handle = PLANS.handle(device)
    engine = opts.engine or PLANS.engine or ("torch" if device.type == "cpu" else None)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    incumbent = CallableIncumbent(opts.incumbent, lambda region, inputs: _incumbent_call(region, inputs, opts))
    def build(region: Region) -> ExecutionPlan:
        with plans.engine(engine), phase(phases.BUILDS):
            plan = PLANS.get(("region", region.key) + (() if opts.floor else (plans.ANY_ENGINE,)), device,
                             lambda: region.graph)
        if not opts.floor:
            return plan
        # the floor times the region as the rewritten graph will call it: through the op
        sub = _SUBS[region.key]
        extra = _extra_args(sub, len(region.inputs))
        return runtime.RegionCall(plan, runtime.register(sub, region.key), len(region.inputs), extra)

    timing_options: dict[str, Any] = {"warmup_s": opts.warmup_s}
    if device_time:
        from fusegraph.select.cuda_clock import CudaClock

        timing_options["device_clock"] = CudaClock(device)
    from fusegraph.torch.graph_floor import math_state

    return Chooser(handle, incumbent, floor=opts.floor, engine=engine, margin=opts.margin,
                   store=VerdictStore() if opts.floor else None, sync=sync, timer=timer,
                   timing_options=timing_options, builder=build,
                   key_options={**math_state(), **({"clock": "device"} if device_time else {})})


_REGION_BLOCKS = itertools.count()
_SUBS: dict[str, torch.fx.GraphModule] = {}  # region content key -> its ATen nodes, for the incumbent


def _incumbent_call(region: Region, inputs: Mapping[str, Any], opts: Options) -> Callable[[], object]:
    sub = _SUBS[region.key]
    args: list[Any] = [inputs[f"in{i}"] for i in range(len(region.inputs))]
    args += _extra_args(sub, len(args))
    if opts.incumbent == "eager":
        return lambda: sub(*args)
    from torch._inductor import compile as inductor_compile

    with phase(phases.INCUMBENT):
        compiled = inductor_compile(sub, args)
    return lambda: compiled(*args)


def _extra_args(sub: torch.fx.GraphModule, arity: int) -> list[torch.Tensor | int]:
    """Values for the placeholders after the region graph's inputs: operands nothing in the
    region reads (zeros) and symbolic sizes (their hints)."""
    args: list[torch.Tensor | int] = []
    for n in [n for n in sub.graph.nodes if n.op == "placeholder"][arity:]:
        v = n.meta["val"]
        if isinstance(v, torch.Tensor):
            args.append(torch.zeros(tuple(aten.hint(d) for d in v.shape), dtype=v.dtype, device=v.device))
        else:
            args.append(aten.hint(v))
    return args


def _inputs(device: torch.device) -> Callable[[Region], dict[str, torch.Tensor]]:
    """Random inputs for a region's graph (fresh data; the layout each input is declared with)."""

    def make(region: Region) -> dict[str, torch.Tensor]:
        from fusegraph.engines.torch.convert import torch_dtype
        from fusegraph.torch.graph_floor import random_strided

        return {t.name: random_strided(t.shape, t.strides, torch_dtype(t.dtype), device) for t in region.graph.inputs()}

    return make


@dataclass(frozen=True)
class _Index:
    """Who produces each value of the graph, and which ATen value each converted tensor is:
    built once per partitioned graph, not once per region (a GPT-2 training compile rebuilt
    it for each of its 567 regions, ~1.1 M lookups, 2-4 s of a cold compile)."""

    key_of_tensor: dict[str, aten.Key]
    producers: dict[aten.Key, torch.fx.Node]

    @staticmethod
    def of(conv: aten.Converted, by_name: Mapping[str, torch.fx.Node]) -> _Index:
        producers = {_key_of(n): n for n in by_name.values()}
        for n in list(by_name.values()):
            for a in n.all_input_nodes:
                producers.setdefault(_key_of(a), a)
        return _Index({t: k for k, t in conv.values.items()} | conv.inputs, producers)


def _fx_nodes(region: Region, conv: aten.Converted, by_name: Mapping[str, torch.fx.Node],
              index: _Index | None = None) -> list[str]:
    names = {m for g in region.nodes for m in conv.members.get(conv.atoms[g], [conv.atoms[g]])}
    for name in list(names):
        for user in by_name[name].users:
            if user.op == "call_function" and user.target is operator.getitem:
                names.add(user.name)
    ordered = [n for n in by_name if n in names]
    if region.key not in _SUBS:  # one module per content: a repeated region's is the same
        _SUBS[region.key] = _submodule(region, conv, by_name, ordered, index=index)[0]
    return ordered


def _submodule(region: Region, conv: aten.Converted, by_name: Mapping[str, torch.fx.Node], names: Sequence[str],
               replaced: Mapping[aten.Key, torch.fx.Node] | None = None, index: _Index | None = None,
               ) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], list[torch.fx.Node]]:
    """The region's ATen nodes as a GraphModule: its placeholders are the region's inputs in
    the order of the region graph's in0, in1, ... (so one module serves the incumbent and the
    runner), its output the values read outside the region. Returns it, the outer nodes
    feeding it and the outer nodes it replaces. ``index``: _Index of ``by_name``'s graph."""
    inside = set(names)
    if index is None:
        index = _Index.of(conv, by_name)
    key_of_tensor = index.key_of_tensor
    producers = index.producers
    if replaced:  # values an earlier claimed region now computes
        producers = {**producers, **replaced}
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    feeds: list[torch.fx.Node] = []
    for i, tname in enumerate(region.inputs):
        outer = producers[key_of_tensor[tname]]
        ph = g.placeholder(f"in{i}")
        ph.meta = dict(outer.meta)
        env[outer] = ph
        feeds.append(outer)
    extra: list[torch.fx.Node] = []
    for name in names:  # operands the nodes take but the region's graph does not read: a weight
        for a in by_name[name].all_input_nodes:  # whose gradient is not asked for, a symbolic size
            if a.name not in inside and a not in env:
                a = replaced.get(_key_of(a), a) if replaced else a
                if a not in env and a not in extra:
                    extra.append(a)
    extra.sort(key=lambda a: not isinstance(a.meta.get("val"), torch.Tensor))  # tensors, then sizes
    for i, a in enumerate(extra):
        ph = g.placeholder(f"extra{i}")
        ph.meta = dict(a.meta)
        env[a] = ph
        feeds.append(a)
    for name in names:
        n = by_name[name]
        env[n] = g.node_copy(n, lambda a: env[a])
    leaving = [by_name[name] for name in names
               if any(u.name not in inside for u in by_name[name].users)
               and isinstance(by_name[name].meta.get("val"), torch.Tensor)]
    g.output(tuple(env[n] for n in leaving))
    return torch.fx.GraphModule(torch.nn.Module(), g), feeds, leaving


def _replace(gm: torch.fx.GraphModule, region: Region, names: Sequence[str], conv: aten.Converted,
             replaced: dict[aten.Key, torch.fx.Node], any_engine: bool = False) -> None:
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    sub, feeds, leaving = _submodule(region, conv, by_name, names, replaced)
    key = runtime.register(sub, region.key, any_engine)
    last = by_name[names[-1]]
    tensors = [f for f in feeds if isinstance(f.meta.get("val"), torch.Tensor)]
    sizes = [f for f in feeds if not isinstance(f.meta.get("val"), torch.Tensor)]
    with gm.graph.inserting_after(last):
        call = gm.graph.call_function(torch.ops.fusegraph.region.default, (key, tensors, sizes))
    call.meta["val"] = [n.meta.get("val") for n in leaving]
    outs: list[torch.fx.Node] = []
    for i, n in enumerate(leaving):
        with gm.graph.inserting_after(call if not outs else outs[-1]):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta = dict(n.meta)
        outs.append(item)
    inside = set(names)
    for name in names:  # results that are no tensor (attention's max_q, an undefined cum_seq):
        n = by_name[name]  # their readers get the value itself
        v = n.meta.get("val", ...)
        if n in leaving or isinstance(v, tuple | list) or not any(u.name not in inside for u in n.users):
            continue
        if not (v is None or type(v) is int):
            raise FusegraphError(f"ATen node '{name}' returns {type(v).__name__}, which a region cannot hand back")
        for user in list(n.users):
            if user.name not in inside:
                user.replace_input_with(n, v)  # type: ignore[arg-type]
    for n, item in zip(leaving, outs, strict=True):
        replaced[_key_of(n)] = item
        for user in list(n.users):
            if user.name not in inside and user is not call:
                user.replace_input_with(n, item)
    for name in reversed(names):
        gm.graph.erase_node(by_name[name])


def _check_convex(gm: torch.fx.GraphModule, names: Sequence[str]) -> None:
    """No path leaves the region's ATen nodes and comes back (the region layer checked its
    own graph; this checks the one that will run, so a converter's missed dependency can
    cost a claim but never a broken graph)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    wanted = set(names)
    inside = {n for n in gm.graph.nodes if n.name in wanted}
    last = max(order[n] for n in inside)
    seen: set[torch.fx.Node] = set()
    todo = [u for n in inside for u in n.users if u not in inside]
    while todo:
        u = todo.pop()
        if u in seen or order[u] > last:
            continue
        seen.add(u)
        for w in u.users:
            if w in inside:
                raise FusegraphError(f"its ATen nodes are not convex: a path leaves through '{u.name}' and comes back")
            todo.append(w)


def _sort(gm: torch.fx.GraphModule) -> None:
    """Stable topological order (a region's call sits after its last node, and a node that
    read an earlier result of the region may have come before it)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    order = [nodes[k] for k in ranked_order([[index[u] for u in n.users] for n in nodes], range(len(nodes)))]
    if len(order) != len(nodes):
        raise FusegraphError("the rewritten ATen graph has a cycle")
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in order:
        env[n] = new.node_copy(n, lambda a: env[a])
    gm.graph = new

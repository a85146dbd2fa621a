"""A CPU session plan held to the floor (floor.py) against ONNX Runtime.

Each built claimed unit is measured against an ONNX Runtime session of the same sub-model
(a second compiling engine tried where the first loses), then the whole plan against ONNX
Runtime running the whole model, which goes to ONNX Runtime where the plan loses. The
verdicts come from, and go to, the floor's cache: with them all cached, a warm session of
a model fusegraph loses on builds nothing (``cached_whole``).

floor.py holds what the floor is without a plan (verdicts, the timing, the cache, the
whole-model runners); this module is where it reads and changes a ``SessionPlan``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fusegraph.errors import CompileError
from fusegraph.onnx import floor
from fusegraph.onnx.engine_choice import one_line as _one_line
from fusegraph.onnx.importer import with_strides
from fusegraph.onnx.model import ONode
from fusegraph.onnx.partition import Group, Partitioning, partition
from fusegraph.onnx.unit_io import read_outside
from fusegraph.onnx.units import FusegraphUnit, OrtUnit, to_host

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan

log = logging.getLogger("fusegraph.onnx")


def verdict_cache(plan: SessionPlan) -> floor.VerdictCache:
    """The floor's verdicts for this plan's options and device."""
    from fusegraph.select.device_id import device_id

    return floor.cache_for(plan.opts, device_id(plan.handle))


# ---- a claimed unit ---------------------------------------------------------------------------
def judge(
    plan: SessionPlan, unit: FusegraphUnit, nodes: list[ONode], ins: list[str], outs: list[str], share: float
) -> tuple[FusegraphUnit, floor.Verdict, float]:
    """A built unit's verdict within its ``share`` of the budget, the runner-up engine tried
    where it loses: (the unit that stands, its verdict, seconds spent timing)."""
    t0 = time.perf_counter()
    if share > 0:
        verdict = measure(plan, unit, nodes, ins, outs, share)
    else:
        verdict = floor.Verdict(True, source="not measured", why="the floor's time budget was spent")
    spent = time.perf_counter() - t0
    second = None if verdict.keep else runner_up(plan, unit, nodes, ins, outs, share)
    if second is not None:  # the other engine, built and timed the same way
        spent += second[2]
        if second[1].keep:
            unit, verdict = second[0], second[1]
        else:
            verdict = floor.with_note(verdict, runner_up_note(second[0], second[1]))
    return unit, verdict, spent


def measure(
    plan: SessionPlan, unit: FusegraphUnit, nodes: list[ONode], ins: list[str], outs: list[str], budget_s: float
) -> floor.Verdict:
    """One trial run of each (outputs compared), then both timed (``floor.time_pair``)."""
    try:
        feed = floor.sample_inputs(plan.og, ins)
    except KeyError as exc:
        return floor.Verdict(True, source="not measured", why=f"the type of input {exc} is unknown")
    claimed = {n for g in plan.partitioning.groups if g.claimed for n in g.nodes}
    producers = plan.og.producers()
    # Inputs a fusegraph neighbour produces arrive in the declared layout; the rest are
    # contiguous, as ONNX Runtime and the caller give them (their relayout is timed).
    fg_feed = {
        i: with_strides(v, unit._in[i].strides) if i in unit._in and i in producers and producers[i].name in claimed
        else v
        for i, v in feed.items()
    }
    try:
        ort_unit = plan._ort_unit(f"{unit.name}_floor", nodes, ins, outs)
        want = ort_unit.run(feed)
    except Exception as exc:
        return floor.Verdict(True, source="not measured",
                             why=f"ONNX Runtime cannot run the sub-model alone: {_one_line(str(exc), 200)}")
    try:
        got = {k: to_host(v) for k, v in unit.run(fg_feed).items()}
    except Exception as exc:
        if plan.opts.strict:
            raise CompileError(f"claimed subgraph {unit.name} failed its trial run and strict=1: {exc}") from exc
        return floor.Verdict(False, source="measured", why=f"failed its trial run: {_one_line(str(exc), 200)}")
    err = floor.agreement(got, want)
    if err > floor.AGREE:
        if plan.opts.strict:
            raise CompileError(f"claimed subgraph {unit.name} disagrees with ONNX Runtime (rel err {err:.1e})")
        return floor.Verdict(False, source="measured", why=f"disagrees with ONNX Runtime (rel err {err:.1e})")
    verdict = floor.decide_timing(floor.time_pair(lambda: unit.run(fg_feed), lambda: ort_unit.run(feed), budget_s))
    log.info("floor %s: %s", unit.name, verdict.describe())
    return verdict


def runner_up(plan: SessionPlan, unit: Any, nodes: Sequence[ONode], ins: list[str], outs: list[str],
              budget_s: float) -> tuple[Any, floor.Verdict, float] | None:
    """Where the selection layer chose a unit's engine and the unit lost to ONNX Runtime,
    the group built on the other compiling engine and measured the same way: (unit,
    verdict, seconds spent timing), or None where there is no other engine or it fails to
    build. The selection layer's guess is a heuristic (it sends transformer blocks to IREE,
    whose CPU GEMMs lose to ONNX Runtime's, while the torch engine's compiled CPU path
    beats it there); a win is recorded as the group's choice (``choices.py``), so later
    sessions build the winner directly."""
    from fusegraph.onnx import choices, plan_build
    from fusegraph.onnx.importer import filter_layout_for

    engine = plan.engine
    if engine is None or engine.name is not None or plan.opts.autotune > 0 or budget_s <= 0:
        return None
    ran = str(getattr(unit.plan, "engine", ""))
    others = [e.name for e in engine.candidates if e.name not in (ran, "reference")]
    if not others:
        return None
    other = others[0]
    try:
        second = plan_build.lower_unit(plan, unit.name, list(nodes), ins, outs, other, filter_layout_for(other))
        second.build()
    except Exception as exc:  # the first verdict stands
        log.info("floor: %s on engine %s failed to build (%s)", unit.name, other, str(exc).splitlines()[0] if str(exc) else exc)
        return None
    t0 = time.perf_counter()
    verdict = measure(plan, second, list(nodes), ins, outs, budget_s)
    spent = time.perf_counter() - t0
    if verdict.keep:
        first = engine.candidates[0].name if engine.candidates else None
        canonical = plan_build.lower_unit(plan, unit.name, list(nodes), ins, outs, None, filter_layout_for(first), pack=False)
        choices.record(plan.opts.cache_dir, canonical.graph.key(), str(plan.handle.device),
                       choices.Choice(second.plan.config, second.filter_layout, verdict.fusegraph_ms or 0.0))
    return second, verdict, spent


def runner_up_note(unit: Any, verdict: floor.Verdict) -> str:
    """What the second candidate (``runner_up``) did, for a verdict that stands."""
    name = getattr(unit.plan, "engine", None) or unit.engine
    if verdict.fusegraph_ms is not None:
        return f"on engine {name}: fusegraph {verdict.fusegraph_ms:.3f} ms"
    return f"on engine {name}: {verdict.why or verdict.source}"


# ---- the whole model --------------------------------------------------------------------------
def whole_key(plan: SessionPlan) -> str:
    """The whole-model verdict's content key: the model and how it is partitioned."""
    nodes = list(plan.og.nodes)
    ins, outs = read_outside(plan.og, nodes)
    shape = ",".join(f"{'f' if g.claimed else 'o'}{len(g.nodes)}" for g in plan.partitioning.groups)
    return f"whole|{floor.group_key(plan.og, nodes, ins, outs)}|{shape}"


def cached_whole(plan: SessionPlan) -> floor.Verdict | None:
    """With every claimed group's verdict cached (releases applied), the cached whole-model
    verdict when it says ONNX Runtime: then nothing needs building (a warm session of a
    model fusegraph loses on costs little more than ONNX Runtime's own)."""
    cache = verdict_cache(plan)
    if not plan.partitioning.claimed:
        return None
    while True:
        released = False
        for group in plan.partitioning.groups:
            if not group.claimed:
                continue
            nodes = [plan.by_name[n] for n in group.nodes]
            ins, outs = read_outside(plan.og, nodes)
            v = cache.lookup(floor.group_key(plan.og, nodes, ins, outs))
            if v is None:
                return None
            if not v.keep:
                plan._release(group.nodes, v.describe())
                released = True
        if not released:
            break
        plan.partitioning = partition(plan.pnodes, plan.node_verdicts, min_size=plan.opts.min_subgraph_size)
    if not plan.partitioning.claimed:
        return floor.Verdict(False, source="cached", why="every claimed subgraph was handed back")
    whole = cache.lookup(whole_key(plan))
    return whole if whole is not None and not whole.keep else None


def whole_model_floor(plan: SessionPlan) -> None:
    """The plan against ONNX Runtime running the whole model (boundary copies and the
    extra sub-session calls counted); the whole model goes to ONNX Runtime if it loses."""
    ins = [i for i in plan.og.inputs if i not in plan.og.constants]
    cache = verdict_cache(plan)
    content = whole_key(plan)
    verdict = cache.lookup(content)
    whole: OrtUnit | None = None
    if verdict is None:
        try:
            feed = floor.sample_inputs(plan.og, ins)
            whole = OrtUnit.whole("onnxruntime_0", plan.og, plan.model, plan.sess_options, plan.ort_providers,
                                  path=plan.model_path)
            whole.run(feed)
            wanted = list(plan.og.outputs)
            budget = min(floor.WHOLE_S, plan.floor_budget * (1 - floor.UNITS_SHARE))
            verdict = floor.decide_timing(
                floor.time_pair(lambda: plan.run(feed, wanted), lambda: whole.run(feed), budget))  # type: ignore[union-attr]
        except Exception as exc:
            log.info("floor: the whole model was not compared with ONNX Runtime: %s", exc)
            plan.floor_whole = floor.Verdict(True, source="not measured", why=_one_line(str(exc), 200))
            return
        cache.record(content, verdict)
        cache.flush()
    plan.floor_whole = verdict
    if not verdict.keep:
        go_whole_ort(plan, verdict, whole)


def go_whole_ort(plan: SessionPlan, verdict: floor.Verdict, whole: OrtUnit | None) -> None:
    """The whole model as one ONNX Runtime session (the caller's session options)."""
    plan.floor_whole = verdict
    nodes = list(plan.og.nodes)
    if whole is None:
        whole = OrtUnit.whole("onnxruntime_0", plan.og, plan.model, plan.sess_options, plan.ort_providers,
                              session=plan._direct[0] if plan._direct else None, path=plan.model_path)
    note = f"whole model {verdict.describe()}"
    plan.reasons = dict(plan.partitioning.reasons)
    for n in (n for g in plan.partitioning.claimed for n in g.nodes):
        plan.reasons[n] = note
        plan.node_verdicts[n] = note
    plan.partitioning = Partitioning([Group([n.name for n in nodes], False)], dict(plan.reasons))
    plan.units = [whole]
    plan._whole_ort = whole
    # ONNX Runtime holds its own copy of the weights: the specialized graph's go (but outputs)
    plan.og.constants = {k: v for k, v in plan.og.constants.items() if k in plan.og.outputs}
    plan.notes = {whole.name: note}
    plan.compile_s = {}
    plan._plan_frees()
    plan._proven = set()


__all__ = ["cached_whole", "go_whole_ort", "judge", "measure", "runner_up", "runner_up_note",
           "verdict_cache", "whole_key", "whole_model_floor"]

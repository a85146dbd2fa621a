"""How a claimed group becomes a built fusegraph unit: lowered to a Graph, its filters
packed for the engine that runs it, built -- pinned, autotuned, from a recorded choice, or
as the selection layer ranks the engines (``fusegraph_unit`` says in which order)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fusegraph.onnx import choices
from fusegraph.onnx.importer import Importer, filter_layout_for
from fusegraph.onnx.model import ONode
from fusegraph.onnx.patterns import label_fusions
from fusegraph.onnx.units import FusegraphUnit

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan

log = logging.getLogger("fusegraph.onnx")


def lower_unit(
    plan: SessionPlan,
    name: str,
    nodes: list[ONode],
    ins: list[str],
    outs: list[str],
    engine: str | None,
    filter_layout: str,
    *,
    pack: bool = True,
    origin: dict[str, str] | None = None,
) -> FusegraphUnit:
    """The claimed group as one fusegraph Graph with its weights packed (not yet built).
    ``origin``, where given, receives the ONNX node each graph node was lowered from (the
    region path's report and its atoms: one ONNX node's graph nodes stay in one region)."""
    imp = Importer(
        plan.og, name, channels_last=plan._channels_last(nodes), filter_layout=filter_layout, pack=pack
    )
    for n in nodes:
        before = len(imp.g.nodes)
        imp.lower(n)
        if origin is not None:
            origin.update((g.name, n.name) for g in imp.g.nodes[before:])
    for i in ins:  # values read only implicitly stay outside; make sure every input is bound
        if i in imp.values and i not in imp.inputs and imp.values[i].producer is None:
            imp.inputs[i] = imp.values[i]
    out_names = imp.finish(outs)
    unit = FusegraphUnit(
        name, nodes, imp.g, {i: imp.inputs[i] for i in ins if i in imp.inputs}, imp.weights,
        out_names, plan.handle, engine, plan.opts.cache_dir,
    )
    unit.filter_layout = filter_layout
    unit.fusions = label_fusions(imp.g, imp.weights)
    return unit


def fusegraph_unit(plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> FusegraphUnit:
    """Lowers, packs and builds a claimed group.

    Filters are packed for the engine that runs them (``FILTER_LAYOUTS``). A pinned
    engine gets its layout directly. Otherwise the group is first lowered without
    packing (its canonical graph); then, in order: ``autotune`` tunes each compiling
    engine on its own packing, keeps the fastest and records the choice (``choices``);
    a recorded choice is rebuilt as it was; else the selection layer's first candidate
    decides the packing, and the group is re-packed if the build picks another engine.
    """
    assert plan.engine is not None
    t0 = time.perf_counter()
    has_filters = any(n.op_type in ("Conv", "ConvTranspose") for n in nodes)
    pinned = plan.engine.name
    first = pinned or (plan.engine.candidates[0].name if plan.engine.candidates else None)
    if plan.opts.lazy_compile or pinned is not None or not has_filters:
        unit = lower_unit(plan, name, nodes, ins, outs, pinned, filter_layout_for(first))
        if not plan.opts.lazy_compile:
            if plan.opts.autotune > 0:
                unit.autotune(plan.opts.autotune)
            unit.build()
    else:
        unit = select_and_build(plan, name, nodes, ins, outs, filter_layout_for(first))
    if not plan.opts.lazy_compile:
        plan.compile_s[name] = time.perf_counter() - t0
    if plan.dump is not None:
        plan.dump(f"{name}.json", unit.graph.to_json(indent=1))
    return unit


def op_by_op_unit(plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str]) -> FusegraphUnit:
    """The claimed nodes op by op on the torch engine, on the session's GPU: where a unit
    fails at run time on a GPU, this is what the region floor measured as the incumbent,
    and ONNX Runtime's CPU provider is no stand-in for it there (Swin-T ran 308 ms against
    PyTorch's 8 on an H200)."""
    from fusegraph.regions.incumbent import op_by_op_config

    unit = lower_unit(plan, name, nodes, ins, outs, "torch", filter_layout_for("torch"))
    unit.build(op_by_op_config(unit.graph, plan.handle, tf32=plan.opts.precision == "tf32"))
    return unit


def op_by_op_built_instead(plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str],
                           why: str) -> FusegraphUnit | None:
    """A claimed group whose build failed on a GPU, built op by op on PyTorch instead, or
    None where that fails too (ONNX Runtime is then the last resort): as at run time
    (``op_by_op_instead``), ONNX Runtime's CPU provider is no stand-in on a GPU."""
    try:
        unit = op_by_op_unit(plan, name, nodes, ins, outs)
    except Exception as again:
        log.warning("claimed subgraph %s: op by op on PyTorch did not build either: %s", name, again)
        return None
    log.warning("claimed subgraph %s failed to build, runs op by op on PyTorch: %s", name, why)
    unit.engine_notes.append(f"failed to build, so run op by op on PyTorch: {why}")
    return unit


def op_by_op_instead(plan: SessionPlan, unit: FusegraphUnit, why: str,
                     env: Mapping[str, Any]) -> tuple[FusegraphUnit, dict[str, Any]] | None:
    """``unit``, which failed at run time on a GPU, replaced by its nodes op by op on PyTorch
    and run on ``env``: the replacement and its outputs, or None where that fails too (ONNX
    Runtime is then the last resort)."""
    try:
        fallback = op_by_op_unit(plan, unit.name, unit.nodes, unit.inputs, unit.outputs)
        outs = fallback.run({i: env[i] for i in fallback.inputs})
    except Exception as again:
        log.warning("claimed subgraph %s: op by op on PyTorch failed too: %s", unit.name, again)
        return None
    log.warning("claimed subgraph %s failed at run time, runs op by op on PyTorch: %s", unit.name, why)
    fallback.engine_notes.append(f"failed at run time, so run op by op on PyTorch: {why}")
    return fallback, outs


def select_and_build(
    plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str], canonical: str
) -> FusegraphUnit:
    assert plan.engine is not None
    probe = lower_unit(plan, name, nodes, ins, outs, None, canonical, pack=False)
    key = probe.graph.key()
    device = str(plan.handle.device)
    del probe
    if plan.opts.autotune > 0:
        tuned = autotune_engines(plan, name, nodes, ins, outs)
        if tuned is not None:
            unit, ms = tuned
            choices.record(plan.opts.cache_dir, key, device,
                           choices.Choice(unit.plan.config, unit.filter_layout, ms))
            return unit
    choice = choices.lookup(plan.opts.cache_dir, key, device)
    if choice is not None:
        try:
            unit = lower_unit(plan, name, nodes, ins, outs, None, choice.filter_layout)
            unit.build(config=choice.config)
            return unit
        except Exception as exc:
            log.info("recorded choice %s for %s no longer builds (%s)", choice.config, name, exc)
    guess = predict_engine(plan, name, nodes, ins, outs, canonical)
    unit = lower_unit(plan, name, nodes, ins, outs, None, filter_layout_for(guess))
    unit.build()
    chosen = str(getattr(unit.plan, "engine", ""))
    if filter_layout_for(chosen) != unit.filter_layout:
        unit = repack(plan, unit, name, nodes, ins, outs, chosen)
    return unit


def predict_engine(plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str], canonical: str) -> str | None:
    """The engine the selection layer would build first (nothing is built)."""
    try:
        from fusegraph.select import api

        probe = lower_unit(plan, name, nodes, ins, outs, None, canonical, pack=False)
        api.create_execution_plans(probe.graph, None, plan.handle)
        kept = api.check_support(probe.graph, plan.handle)
        return kept[0].config.engine if kept else None
    except Exception as exc:  # only a guess: the build decides
        log.debug("could not rank engines for %s: %s", name, exc)
        return None


def repack(
    plan: SessionPlan, unit: FusegraphUnit, name: str, nodes: list[ONode], ins: list[str], outs: list[str], chosen: str
) -> FusegraphUnit:
    """The group lowered again with ``chosen``'s filter layout, built with the same config."""
    config = unit.plan.config
    try:
        again = lower_unit(plan, name, nodes, ins, outs, None, filter_layout_for(chosen))
        again.build(config=config)
    except Exception as exc:  # the first build stands; only its speed suffers
        log.info("re-packing %s for engine %s failed (%s); keeping the first packing", name, chosen, exc)
        return unit
    return again


def autotune_engines(
    plan: SessionPlan, name: str, nodes: list[ONode], ins: list[str], outs: list[str]
) -> tuple[FusegraphUnit, float] | None:
    """Each compiling engine tuned on its own filter packing; the fastest kept."""
    assert plan.engine is not None
    cands = plan.engine.candidates
    budget = plan.opts.autotune / len(cands)
    best: tuple[FusegraphUnit, float] | None = None
    for eng in cands:
        u = lower_unit(plan, name, nodes, ins, outs, eng.name, filter_layout_for(eng.name))
        ms = u.autotune(budget)
        log.info("autotune %s on %s: %s ms", name, eng.name, ms)
        if ms is not None and (best is None or ms < best[1]):
            best = (u, ms)
        del u
    return best

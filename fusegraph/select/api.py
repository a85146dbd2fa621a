"""The selection API behind Graph's plan methods, after cuDNN's Python frontend.

    g.create_execution_plans([HeurMode.A, HeurMode.FALLBACK], handle)  # rank candidates
    g.check_support()                 # drop what engines refuse, keeping the reasons
    g.build_plans(BuildPlanPolicy.ALL)
    for i in range(g.get_execution_plan_count()):
        g.execute_plan_at_index(pack, i)

``g.build(handle)`` does all of it with the defaults and remembers the plan that
``g.execute(pack, handle=handle)`` then uses. Precedence, highest first: an explicit
``config=`` (strict) or ``engine=`` (strict: only that engine); ``preferred_engine=`` or
the ``FUSEGRAPH_ENGINE`` variable (a preference: that engine first if it can run the
graph); the tuning database's entry for this graph, device and versions; the heuristics.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusegraph.engines.base import Engine, EngineConfig, ExecutionPlan, Support
from fusegraph.engines.registry import Registry, active_registry
from fusegraph.engines.unsupported import declared_unsupported
from fusegraph.errors import CompileError, ExecutionError, FusegraphError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle, as_handle
from fusegraph.select import heuristics
from fusegraph.select.modes import BuildPlanPolicy, HeurMode
from fusegraph.select.partition import (
    PARTITION,
    PartitionPlan,
    partition_config,
    pieces_from_config,
    split,
)

if TYPE_CHECKING:
    from fusegraph.select.autotune import TuningResult

log = logging.getLogger("fusegraph.select")

ENGINE_ENV = "FUSEGRAPH_ENGINE"
DEFAULT_MODES = (HeurMode.A, HeurMode.FALLBACK)


@dataclass
class Candidate:
    """One (engine, config) in the ranked list, with where it came from and what happened."""

    config: EngineConfig
    source: str  # "pinned", "preferred", "tuned", "heuristic:A", "plugin:<name>", "fallback", "partition"
    support: Support | None = None
    plan: ExecutionPlan | None = None
    error: str = ""

    def __str__(self) -> str:
        state = "" if self.support is None else ("supported" if self.support else f"unsupported: {self.support.reason}")
        return f"{self.config} ({self.source}{', ' + state if state else ''}{', build failed: ' + self.error if self.error else ''})"


@dataclass
class Selection:
    """The state of create_execution_plans / check_support / build_plans for one graph."""

    handle: Handle
    modes: tuple[HeurMode, ...]
    candidates: list[Candidate]
    strict: bool = False
    rejected: list[Candidate] = field(default_factory=list)
    checked: bool = False
    plans: list[ExecutionPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- ranking -----------------------------------------------------------------------------------
def _add(out: list[Candidate], config: EngineConfig, source: str) -> None:
    if all(c.config != config for c in out):
        out.append(Candidate(config, source))


def ranked_configs(
    graph: Graph,
    handle: Handle,
    modes: Sequence[HeurMode],
    registry: Registry | None = None,
    *,
    only: str | None = None,
) -> list[Candidate]:
    """Heuristic candidates for the modes, in order (plugins first in A and B); with
    ``only``, that engine's candidates alone (no other engine is loaded or asked)."""
    registry = registry or active_registry()
    if only is None:
        engines = registry.available_engines()
    else:
        e = registry.get(only)
        engines = [e] if _safe(e.available) else []
    names = {e.name for e in engines}
    out: list[Candidate] = []
    for mode in modes:
        mode = HeurMode(mode)
        if mode == HeurMode.FALLBACK:
            for c in heuristics.fallback_configs(handle, engines):
                _add(out, c, "fallback")
            continue
        for h in registry.heuristics():
            try:
                configs = h.rank(graph, handle, mode, engines) or []
            except Exception as exc:
                log.warning("heuristic plugin '%s' failed: %s", getattr(h, "name", h), exc)
                continue
            for c in configs:
                if c.engine in names:
                    _add(out, c, f"plugin:{h.name}")
        for c in heuristics.BUILTIN.rank(graph, handle, mode, engines):
            _add(out, c, f"heuristic:{mode.name}")
    return out


def _tuned_config(graph: Graph, handle: Handle, registry: Registry) -> EngineConfig | None:
    from fusegraph.runtime.cache_dir import cache_root

    # tuning_db.default_path(), looked at before importing tuning_db and device_id (their
    # dataclasses and lookups cost a fresh process ~3 ms): no database, nothing tuned
    try:
        if not (cache_root() / "tuning" / "tuning.json").exists():
            return None
    except OSError:
        return None
    from fusegraph.select.device_id import device_id
    from fusegraph.select.tuning_db import default_db, engine_versions

    try:
        db, key = default_db(), graph.key()
        entries = db.entries()
        if not any(e.graph_key == key for e in entries):
            return None  # nothing tuned for this graph: no device or engine need be asked
        device = device_id(handle)
        if not any(e.graph_key == key and e.device == device for e in entries):
            return None  # nothing tuned for this graph here: no engine need be asked its versions
        entry = db.lookup(key, device, engine_versions(registry.available_engines()))
    except OSError as exc:
        log.info("tuning database not readable: %s", exc)
        return None
    return entry.chosen if entry is not None else None


def create_execution_plans(
    graph: Graph,
    modes: Sequence[HeurMode] | None = None,
    handle: Handle | str | None = None,
    *,
    engine: str | None = None,
    config: EngineConfig | Mapping[str, Any] | None = None,
    preferred_engine: str | None = None,
    use_tuned: bool = True,
    registry: Registry | None = None,
) -> list[Candidate]:
    """Ranks (engine, config) candidates for the graph on the handle (nothing is built)."""
    registry = registry or active_registry()
    graph.ensure_valid()
    h = as_handle(handle)
    modes_t = tuple(HeurMode(m) for m in (modes if modes is not None else DEFAULT_MODES))
    pinned = _as_config(config) if config is not None else None
    if engine is not None:
        registry.get(engine)  # raises, naming the engine, when it does not exist
    if pinned is not None and pinned.engine != PARTITION:
        registry.get(pinned.engine)
    out: list[Candidate] = []
    strict = pinned is not None or engine is not None
    if pinned is not None:
        out.append(Candidate(pinned, "pinned"))
    else:
        pref = preferred_engine
        source = "preferred"
        if pref is None and engine is None:
            pref = os.environ.get(ENGINE_ENV) or None
            source = f"preferred (${ENGINE_ENV})"
            if pref is not None and pref not in registry.names():
                log.warning("%s=%s names no engine (known: %s); ignoring it", ENGINE_ENV, pref, registry.names())
                pref = None
        elif pref is not None:
            registry.get(pref)
        tuned = _tuned_config(graph, h, registry) if use_tuned else None
        ranked = ranked_configs(graph, h, modes_t, registry, only=engine)
        first = engine or pref
        if first is not None:
            if tuned is not None and tuned.engine == first:
                _add(out, tuned, "tuned")
            for c in ranked:
                if c.config.engine == first:
                    _add(out, c.config, source if engine is None else c.source)
            _add(out, EngineConfig(first), source if engine is None else "engine")
        if engine is None:
            if tuned is not None:
                _add(out, tuned, "tuned")
            for c in ranked:
                _add(out, c.config, c.source)
    graph._selection = Selection(h, modes_t, out, strict=strict)
    return out


def _as_config(config: EngineConfig | Mapping[str, Any]) -> EngineConfig:
    if isinstance(config, EngineConfig):
        return config
    knobs = config.get("knobs", {})
    items = knobs.items() if isinstance(knobs, Mapping) else knobs
    return EngineConfig(str(config["engine"]), tuple(sorted((str(k), v) for k, v in items)))


def _selection(graph: Graph, handle: Handle | str | None) -> Selection:
    sel = graph._selection
    if not isinstance(sel, Selection) or (handle is not None and sel.handle != as_handle(handle)):
        create_execution_plans(graph, None, handle)
        sel = graph._selection
    assert isinstance(sel, Selection)
    return sel


# ---- support ----------------------------------------------------------------------------------
def _engine_support(registry: Registry, name: str, graph: Graph, handle: Handle) -> Support:
    try:
        e = registry.get(name)
    except UnsupportedError as exc:
        return Support.no(str(exc))
    avail = _safe(lambda: e.available())
    if not avail:
        return Support.no(f"not available here: {avail.reason}")
    declared = declared_unsupported(name, graph)
    if declared is not None:
        return Support.no(declared)
    return _safe(lambda: e.supports(graph, handle))


def _safe(fn: Any) -> Support:
    try:
        result = fn()
        return result if isinstance(result, Support) else Support(bool(result), "")
    except Exception as exc:  # a plugin's bug is a "no", with the reason
        return Support.no(f"raised {type(exc).__name__}: {exc}")


def every_engine_reason(graph: Graph, handle: Handle, registry: Registry | None = None) -> list[str]:
    registry = registry or active_registry()
    lines = []
    for e in registry.engines():
        s = _engine_support(registry, e.name, graph, handle)
        lines.append(f"{e.name}: {'supported' if s else s.reason}")
    for name, why in registry.broken().items():
        lines.append(f"{name}: {why}")
    return lines


def check_support(
    graph: Graph,
    handle: Handle | str | None = None,
    registry: Registry | None = None,
    *,
    known: Mapping[str, Support] | None = None,
) -> list[Candidate]:
    """Keeps the candidates whose engine supports the graph; raises UnsupportedError (with
    every engine's reason) when none does and no split into supported pieces exists.
    ``known``: engines' answers already asked for this graph and handle."""
    registry = registry or active_registry()
    sel = _selection(graph, handle)
    h = sel.handle
    cache: dict[str, Support] = dict(known or {})
    kept: list[Candidate] = []
    rejected: list[Candidate] = []
    for c in sel.candidates:
        if c.config.engine == PARTITION:
            c.support = _partition_support(graph, h, c.config, registry)
        else:
            if c.config.engine not in cache:
                cache[c.config.engine] = _engine_support(registry, c.config.engine, graph, h)
            c.support = cache[c.config.engine]
        (kept if c.support else rejected).append(c)
    real = [c for c in kept if c.config.engine not in ("reference", PARTITION)]
    if not real and not sel.strict:
        engines = _partition_engines(sel, kept, rejected, h, registry)
        try:
            pieces = split(graph, h, engines) if engines else []
        except UnsupportedError as exc:
            sel.notes.append(f"partition: {exc}")
            pieces = []
        if len(pieces) > 1 and any(p.engine != "reference" for p in pieces):
            part = Candidate(partition_config(pieces), "partition", Support.yes())
            at = next((i for i, c in enumerate(kept) if c.config.engine == "reference"), len(kept))
            kept.insert(at, part)
            log.info(
                "graph '%s': no engine runs it whole on %s; split into %s",
                graph.name, h.device, " | ".join(f"{p.engine}:{len(p.nodes)}" for p in pieces),
            )
    sel.candidates, sel.rejected, sel.checked = kept, rejected, True
    sel.plans = []
    if not kept:
        lines = every_engine_reason(graph, h, registry) + sel.notes
        tried = ", ".join(str(c.config) for c in rejected) or "none"
        raise UnsupportedError(
            f"no engine can run graph '{graph.name}' on {h.device} (candidates: {tried}):\n  "
            + "\n  ".join(lines)
        )
    return kept


def _partition_engines(
    sel: Selection, kept: list[Candidate], rejected: list[Candidate], h: Handle, registry: Registry
) -> list[Engine]:
    """Engines a split may use, in candidate order; the reference only on CPU with FALLBACK."""
    names: list[str] = []
    for c in [*sel.candidates]:
        n = c.config.engine
        if n == PARTITION or n in names:
            continue
        if n == "reference" and (h.device.is_gpu or HeurMode.FALLBACK not in sel.modes):
            continue
        names.append(n)
    out = []
    for n in names:
        try:
            e = registry.get(n)
        except UnsupportedError:
            continue
        if _safe(lambda e=e: e.available()):
            out.append(e)
    return out


def _partition_support(graph: Graph, h: Handle, config: EngineConfig, registry: Registry) -> Support:
    try:
        for p in pieces_from_config(graph, config):
            s = _engine_support(registry, p.engine, p.graph, h)
            if not s:
                return Support.no(f"piece for {p.engine}: {s.reason}")
    except (FusegraphError, KeyError, ValueError, TypeError) as exc:
        return Support.no(f"partition no longer fits the graph: {exc}")
    return Support.yes()


# ---- building ---------------------------------------------------------------------------------
def build_candidate(graph: Graph, handle: Handle, config: EngineConfig, registry: Registry | None = None) -> ExecutionPlan:
    """Builds one (engine, config); a partition config builds each piece's plan."""
    registry = registry or active_registry()
    if config.engine == PARTITION:
        plans = []
        for p in pieces_from_config(graph, config):
            eng = registry.get(p.engine)
            ranked = heuristics.BUILTIN.rank(p.graph, handle, HeurMode.A, [eng])
            cfg = ranked[0] if ranked else EngineConfig(p.engine)
            plans.append(eng.build(p.graph, handle, cfg))
        return PartitionPlan(graph, handle, config, plans)
    return registry.get(config.engine).build(graph, handle, config)


def build_plans(
    graph: Graph,
    policy: BuildPlanPolicy | None = None,
    handle: Handle | str | None = None,
    registry: Registry | None = None,
) -> list[ExecutionPlan]:
    """HEURISTICS_CHOICE: the first candidate that builds; ALL: every candidate that builds."""
    registry = registry or active_registry()
    policy = BuildPlanPolicy(policy) if policy is not None else BuildPlanPolicy.HEURISTICS_CHOICE
    sel = _selection(graph, handle)
    if not sel.checked:
        check_support(graph, sel.handle, registry)
    plans: list[ExecutionPlan] = []
    failures: list[str] = []
    for c in sel.candidates:
        if c.plan is None:
            try:
                c.plan = build_candidate(graph, sel.handle, c.config, registry)
                c.error = ""
            except (FusegraphError, ValueError, RuntimeError, OSError) as exc:
                c.error = f"{type(exc).__name__}: {exc}"
                log.warning("building %s for graph '%s' failed: %s", c.config, graph.name, c.error)
                failures.append(f"{c.config}: {c.error}")
                continue
        plans.append(c.plan)
        if policy == BuildPlanPolicy.HEURISTICS_CHOICE:
            break
    sel.plans = plans
    if not plans:
        raise CompileError(
            f"no candidate plan for graph '{graph.name}' on {sel.handle.device} could be built:\n  "
            + "\n  ".join(failures)
        )
    return plans


def get_execution_plan_count(graph: Graph) -> int:
    sel = graph._selection
    return len(sel.plans) if isinstance(sel, Selection) else 0


def get_plans(graph: Graph) -> list[ExecutionPlan]:
    sel = graph._selection
    return list(sel.plans) if isinstance(sel, Selection) else []


def execute_plan_at_index(graph: Graph, variant_pack: Mapping[Any, Any], index: int) -> dict[str, Any]:
    plans = get_plans(graph)
    if not -len(plans) <= index < len(plans):
        raise ExecutionError(
            f"graph '{graph.name}' has {len(plans)} built plan(s); no index {index} "
            "(call create_execution_plans, check_support and build_plans first)"
        )
    return plans[index].execute(variant_pack)


def build(
    graph: Graph,
    handle: Handle | str | None = None,
    engine: str | None = None,
    *,
    config: EngineConfig | Mapping[str, Any] | None = None,
    preferred_engine: str | None = None,
    modes: Sequence[HeurMode] | None = None,
    use_tuned: bool = True,
    registry: Registry | None = None,
) -> ExecutionPlan:
    """The default plan for ``handle`` (see the module docstring for the precedence)."""
    registry = registry or active_registry()
    h = as_handle(handle)
    create_execution_plans(
        graph, modes, h, engine=engine, config=config, preferred_engine=preferred_engine,
        use_tuned=use_tuned, registry=registry,
    )
    asked: dict[str, Support] = {}
    plan = _first_plan(graph, h, registry, asked)
    if plan is None:
        check_support(graph, h, registry, known=asked)
        plan = build_plans(graph, BuildPlanPolicy.HEURISTICS_CHOICE, h, registry)[0]
    sel = graph._selection
    chosen = next(c for c in sel.candidates if c.plan is plan)
    log.info("graph '%s' on %s: %s (%s)", graph.name, h.device, plan.config, chosen.source)
    graph.plans[("*", h)] = plan
    if engine is not None:
        graph.plans[(engine, h)] = plan
    return plan


def _first_plan(graph: Graph, h: Handle, registry: Registry, asked: dict[str, Support]) -> ExecutionPlan | None:
    """build()'s walk: asks each candidate's engine in order and builds the first that
    says yes, so that the engines after it are never loaded nor asked (a build on IREE
    does not import torch). It chooses what check_support + build_plans(HEURISTICS_CHOICE)
    would, as long as some engine other than the reference supports the graph; when none
    does (a split or the reference may be the answer) it returns None, leaving in
    ``asked`` the engines' answers, and build() takes the full path."""
    sel = graph._selection
    assert isinstance(sel, Selection)
    kept: list[Candidate] = []
    rejected: list[Candidate] = []
    failures: list[str] = []
    real = False
    for i, c in enumerate(sel.candidates):
        name = c.config.engine
        if name == PARTITION or (name == "reference" and not real and not sel.strict):
            return None  # a split may come first: check_support's business
        if name not in asked:
            asked[name] = _engine_support(registry, name, graph, h)
        c.support = asked[name]
        if not c.support:
            rejected.append(c)
            continue
        kept.append(c)
        real = real or name != "reference"
        try:
            c.plan = build_candidate(graph, h, c.config, registry)
            c.error = ""
        except (FusegraphError, ValueError, RuntimeError, OSError) as exc:
            c.error = f"{type(exc).__name__}: {exc}"
            log.warning("building %s for graph '%s' failed: %s", c.config, graph.name, c.error)
            failures.append(f"{c.config}: {c.error}")
            continue
        sel.candidates = kept + sel.candidates[i + 1 :]  # the rest not asked yet (support None)
        sel.rejected, sel.checked, sel.plans = rejected, False, [c.plan]
        return c.plan
    if not real:
        return None  # nothing supported: check_support raises with every engine's reason
    sel.candidates, sel.rejected, sel.checked, sel.plans = kept, rejected, True, []
    raise CompileError(  # as build_plans words it; the failed builds are not tried twice
        f"no candidate plan for graph '{graph.name}' on {h.device} could be built:\n  " + "\n  ".join(failures)
    )


def fall_back(graph: Graph, handle: Handle, failed: ExecutionPlan, error: BaseException,
              registry: Registry | None = None) -> ExecutionPlan | None:
    """The plan of the next candidate after ``failed``, an engine that accepted the graph and
    then failed it at execution: the caller did not pin an engine, so the selection moves on
    (the failure is kept in the candidate's ``error`` for ``explain``-style reports). None
    when the selection was pinned or no other candidate builds."""
    registry = registry or active_registry()
    sel = graph._selection
    if not isinstance(sel, Selection) or sel.strict:
        return None
    bad = failed.config.engine
    for c in sel.candidates:
        if c.plan is failed:
            c.plan, c.error = None, f"execution failed: {type(error).__name__}: {error}"
    for c in sel.candidates:
        name = c.config.engine
        if name in (bad, PARTITION) or c.error:
            continue
        if c.support is None:
            c.support = _engine_support(registry, name, graph, handle)
        if not c.support:
            continue
        try:
            c.plan = c.plan or build_candidate(graph, handle, c.config, registry)
        except (FusegraphError, ValueError, RuntimeError, OSError) as exc:
            c.error = f"{type(exc).__name__}: {exc}"
            continue
        log.warning("graph '%s': %s failed at execution (%s); falling back to %s", graph.name, bad, error, c.config)
        sel.plans = [c.plan]
        graph.plans[("*", handle)] = c.plan
        return c.plan
    return None


def load_plan(data: bytes, handle: Handle | str | None = None, registry: Registry | None = None) -> ExecutionPlan:
    """A plan from ``ExecutionPlan.serialize()`` bytes: JSON ones name their engine (whose
    ``load_plan`` rebuilds it); IREE artifacts go to ``fusegraph.engines.iree.load_artifact``."""
    registry = registry or active_registry()
    h = as_handle(handle)
    raw = bytes(data)
    if raw[:1] == b"{":
        import json

        try:
            name = json.loads(raw.decode())["engine"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UnsupportedError(f"serialized plan is not readable: {exc}") from None
        loader = getattr(registry.get(name), "load_plan", None)
        if not callable(loader):
            raise UnsupportedError(f"engine '{name}' cannot load serialized plans")
        return loader(raw, h)  # type: ignore[no-any-return]
    from fusegraph.engines.iree import load_artifact

    return load_artifact(raw, h)


def explain(graph: Graph, handle: Handle | str | None = None) -> str:
    """Why the candidates are ordered as they are (the matching rule and its data)."""
    return heuristics.BUILTIN.explain(graph, as_handle(handle))


def autotune(
    graph: Graph,
    variant_pack: Mapping[Any, Any] | None = None,
    handle: Handle | str | None = None,
    **options: Any,
) -> TuningResult:
    from fusegraph.select.autotune import autotune as run

    return run(graph, variant_pack, handle, **options)

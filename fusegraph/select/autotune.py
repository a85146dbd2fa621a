"""Autotuning: time every applicable (engine, knob config), keep the fastest that is right.

Each candidate (mode B: every knob setting of every engine, in heuristic order, then the
FALLBACK engines) is built, run once and compared with the float64 reference engine (a
wrong plan is never chosen, however fast). Building takes at most 60% of the budget, in
heuristic order, so the heuristic's favourites are always measured. Then the correct
plans are timed in interleaved rounds (per round and plan: one untimed run, then a block
of timed runs), so that load spikes on a shared machine hit them all alike, until each
has ``repeats`` runs or the budget is spent; a plan whose median is over twice the best
stops being timed. Inputs are staged on the device first where the plan can (``stage``,
or Buffers on a GPU) and the device is synchronized after each run (``synchronize``).
The lowest median wins (or the lowest minimum, ``statistic="min"``, steadier on a busy
machine), ties within ``tie_margin`` (2%) going to the earlier candidate in heuristic
order (among configs that differ only by noise, the fastest sample is luck), and it is
stored in the tuning database, so later builds of the same graph on the
same device with the same versions use it without timing. The reference engine is the
yardstick, not a contender: it is timed only when no other engine can run the graph (or
with ``include_reference=True``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.registry import Registry, active_registry
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.reference.executor import cast_to, reads_a_rounded_value, run_reference
from fusegraph.reference.inputs import random_inputs
from fusegraph.runtime import progress as signs_of_life
from fusegraph.runtime.handle import Handle, as_handle
from fusegraph.runtime.variant_pack import resolve_pack
from fusegraph.select import api
from fusegraph.select.device_id import device_id
from fusegraph.select.modes import HeurMode
from fusegraph.select.partition import to_host
from fusegraph.select.timing import MIN_WARMUP_CALLS, Timing, time_candidates
from fusegraph.select.tuning_db import (
    Measurement,
    TuningDB,
    TuningEntry,
    default_db,
    engine_versions,
)

log = logging.getLogger("fusegraph.select")

# Accepted relative error (||out - ref|| / ||ref||) by the narrowest type a graph computes in.
TOLERANCE: dict[DataType, float] = {
    DataType.DOUBLE: 1e-9,
    DataType.FLOAT: 1e-4,
    DataType.HALF: 1e-2,
    DataType.BFLOAT16: 2e-2,
    DataType.FP8_E4M3: 1.5e-1,
    DataType.FP8_E5M2: 2.5e-1,
}


@dataclass
class TuningResult:
    """What autotune found: the chosen config, its built plan, and every measurement."""

    entry: TuningEntry
    plan: ExecutionPlan
    persisted: bool

    @property
    def best(self) -> EngineConfig:
        return self.entry.chosen

    @property
    def measurements(self) -> list[Measurement]:
        return self.entry.measurements

    def time_of(self, config: EngineConfig) -> float | None:
        for m in self.entry.measurements:
            if m.config == config and m.status == "ok":
                return m.median_ms
        return None

    def __str__(self) -> str:
        return format_entry(self.entry)


def format_entry(entry: TuningEntry) -> str:
    """The star marks the chosen config. When the chosen one is not the fastest, both rows
    say so: the choice was within the tie margin of the fastest and earlier in the
    heuristic's order (between times that differ by noise, the faster sample is luck)."""
    lines = [
        f"graph {entry.graph_name or '?'} [{entry.graph_key[:16]}] on {entry.device}: chose {entry.chosen}"
        f" (tuned in {entry.elapsed_s:.1f}s)"
    ]
    ok = [m for m in entry.measurements if m.status == "ok" and m.median_ms is not None]
    best = min((m.median_ms for m in ok if m.median_ms is not None), default=None)
    fastest = min(ok, key=lambda m: m.median_ms or math.inf, default=None)
    chosen_is_fastest = fastest is not None and fastest.config == entry.chosen
    skipped = [m for m in entry.measurements if m.status == "skipped"]
    shown = [m for m in entry.measurements if m.status != "skipped"]
    for m in sorted(shown, key=lambda m: (m.status != "ok", m.median_ms or math.inf)):
        is_chosen = m.config == entry.chosen
        mark = "*" if is_chosen else " "
        note = ""
        if is_chosen and not chosen_is_fastest and m.median_ms is not None and best:
            note = (f"  <- chosen: {100 * (m.median_ms / best - 1):.1f}% over the fastest, within the tie margin,"
                    " and earlier in the heuristic's order")
        elif m is fastest and not chosen_is_fastest:
            note = "  <- fastest (within the tie margin of the chosen)"
        if m.status == "ok" and m.median_ms is not None and best:
            lines.append(
                f" {mark} {m.median_ms:10.4f} ms  x{m.median_ms / best:6.2f}  {m.config}"
                f"  (n={m.runs}, build {m.build_s or 0:.2f}s, err {m.rel_error:.1e}){note}"
            )
        else:
            lines.append(f" {mark} {'-':>10s}            {m.config}  [{m.status}] {m.detail[:120]}")
    if skipped:  # one line, not one per config: what was not built is not a measurement
        lines.append(f"   {len(skipped)} more config{'s' if len(skipped) > 1 else ''} not built: {skipped[0].detail}")
    return "\n".join(lines)


# ---- inputs and checking ---------------------------------------------------------------------
def tolerance(graph: Graph) -> float:
    """The tolerance of the narrowest float type the graph reads, writes or computes in."""
    types = {t.dtype for t in graph.tensors if t.data_type is not None and t.dtype.is_float and not t.is_scalar}
    for n in graph.nodes:
        cd = getattr(n.attrs, "compute_data_type", None)
        if cd is not None:
            types.add(cd)
    for dt in (graph.compute_data_type, graph.intermediate_data_type):
        if dt is not None:
            types.add(dt)
    return max((TOLERANCE.get(dt, 0.0) for dt in types if dt.is_float), default=1e-6)


def compare(graph: Graph, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray]) -> tuple[float, str]:
    """Worst relative error over the graph's outputs, and a description when it fails."""
    worst = 0.0
    for t in graph.outputs():
        got = np.asarray(to_host(outputs[t.name]))
        ref = np.asarray(reference[t.name])
        if t.dtype == DataType.BOOLEAN:
            err = float(np.mean(got.astype(bool) != ref.astype(bool)))
        else:
            g64 = got.astype(np.float64)
            r64 = ref.astype(np.float64)
            if np.isnan(g64).any() and not np.isnan(r64).any():
                return math.inf, f"output '{t.name}' has NaN"
            diff = np.nan_to_num(g64 - r64, nan=0.0)
            scale = float(np.linalg.norm(np.nan_to_num(r64)))
            err = float(np.linalg.norm(diff)) / scale if scale > 0 else float(np.max(np.abs(diff), initial=0.0))
        worst = max(worst, err)
    return worst, ""


class Answers:
    """The float64 answers a plan's outputs are checked against: the exact one, and -- only
    where a node reads a computed tensor and the exact check fails -- the one with every
    such tensor rounded to its own dtype before it is read (``run_reference(materialize=True)``:
    what an engine that stores the tensors at their declared types computes). A plan is
    right if it matches either; the worse answer's error is not the plan's."""

    def __init__(self, graph: Graph, inputs: Mapping[str, np.ndarray], *, cast: bool = False) -> None:
        """``cast``: the answers rounded to each output's dtype, as the reference engine
        returns them (integer outputs truncated)."""
        self.graph, self._inputs, self._cast = graph, inputs, cast
        self.exact = self._run(materialize=False)
        self._materialized: dict[str, np.ndarray] | None = None

    def _run(self, *, materialize: bool) -> dict[str, np.ndarray]:
        values = run_reference(self.graph, dict(self._inputs), materialize=materialize)
        if self._cast:
            values = {t.name: cast_to(values[t.name], t.dtype) for t in self.graph.outputs()}
        return values

    def error(self, outputs: Mapping[str, Any], tol: float) -> tuple[float, str]:
        err, why = compare(self.graph, outputs, self.exact)
        if err <= tol or not reads_a_rounded_value(self.graph):
            return err, why
        if self._materialized is None:
            self._materialized = self._run(materialize=True)
        err2, why2 = compare(self.graph, outputs, self._materialized)
        return (err2, why2) if err2 < err else (err, why)


# ---- timing ----------------------------------------------------------------------------------
def bar_options(progress: bool | None) -> dict[str, Any]:
    """tqdm options: ``progress=None`` draws only where fusegraph's progress lines are on (a
    terminal, not ``--quiet``; runtime/progress.py) and after about a second, as they do;
    True always, at once; False never."""
    if progress is None:
        return {"disable": not signs_of_life.enabled(), "delay": signs_of_life.DELAY_S}
    return {"disable": not progress}


def stage_inputs(plan: ExecutionPlan, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """Inputs already on the plan's device, so that timing excludes host transfers: the
    plan's own ``stage`` when it has one, else fusegraph Buffers on GPU handles."""
    stage = getattr(plan, "stage", None)
    try:
        if callable(stage):
            return stage(inputs)  # type: ignore[no-any-return]
        if plan.handle.device.is_gpu:
            from fusegraph.runtime.buffer import Buffer

            g = plan.graph
            return {k: v if isinstance(v, Buffer) else Buffer.from_numpy(v, plan.handle, tensor=g.tensor_by_name(k))
                    for k, v in inputs.items()}
    except Exception as exc:  # staging is an optimization; host inputs still work
        log.debug("staging inputs for %s failed: %s", plan.config, exc)
    return inputs


def _sync(plan: ExecutionPlan) -> None:
    sync = getattr(plan, "synchronize", None)
    if callable(sync):
        sync()


def _candidates(
    graph: Graph,
    h: Handle,
    modes: Sequence[HeurMode],
    engines: Sequence[str] | None,
    registry: Registry,
    include_reference: bool,
) -> list[api.Candidate]:
    api.create_execution_plans(graph, modes, h, use_tuned=False, registry=registry)
    try:
        cands = api.check_support(graph, h, registry)
    except UnsupportedError:
        raise
    others = [c for c in cands if c.config.engine != "reference"]
    if others and not include_reference:
        cands = others  # the reference is the yardstick, not a contender (unless it is all there is)
    if engines is not None:
        cands = [c for c in cands if c.config.engine in engines]
        if not cands:
            raise UnsupportedError(f"none of the engines {list(engines)} can run graph '{graph.name}' on {h.device}")
    return cands


def autotune(
    graph: Graph,
    variant_pack: Mapping[Any, Any] | None = None,
    handle: Handle | str | None = None,
    *,
    budget_s: float = 60.0,
    warmup: int = 2,
    repeats: int = 20,
    modes: Sequence[HeurMode] = (HeurMode.B, HeurMode.FALLBACK),
    engines: Sequence[str] | None = None,
    rtol: float | None = None,
    persist: bool = True,
    db: TuningDB | None = None,
    progress: bool | None = None,
    rng: np.random.Generator | None = None,
    include_reference: bool = False,
    max_configs_per_engine: int | None = None,
    statistic: str = "median",
    tie_margin: float = 0.02,
    registry: Registry | None = None,
) -> TuningResult:
    """Times the candidates within ``budget_s`` and stores the fastest correct one."""
    registry = registry or active_registry()
    from tqdm.auto import tqdm

    graph.ensure_valid()
    h = as_handle(handle)
    t_start = time.perf_counter()
    if variant_pack is None:
        inputs: dict[str, Any] = random_inputs(graph, rng)
    else:
        inputs = dict(resolve_pack(graph, variant_pack, check=lambda t, v, what: v).inputs)
    host_inputs = {k: to_host(v) for k, v in inputs.items()}
    reference = Answers(graph, host_inputs)
    tol = rtol if rtol is not None else tolerance(graph)
    cands = _candidates(graph, h, modes, engines, registry, include_reference)
    if max_configs_per_engine is not None:
        per: dict[str, int] = {}
        kept = []
        for c in cands:  # heuristic order: each engine's most promising configs survive
            per[c.config.engine] = per.get(c.config.engine, 0) + 1
            if per[c.config.engine] <= max_configs_per_engine:
                kept.append(c)
        cands = kept

    # Phase 1: build each candidate and check it against the reference (compiles dominate).
    measurements: dict[EngineConfig, Measurement] = {}
    ready: dict[EngineConfig, tuple[ExecutionPlan, Mapping[str, Any]]] = {}
    staged_by_kind: dict[type, Mapping[str, Any]] = {}
    build_budget = 0.6 * budget_s
    bar = tqdm(cands, desc=f"tuning {graph.name}: build+check", unit="cfg", leave=False, **bar_options(progress))
    for cand in bar:
        cfg = cand.config
        bar.set_postfix_str(str(cfg)[:40])
        if time.perf_counter() - t_start > build_budget and ready:
            measurements[cfg] = Measurement(cfg, "skipped", detail=f"budget of {budget_s:.0f}s spent")
            continue
        m, got = _build_and_check(graph, h, cfg, inputs, reference, tol, registry, staged_by_kind)
        measurements[cfg] = m
        if got is not None:
            ready[cfg] = got
    bar.close()

    # Phase 2: time the correct plans with the shared routine: each warmed to a steady state
    # first (a thread pool starting or a primitive cache filling is not the plan's speed),
    # then interleaved rounds, so that load spikes and clock drift hit every contender alike.
    timings = _time_plans(ready, budget_s - (time.perf_counter() - t_start), warmup, repeats, progress, graph.name)
    for cfg, t in timings.items():
        m = measurements[cfg]
        m.median_ms, m.min_ms, m.runs = t.median_ms, t.min_ms, t.rounds * t.per_round
        m.detail = (f"{t.rounds} rounds of {t.per_round}; warm-up {t.warmup_calls} calls"
                    f"{'' if t.steady else ' (not steady)'}, first call {t.first_call_ms:.3g} ms")
    for cfg in ready.keys() - timings.keys():
        m = measurements[cfg]
        m.status, m.detail = "run_failed", "failed while timing (see the log)"
    measurements_list = list(measurements.values())
    plans = {cfg: p for cfg, (p, _) in ready.items()}

    ok = [m for m in measurements_list if m.status == "ok" and m.median_ms is not None]
    if not ok:
        detail = "\n  ".join(f"{m.config}: [{m.status}] {m.detail}" for m in measurements_list)
        raise UnsupportedError(f"autotune found no plan for graph '{graph.name}' that builds and matches the reference:\n  {detail}")
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
    def score(m: Measurement) -> float:
        return (m.median_ms if statistic == "median" else m.min_ms) or math.inf

    # Ties go to the earlier candidate in heuristic order: among configs that differ only
    # by noise (an engine's knobs that do not touch this graph) the fastest sample is luck.
    fastest = min(score(m) for m in ok)
    best = next(m for m in ok if score(m) <= fastest * (1.0 + tie_margin))
    versions = engine_versions(registry.available_engines())
    entry = TuningEntry(
        graph_key=graph.key(),
        graph_name=graph.name,
        device=device_id(h),
        versions=versions,
        chosen=best.config,
        measurements=measurements_list,
        elapsed_s=time.perf_counter() - t_start,
        budget_s=budget_s,
    )
    persisted = False
    if persist:
        try:
            (db or default_db()).put(entry)
            persisted = True
        except OSError as exc:
            log.warning("could not write the tuning database: %s", exc)
    plan = plans[best.config]
    graph.plans[("*", h)] = plan
    log.info("autotuned graph '%s' on %s: %s at %.4f ms", graph.name, h.device, best.config, best.median_ms)
    return TuningResult(entry, plan, persisted)


def _build_and_check(
    graph: Graph,
    h: Handle,
    cfg: EngineConfig,
    inputs: Mapping[str, Any],
    reference: Answers,
    tol: float,
    registry: Registry,
    staged_by_kind: dict[type, Mapping[str, Any]],
) -> tuple[Measurement, tuple[ExecutionPlan, Mapping[str, Any]] | None]:
    t0 = time.perf_counter()
    try:
        plan = api.build_candidate(graph, h, cfg, registry)
    except (FusegraphError, ValueError, RuntimeError, OSError) as exc:
        return Measurement(cfg, "build_failed", detail=f"{type(exc).__name__}: {exc}"), None
    build_s = time.perf_counter() - t0
    try:
        # plans of one class take the same staged values: stage once, not once per config
        staged = staged_by_kind.get(type(plan))
        if staged is None:
            staged = staged_by_kind[type(plan)] = stage_inputs(plan, inputs)
        try:
            first = plan.execute(staged)
        except (FusegraphError, ValueError, RuntimeError, TypeError):
            if staged is inputs:
                raise
            staged = inputs  # the plan does not take staged values: time it on host inputs
            first = plan.execute(staged)
        _sync(plan)
        err, why = reference.error(first, tol)
    except (FusegraphError, ValueError, RuntimeError) as exc:
        return Measurement(cfg, "run_failed", build_s=build_s, detail=f"{type(exc).__name__}: {exc}"), None
    if not err <= tol:
        detail = why or f"relative error {err:.2e} > tolerance {tol:.0e}"
        return Measurement(cfg, "mismatch", build_s=build_s, rel_error=err, detail=detail), None
    return Measurement(cfg, "ok", build_s=build_s, rel_error=err), (plan, staged)


def _time_plans(
    ready: Mapping[EngineConfig, tuple[ExecutionPlan, Mapping[str, Any]]],
    budget_s: float,
    warmup: int,
    repeats: int,
    progress: bool | None,
    name: str,
) -> dict[EngineConfig, Timing]:
    """Each plan's steady-state time through the shared routine (select/timing.py): warmed
    until its calls stop getting faster, then interleaved rounds until ``repeats`` rounds
    or ``budget_s`` (every plan gets at least three rounds; a plan over twice the best stops
    being timed after those). A plan that fails while timing is dropped, with a warning."""
    from tqdm.auto import tqdm

    keys = {str(cfg): cfg for cfg in ready}
    calls = {k: _caller(*ready[cfg]) for k, cfg in keys.items()}
    # a device's plans wait for it; host plans are done when execute returns (and are then
    # sampled per call, select/timing.py), whatever no-op synchronize they may have
    syncs = {k: getattr(ready[cfg][0], "synchronize", None) if ready[cfg][0].handle.device.is_gpu else None
             for k, cfg in keys.items()}

    def failed(key: str, exc: Exception) -> None:
        if not isinstance(exc, _TimingFailure):
            raise exc
        log.warning("%s failed while timing: %s", key, exc)

    # Warm-up may take at most a third of what is left, shared by the plans, within 0.05-2 s each.
    warmup_s = min(2.0, max(0.05, budget_s / 3 / max(1, len(ready))))
    bar = tqdm(total=repeats, desc=f"tuning {name}: timing", unit="round", leave=False, **bar_options(progress))
    try:
        got = time_candidates(
            calls,
            sync={k: s for k, s in syncs.items() if callable(s)},
            warmup_s=warmup_s,
            min_warmup=max(MIN_WARMUP_CALLS, warmup),
            min_rounds=min(3, repeats),
            max_rounds=max(repeats, 1),
            budget_s=max(budget_s, 0.0),
            drop_slower_than=2.0,
            on_error=failed,
            on_round=lambda done, planned: bar.update(1),
        )
    finally:
        bar.close()
    return {keys[k]: t for k, t in got.items()}


def _caller(plan: ExecutionPlan, staged: Mapping[str, Any]) -> Callable[[], object]:
    def call() -> object:
        try:
            return plan.execute(staged)
        except (FusegraphError, ValueError, RuntimeError) as exc:
            raise _TimingFailure(f"{type(exc).__name__}: {exc}") from exc

    return call


class _TimingFailure(Exception):
    """A plan's error while timing (anything else propagates)."""

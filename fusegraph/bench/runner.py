"""One case, run: fusegraph's plans and the baselines prepared on the same inputs, each
called once (and, with ``--verify``, checked against the float64 reference), then timed
together by select/timing.py -- warmed to a steady state, interleaved, medians.

What cannot take part is kept with its reason: an engine that refuses the graph, a
baseline that is not available here, a contender that fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.bench import baselines
from fusegraph.bench.baselines import Unavailable
from fusegraph.bench.cases import Case
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.registry import active_registry
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.reference.inputs import random_inputs
from fusegraph.runtime.handle import Handle
from fusegraph.select import api
from fusegraph.select.autotune import Answers, autotune, bar_options, stage_inputs, tolerance
from fusegraph.select.device_id import device_id
from fusegraph.select.timing import Timing, time_candidates

log = logging.getLogger("fusegraph.bench")


@dataclass(frozen=True)
class Options:
    engine: str = "auto"
    compare: tuple[str, ...] = ()
    tune: bool = False
    tune_budget: float = 30.0
    verify: bool = False
    device: str = "cpu"
    rounds: int = 10
    budget: float | None = None
    warmup: float = 1.0
    seed: int = 0
    dump: str | None = None
    progress: bool | None = None


@dataclass
class Row:
    """One contender: timed (``timing``), or refused / failed with ``reason``."""

    contender: str
    kind: str  # "fusegraph" or "baseline"
    engine: str
    config: str = ""
    status: str = "ok"  # ok, refused, failed, mismatch
    reason: str = ""
    timing: Timing | None = None
    rel_error: float | None = None
    picked: bool = False  # the plan `--engine auto` (g.build) would use

    @property
    def median_ms(self) -> float | None:
        return self.timing.median_ms if self.timing is not None else None


@dataclass
class CaseResult:
    case: Case
    device: str
    device_name: str
    rows: list[Row] = field(default_factory=list)
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    load: str = ""  # the machine's load when the case was timed (report.machine_load)

    @property
    def failed(self) -> bool:
        """Nothing timed, or a result that does not match the reference."""
        return not any(r.status == "ok" for r in self.rows) or any(r.status == "mismatch" for r in self.rows)

    def baseline_ms(self) -> dict[str, float]:
        return {r.engine: r.timing.median_ms for r in self.rows if r.kind == "baseline" and r.timing is not None}


@dataclass
class _Contender:
    row: Row
    fn: Callable[[], Any]
    sync: Callable[[], None] | None = None
    plan: ExecutionPlan | None = None


def _spelled_out(graph: Any, h: Handle, c: EngineConfig) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """A config with every knob named (defaults filled in), to tell two picks apart."""
    try:
        knobs = active_registry().get(c.engine).knobs(graph, h)
    except Exception:
        return c.engine, tuple(sorted(c.knobs))
    return c.engine, tuple(sorted((k.name, c.get(k.name, k.default)) for k in knobs))


def short_config(graph: Any, h: Handle, c: EngineConfig) -> str:
    """The config with only the knobs that differ from the engine's defaults: ``iree``,
    ``torch[compile=True]`` -- what a user would type to pin it."""
    try:
        defaults = {k.name: k.default for k in active_registry().get(c.engine).knobs(graph, h)}
    except Exception:
        return str(c)
    # a knob the engine does not offer for this graph does not touch it either
    return str(EngineConfig(c.engine, tuple((k, v) for k, v in c.knobs if k in defaults and defaults[k] != v)))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def run_case(case: Case, opts: Options) -> CaseResult:
    t0 = time.perf_counter()
    h = Handle(opts.device)
    g = case.graph
    res = CaseResult(case, opts.device, device_id(h), notes=list(case.notes))
    rng = np.random.default_rng(opts.seed)
    host = random_inputs(g, rng)
    contenders: list[_Contender] = []
    _fusegraph_contenders(case, opts, h, host, res, contenders)
    _baseline_contenders(case, opts, host, res, contenders)
    answers = Answers(g, host) if opts.verify else None
    tol = tolerance(g)
    gpu_sync = _gpu_sync(opts.device)
    ready: list[_Contender] = []
    for c in contenders:
        try:
            out = c.fn()
            if c.sync is not None:
                c.sync()
        except Exception as exc:  # one contender's failure must not end the case
            c.row.status, c.row.reason = "failed", _one_line(exc)
            res.rows.append(c.row)
            continue
        if answers is not None:
            err, why = answers.error(_as_outputs(g, out), tol)
            c.row.rel_error = err
            if not err <= tol:
                c.row.status, c.row.reason = "mismatch", why or f"relative error {err:.2e} > tolerance {tol:.0e}"
        ready.append(c)
    if opts.dump:
        _dump(case, opts, host, ready)
    timings = _time(case, opts, ready, gpu_sync, res)
    res.load = machine_load()
    for c in ready:
        c.row.timing = timings.get(c.row.contender)
        if c.row.timing is None and c.row.status == "ok":
            c.row.status = "failed"
            c.row.reason = c.row.reason or "failed while timing"
        res.rows.append(c.row)
    order = {"fusegraph": 0, "baseline": 1}
    res.rows.sort(key=lambda r: (r.status != "ok" and r.status != "mismatch", order.get(r.kind, 2)))
    res.elapsed_s = time.perf_counter() - t0
    return res


def machine_load() -> str:
    """The 1-minute load average over the usable cores: a CPU timing's context (on a shared
    machine, a multi-threaded library's call waits for a core another process holds)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"load {load:.1f} on {cores} cores"


def _as_outputs(g: Any, out: Any) -> Mapping[str, Any]:
    if isinstance(out, Mapping):
        return out
    return {g.outputs()[0].name: out}


def _gpu_sync(device: str) -> Callable[[], None] | None:
    if not device.startswith("cuda") or not baselines.have_torch():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.synchronize


def _plan_contender(row: Row, plan: ExecutionPlan, host: Mapping[str, np.ndarray]) -> _Contender:
    staged = stage_inputs(plan, host)
    row.config = short_config(plan.graph, plan.handle, plan.config)
    sync = getattr(plan, "synchronize", None)
    return _Contender(row, lambda: plan.execute(staged), sync if callable(sync) else None, plan)


def _fusegraph_contenders(case: Case, opts: Options, h: Handle, host: Mapping[str, np.ndarray],
                          res: CaseResult, out: list[_Contender]) -> None:
    g = case.graph
    reg = active_registry()
    engine = opts.engine.strip()
    tune = opts.tune or case.tune
    picked: tuple[str, Any] | None = None
    if tune:
        try:
            untuned = api.build(g, h, use_tuned=False)
            result = autotune(g, host, h, budget_s=opts.tune_budget, progress=opts.progress)
        except FusegraphError as exc:
            res.rows.append(Row("tuned", "fusegraph", "", status="failed", reason=_one_line(exc)))
        else:
            same = _spelled_out(g, h, untuned.config) == _spelled_out(g, h, result.best)
            if same:
                res.notes.append(f"the autotuner kept the untuned pick {untuned.config}")
                out.append(_plan_contender(Row("tuned=untuned", "fusegraph", untuned.config.engine, picked=True),
                                           result.plan, host))
            else:
                out.append(_plan_contender(Row("untuned", "fusegraph", untuned.config.engine), untuned, host))
                out.append(_plan_contender(Row("tuned", "fusegraph", result.best.engine, picked=True), result.plan, host))
            picked = _spelled_out(g, h, result.best)
    if engine == "auto":
        if not tune:
            try:
                plan = api.build(g, h)
            except FusegraphError as exc:
                res.rows.append(Row("fusegraph", "fusegraph", "auto", status="failed", reason=_one_line(exc)))
                return
            out.append(_plan_contender(Row("fusegraph", "fusegraph", plan.config.engine, picked=True), plan, host))
        return
    if picked is None:
        try:
            picked = _spelled_out(g, h, api.build(g, h).config)
        except FusegraphError:
            picked = None
    names = [n for n in reg.names() if n != "reference"] if engine == "all" else [n.strip() for n in engine.split(",") if n.strip()]
    if engine == "all" and "reference" in reg.names():
        res.notes.append("reference: the float64 yardstick, not timed with --engine all (--engine reference times it)")
    for name in names:
        label = f"fusegraph[{name}]"
        try:
            e = reg.get(name)
        except (KeyError, ValueError) as exc:
            res.rows.append(Row(label, "fusegraph", name, status="refused", reason=_one_line(exc)))
            continue
        avail = e.available()
        if not avail:
            res.rows.append(Row(label, "fusegraph", name, status="refused", reason=f"not available here: {avail.reason}"))
            continue
        try:
            plan = api.build(g, h, engine=name)
        except UnsupportedError as exc:
            res.rows.append(Row(label, "fusegraph", name, status="refused", reason=" ".join(str(exc).split())[:400]))
            continue
        except (FusegraphError, ValueError, RuntimeError, OSError) as exc:
            res.rows.append(Row(label, "fusegraph", name, status="failed", reason=_one_line(exc)))
            continue
        # with --tune the tuned row is the pick; otherwise the engine row auto would use
        row = Row(label, "fusegraph", name,
                  picked=not tune and picked is not None and _spelled_out(g, h, plan.config) == picked)
        out.append(_plan_contender(row, plan, host))


def _baseline_contenders(case: Case, opts: Options, host: Mapping[str, np.ndarray], res: CaseResult,
                         out: list[_Contender]) -> None:
    if not opts.compare:
        return
    tensors: dict[str, Any] | None = None
    sync = _gpu_sync(opts.device)

    def torch_tensors() -> dict[str, Any]:
        nonlocal tensors
        if tensors is None:
            if not baselines.have_torch():
                raise Unavailable("PyTorch is not installed (pip install 'fusegraph[torch]')")
            tensors = baselines.torch_inputs(case.graph, host, opts.device)
        return tensors

    versions = _versions()
    for name in opts.compare:
        try:
            if name == "eager":
                fn = baselines.eager(case, torch_tensors())
            elif name == "compile":
                fn = baselines.compiled(case, torch_tensors())
            elif name == "cudnn":
                fn = baselines.cudnn_direct(case.graph, torch_tensors(), opts.device)
            else:
                fn = baselines.ort_session(case, host, opts.device)
        except Unavailable as exc:
            res.rows.append(Row(name, "baseline", name, status="refused", reason=str(exc)))
            continue
        except Exception as exc:
            res.rows.append(Row(name, "baseline", name, status="failed", reason=_one_line(exc)))
            continue
        out.append(_Contender(Row(name, "baseline", name, config=versions.get(name, "")), fn, sync))


def _versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    for label, dist in (("eager", "torch"), ("compile", "torch"), ("ort", "onnxruntime"), ("cudnn", "nvidia-cudnn-frontend")):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[label] = f"{dist} {metadata.version(dist)}"
    return out


def _time(case: Case, opts: Options, ready: Sequence[_Contender], gpu_sync: Callable[[], None] | None,
          res: CaseResult) -> dict[str, Timing]:
    from tqdm.auto import tqdm

    # on a GPU each contender waits for its own device work: a plan's synchronize, else the
    # GPU's; on the CPU a call is done when it returns (and is sampled alone, select/timing.py)
    gpu = Handle(opts.device).device.is_gpu
    syncs = {c.row.contender: (c.sync or gpu_sync) if gpu else None for c in ready}
    def failed(name: str, exc: Exception) -> None:
        for c in ready:
            if c.row.contender == name:
                c.row.reason = f"failed while timing: {_one_line(exc)}"

    bar = tqdm(total=opts.rounds, desc=f"timing {case.name[:40]}", unit="round", leave=False,
               **bar_options(opts.progress))
    try:
        return time_candidates(
            {c.row.contender: c.fn for c in ready},
            sync=syncs,
            warmup_s=opts.warmup,
            min_rounds=opts.rounds,
            budget_s=opts.budget,
            on_error=failed,
            on_round=lambda done, planned: bar.update(1),
        )
    finally:
        bar.close()


def _dump(case: Case, opts: Options, host: Mapping[str, np.ndarray], ready: Sequence[_Contender]) -> None:
    """The case's graph, inputs and command line, and each plan's serialized form (and the
    IREE engine's MLIR) under ``--dump DIR/<case>``: what it takes to rerun or report it."""
    assert opts.dump is not None
    d = Path(opts.dump) / case.name
    d.mkdir(parents=True, exist_ok=True)
    g = case.graph
    (d / "graph.json").write_text(g.to_json(indent=1), encoding="utf-8")
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in host.items() if np.asarray(v).dtype.kind != "V"}
    np.savez(str(d / "inputs.npz"), **arrays)
    rerun = f"fusegraph bench graph {d / 'graph.json'} --engine all --device {opts.device} --verify"
    (d / "command.txt").write_text(f"{case.command}\n# the graph alone:\n{rerun}\n", encoding="utf-8")
    kept: dict[str, str] = {}
    for c in ready:
        if c.plan is None:
            continue
        try:
            blob = c.plan.serialize()
        except Exception as exc:
            kept[c.row.contender] = f"no serialized form: {_one_line(exc)}"
            continue
        stem = c.row.contender.replace("[", "_").replace("]", "").replace("=", "_")
        if blob:
            (d / f"{stem}.plan").write_bytes(blob)
            kept[c.row.contender] = f"{stem}.plan"
        else:
            kept[c.row.contender] = "the engine has no serialized form of its plans"
        # a compiled module's cache entry (the IREE engine's: MLIR, flags, the iree-compile
        # command line, dispatch statistics) travels with the dump
        where = getattr(getattr(c.plan, "entry", None), "path", None)
        if where is not None and Path(where).is_dir():
            shutil.copytree(where, d / f"{stem}.cache_entry", dirs_exist_ok=True)
            kept[f"{c.row.contender} cache entry"] = f"{stem}.cache_entry/"
        if c.plan.config.engine == "iree" and not (d / "iree.mlir").exists():
            try:
                (d / "iree.mlir").write_text(g.emit_mlir(), encoding="utf-8")
            except Exception as exc:
                kept["iree.mlir"] = f"not emitted: {_one_line(exc)}"
    (d / "artifacts.json").write_text(json.dumps({"config": {c.row.contender: c.row.config for c in ready},
                                                  "files": kept}, indent=1), encoding="utf-8")

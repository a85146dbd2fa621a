"""Engines side by side: every engine and knob configuration on a suite of graphs.

For each graph it times every applicable (engine, config) with the autotuner (warm-up,
median of repeats, outputs checked against the float64 reference), then reports:

- the best single engine: the fastest engine at its default knobs, on this graph;
- the heuristic's choice (modes A + FALLBACK, what ``g.build()`` picks with no tuning
  database) and its time;
- the autotuned best, re-timed side by side with the other two (interleaved rounds);
- ratios: heuristic / autotuned (target <= 1.10 on >= 90% of graphs) and
  best single engine / autotuned (target >= 1.0 on every graph).

It also reports the suite-level best single engine (one engine, default knobs, for every
graph) against autotuning. Timing is of ``plan.execute`` as a user calls it: NumPy in and
out on the CPU; on a GPU with inputs staged on the device (torch tensors / Buffers).

    python benchmarks/bench_engines.py --quick              # CPU, here (minutes)
    python benchmarks/bench_engines.py --device cuda --json h200.json   # the H200
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph import HeurMode
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.select import api
from fusegraph.select.autotune import autotune, random_inputs, stage_inputs
from fusegraph.select.heuristics import features, matching_rule
from fusegraph.select.timing import time_candidates

Builder = Callable[[], fg.Graph]


# ---- the suite ----------------------------------------------------------------------------------
def conv_bias_relu(n: int, c: int, hw: int, k: int, r: int, stride: int, dt: DT, name: str) -> Builder:
    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
        w = g.tensor("w", [k, c, r, r], fg.strides_for([k, c, r, r], "KRSC"))
        b = g.tensor("b", [1, k, 1, 1])
        y = g.conv_fprop(x, w, padding=[r // 2] * 2, stride=[stride] * 2, name="conv")
        g.relu(g.bias(y, b, name="bias"), name="relu").set_output(True).set_name("y")
        return g.validate()

    return build


def gemm(m: int, n: int, k: int, dt: DT, name: str) -> Builder:
    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, compute_data_type=DT.FLOAT)
        g.matmul(g.tensor("a", [m, k]), g.tensor("b", [k, n])).set_output(True).set_name("c")
        return g.validate()

    return build


def layernorm_gelu(rows: int, cols: int, dt: DT, name: str) -> Builder:
    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        x = g.tensor("x", [rows, cols])
        y, _, _ = g.layernorm(x, g.tensor("s", [1, cols]), g.tensor("b", [1, cols]), 1e-5)
        g.gelu(y).set_output(True).set_name("y")
        return g.validate()

    return build


def softmax(rows: int, cols: int, dt: DT, name: str) -> Builder:
    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        g.softmax(g.tensor("x", [rows, cols]), axis=-1).set_output(True).set_name("y")
        return g.validate()

    return build


def pointwise_chain(rows: int, cols: int, dt: DT, name: str) -> Builder:
    """8 ops: (x*a + b) -> relu -> *c -> tanh -> +x -> sigmoid -> *x (as DESIGN.md's chain)."""

    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        x = g.tensor("x", [rows, cols])
        a = g.tensor("a", [1, cols])
        b = g.tensor("b", [1, cols])
        y = g.add(g.mul(x, a), b)
        y = g.mul(g.relu(y), g.scalar(0.5))
        y = g.add(g.tanh(y), x)
        y = g.mul(g.sigmoid(y), x)
        y.set_output(True).set_name("y")
        return g.validate()

    return build


def sdpa(b: int, h: int, s: int, d: int, dt: DT, causal: bool, name: str) -> Builder:
    def build() -> fg.Graph:
        g = fg.Graph(name, io_data_type=dt, compute_data_type=DT.FLOAT)
        q, k, v = (g.tensor(n, [b, h, s, d]) for n in ("q", "k", "v"))
        g.sdpa(q, k, v, causal=causal).set_output(True).set_name("o")
        return g.validate()

    return build


def suite(device: str, quick: bool) -> list[Builder]:
    if device == "cpu":
        f = DT.FLOAT
        out = [
            conv_bias_relu(1, 64, 56, 64, 3, 1, f, "conv3x3_64_56_bias_relu"),
            conv_bias_relu(1, 64, 56, 256, 1, 1, f, "rn50_conv1x1_64to256_56"),
            conv_bias_relu(1, 128, 28, 128, 3, 1, f, "rn50_conv3x3_128_28"),
            conv_bias_relu(1, 256, 14, 256, 3, 1, f, "rn50_conv3x3_256_14"),
            gemm(256, 256, 256, f, "gemm_256"),
            gemm(1024, 1024, 1024, f, "gemm_1024"),
            layernorm_gelu(512, 1024, f, "layernorm_gelu_512x1024"),
            softmax(512, 1024, f, "softmax_512x1024"),
            pointwise_chain(1024, 1024, f, "pointwise_chain8_1024x1024"),
            sdpa(1, 8, 256, 64, f, False, "sdpa_1x8x256x64"),
        ]
        if not quick:
            out += [
                conv_bias_relu(1, 512, 7, 512, 3, 1, f, "rn50_conv3x3_512_7"),
                conv_bias_relu(1, 256, 56, 64, 1, 1, f, "rn50_conv1x1_256to64_56"),
                conv_bias_relu(8, 64, 56, 64, 3, 1, f, "conv3x3_64_56_b8"),
                gemm(2048, 2048, 2048, f, "gemm_2048"),
                sdpa(1, 8, 512, 64, f, True, "sdpa_causal_1x8x512x64"),
            ]
        return out
    h = DT.HALF
    out = [
        conv_bias_relu(32, 64, 56, 64, 3, 1, h, "conv3x3_64_56_b32_bias_relu"),
        conv_bias_relu(32, 64, 56, 256, 1, 1, h, "rn50_conv1x1_64to256_56_b32"),
        conv_bias_relu(32, 128, 28, 128, 3, 1, h, "rn50_conv3x3_128_28_b32"),
        conv_bias_relu(32, 256, 14, 256, 3, 1, h, "rn50_conv3x3_256_14_b32"),
        conv_bias_relu(32, 512, 7, 512, 3, 1, h, "rn50_conv3x3_512_7_b32"),
        gemm(4096, 4096, 4096, h, "gemm_4096_f16"),
        gemm(8192, 1024, 4096, h, "gemm_8192x1024x4096_f16"),
        layernorm_gelu(8192, 4096, h, "layernorm_gelu_8192x4096"),
        softmax(8192, 4096, h, "softmax_8192x4096"),
        pointwise_chain(8192, 4096, h, "pointwise_chain8_8192x4096"),
        sdpa(4, 16, 1024, 64, h, False, "sdpa_4x16x1024x64"),
        sdpa(4, 16, 1024, 64, h, True, "sdpa_causal_4x16x1024x64"),
    ]
    return out[:8] if quick else out


# ---- measuring ----------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    rule: str
    times: dict[str, float]  # config -> median ms (from tuning)
    statuses: dict[str, str]
    engine_default: dict[str, float]  # engine -> ms at its default knobs
    heuristic: str
    heuristic_status: str
    autotuned: str
    best_single: str
    retimed: dict[str, float] = field(default_factory=dict)  # side-by-side re-timing

    # The same config is the same plan: its ratio is 1 by definition (re-timing it twice
    # would only measure noise).
    @property
    def ratio_heuristic(self) -> float:
        if self.heuristic == self.autotuned:
            return 1.0
        return self.retimed["heuristic"] / self.retimed["autotuned"]

    @property
    def speedup_vs_single(self) -> float:
        if self.best_single == self.autotuned:
            return 1.0
        return self.retimed["best_single"] / self.retimed["autotuned"]


def heuristic_choice(g: fg.Graph, h: fg.Handle) -> list[EngineConfig]:
    cands = api.create_execution_plans(g, [HeurMode.A, HeurMode.FALLBACK], h, use_tuned=False)
    api.check_support(g, h)
    return [c.config for c in g._selection.candidates] if cands else []


def retime(plans: dict[str, ExecutionPlan], inputs: dict[str, Any], rounds: int, stat: str) -> dict[str, float]:
    """Each plan warmed to a steady state, then interleaved rounds (so drift and load hit all
    alike) -- fusegraph/select/timing.py, the routine autotune and `fusegraph bench` use; ms
    per plan, as the median (default) or the minimum (robust on a machine shared with other
    work)."""
    staged = {k: stage_inputs(p, inputs) for k, p in plans.items()}
    calls = {k: (lambda p=p, s=staged[k]: p.execute(s)) for k, p in plans.items()}
    syncs = {k: getattr(p, "synchronize", None) for k, p in plans.items()}
    got = time_candidates(calls, sync={k: s for k, s in syncs.items() if callable(s)},
                          min_rounds=rounds)  # blocks sized to ~2 ms each
    return {k: (t.median_ms if stat == "median" else t.min_ms) for k, t in got.items()}


def bench_graph(build: Builder, h: fg.Handle, args: argparse.Namespace) -> Row:
    g = build()
    name = g.name
    rule = matching_rule(features(g), h)
    order = heuristic_choice(g, h)
    res = autotune(
        g, None, h, budget_s=args.budget, repeats=args.repeats, persist=False, progress=not args.no_progress,
        modes=[HeurMode.B, HeurMode.FALLBACK], max_configs_per_engine=args.max_configs,
        engines=args.engines.split(",") if args.engines else None, statistic=args.stat,
    )
    def stat(m: Any) -> float:
        return float(m.min_ms if args.stat == "min" else m.median_ms)

    times = {str(m.config): stat(m) for m in res.measurements if m.status == "ok" and m.median_ms}
    statuses = {str(m.config): m.status for m in res.measurements}
    defaults: dict[str, float] = {}
    for m in res.measurements:
        if m.status == "ok" and not m.config.knobs and m.median_ms is not None:
            defaults[m.config.engine] = stat(m)
    # the heuristic's pick is the first candidate that builds (as g.build() does)
    heur, heur_status = "", "none"
    for c in order:
        st = statuses.get(str(c), "not timed")
        if st != "build_failed":
            heur, heur_status = str(c), st
            break
    best_single = min(defaults, key=lambda e: defaults[e]) if defaults else str(res.best)
    row = Row(name, rule.name if rule else "-", times, statuses, defaults, heur, heur_status, str(res.best), best_single)
    # re-time the three contenders side by side on fresh plans
    contenders = {"autotuned": res.best, "best_single": EngineConfig(best_single)}
    if heur and heur_status == "ok":
        contenders["heuristic"] = next(c for c in order if str(c) == heur)
    plans: dict[str, ExecutionPlan] = {}
    built: dict[EngineConfig, ExecutionPlan] = {}
    for k, cfg in contenders.items():
        if cfg not in built:
            built[cfg] = api.build_candidate(g, h, cfg)
        plans[k] = built[cfg]
    inputs = random_inputs(g)
    row.retimed = retime(plans, inputs, args.rounds, args.stat)
    if "heuristic" not in row.retimed:
        row.retimed["heuristic"] = math.inf  # the heuristic picked a plan that failed
    return row


# ---- reporting ----------------------------------------------------------------------------------
def report(rows: list[Row], device: str, stat: str) -> dict[str, Any]:
    print(f"\n=== engines on {device}: per graph (ms, {stat} of runs: per engine at default knobs from tuning; ratios from side-by-side re-timing) ===")
    engines = sorted({e for r in rows for e in r.engine_default})
    head = f"{'graph':32s} {'rule':22s} " + " ".join(f"{e:>10s}" for e in engines)
    head += f" {'tuned':>9s} {'heur/tuned':>10s} {'single/tuned':>12s}  autotuned config | heuristic config"
    print(head)
    for r in rows:
        cells = " ".join(f"{r.engine_default[e]:10.4f}" if e in r.engine_default else f"{'-':>10s}" for e in engines)
        print(
            f"{r.name:32s} {r.rule:22s} {cells} {r.retimed['autotuned']:9.4f} {r.ratio_heuristic:10.3f} "
            f"{r.speedup_vs_single:12.3f}  {r.autotuned} | {r.heuristic} [{r.heuristic_status}]"
        )
    n = len(rows)
    within = sum(1 for r in rows if r.ratio_heuristic <= 1.10)
    ge1 = sum(1 for r in rows if r.speedup_vs_single >= 0.995)  # 0.5% timing noise
    # suite-level single engine: one engine at default knobs for every graph it runs
    suite_best, suite_geo = None, math.inf
    for e in engines:
        if all(e in r.engine_default for r in rows):
            geo = math.exp(statistics.fmean(math.log(r.engine_default[e] / r.times.get(r.autotuned, r.retimed["autotuned"])) for r in rows))
            if geo < suite_geo:
                suite_best, suite_geo = e, geo
    geo_heur = math.exp(statistics.fmean(math.log(min(r.ratio_heuristic, 100.0)) for r in rows))
    geo_single = math.exp(statistics.fmean(math.log(r.speedup_vs_single) for r in rows))
    print(f"\nheuristics within 10% of the autotuned best on {within}/{n} graphs ({100 * within / n:.0f}%); "
          f"geomean heuristic/tuned = {geo_heur:.3f}")
    print(f"autotuned >= 1.0x the best single engine (per graph, default knobs) on {ge1}/{n} graphs; "
          f"geomean speedup {geo_single:.3f}x")
    if suite_best is not None:
        print(f"suite-level best single engine: {suite_best} (default knobs); autotuned is {suite_geo:.3f}x faster (geomean)")
    return {
        "device": device,
        "graphs": [
            {
                "name": r.name, "rule": r.rule, "engine_default_ms": r.engine_default, "configs_ms": r.times,
                "statuses": r.statuses, "heuristic": r.heuristic, "heuristic_status": r.heuristic_status,
                "autotuned": r.autotuned, "best_single": r.best_single, "retimed_ms": r.retimed,
                "heuristic_over_tuned": r.ratio_heuristic, "single_over_tuned": r.speedup_vs_single,
            }
            for r in rows
        ],
        "heuristic_within_10pct": [within, n],
        "tuned_ge_best_single": [ge1, n],
        "suite_best_single_engine": suite_best,
        "suite_speedup_vs_single_engine_geomean": suite_geo,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    p.add_argument("--quick", action="store_true", help="fewer graphs and configs (CPU: a few minutes)")
    p.add_argument("--budget", type=float, default=None, help="tuning budget per graph, s (default 20 quick / 60)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per config (default 10 quick / 30)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds in the side-by-side re-timing")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="statistic of the side-by-side re-timing (min is robust on a loaded, shared machine)")
    p.add_argument("--max-configs", type=int, default=None, help="configs per engine (default 6 quick / all)")
    p.add_argument("--only", default=None, help="only graphs whose name contains this")
    p.add_argument("--engines", default=None, help="comma-separated engines to tune over (default: all)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.budget = args.budget or (20.0 if args.quick else 60.0)
    args.repeats = args.repeats or (10 if args.quick else 30)
    if args.max_configs is None and args.quick:
        args.max_configs = 6
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    h = fg.Handle(args.device)
    from fusegraph.engines.registry import REGISTRY

    print(f"device {h.device}; engines: " + ", ".join(f"{r.name} {r.version} ({'ok' if r.available else r.available.reason})" for r in REGISTRY.info()))
    rows = []
    for build in suite(h.device.kind, args.quick):
        if args.only and args.only not in build().name:
            continue
        t0 = time.perf_counter()
        row = bench_graph(build, h, args)
        rows.append(row)
        print(f"  {row.name}: tuned {row.autotuned} {row.retimed['autotuned']:.4f} ms; heuristic {row.heuristic} "
              f"x{row.ratio_heuristic:.3f}; best single {row.best_single} x{row.speedup_vs_single:.3f} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    summary = report(rows, str(h.device), args.stat)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

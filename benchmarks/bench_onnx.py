"""The nine light ONNX models at batch 1: fusegraph's execution provider side by side with
ONNX Runtime (CPU) in one process.

For each model: the share of non-constant nodes that run on fusegraph engines, the
number of subgraphs, the session setup time (import, partition, compile; with a fresh
compile cache unless --cache-dir is given), the median latency of both after a warm-up
(runs interleaved, so both see the same machine state), and peak memory. Memory is the
peak resident-set growth (the kernel's VmHWM, reset before each measurement through
/proc/self/clear_refs) over (a) session creation plus the first run and (b) one warm run,
measured the same way for both; see fusegraph/onnx/memory.py.

    python benchmarks/bench_onnx.py                       # all nine, fresh cache
    python benchmarks/bench_onnx.py --models resnet50 --repeat 50 --cache-dir ~/.cache/fusegraph

Targets (issue 5): >= 90% of nodes on fusegraph; <= 1.0x ONNX Runtime on ResNet-50;
geometric mean <= 1.1x over the nine.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

import fusegraph.onnx as fgo
from fusegraph.onnx.memory import measure_peak

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = sorted(p.stem.removeprefix("light_") for p in LIGHT.glob("light_*.onnx"))


def _mib(n: int) -> float:
    return n / 2**20


def bench_model(name: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    path = str(LIGHT / f"light_{name}.onnx")
    opts: dict[str, Any] = {"cache_dir": cache_dir}
    if args.engine:
        opts["engine"] = args.engine
    if args.autotune:
        opts["autotune"] = args.autotune
    rng = np.random.default_rng(0)

    gc.collect()
    t0 = time.perf_counter()
    with measure_peak() as ours_setup_mem:
        ours = fgo.InferenceSession(path, providers=[(fgo.PROVIDER, opts), "CPUExecutionProvider"])
        x = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
        feed = {ours.get_inputs()[0].name: x}
        got = ours.run(None, feed)
    setup_s = time.perf_counter() - t0
    report = ours.partition_report()

    gc.collect()
    t0 = time.perf_counter()
    with measure_peak() as ort_setup_mem:
        ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        want = ref.run(None, feed)
    ort_setup_s = time.perf_counter() - t0

    g, w = np.asarray(got[0], np.float64), np.asarray(want[0], np.float64)
    rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))

    for _ in range(args.warmup):
        ours.run(None, feed)
        ref.run(None, feed)
    t_ours, t_ort = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        ours.run(None, feed)
        t_ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref.run(None, feed)
        t_ort.append(time.perf_counter() - t)
    with measure_peak() as ours_run_mem:
        ours.run(None, feed)
    with measure_peak() as ort_run_mem:
        ref.run(None, feed)
    row = {
        "model": name,
        "coverage": report.coverage,
        "fusegraph_nodes": report.fusegraph_nodes,
        "nodes": report.running_nodes,
        "subgraphs": len(report.subgraphs),
        "engines": sorted({s.engine.split("[")[0] for s in report.subgraphs if s.kind == "fusegraph"}),
        "setup_s": setup_s,
        "ort_setup_s": ort_setup_s,
        "ms": statistics.median(t_ours) * 1e3,
        "ort_ms": statistics.median(t_ort) * 1e3,
        "setup_mib": _mib(ours_setup_mem.bytes),
        "ort_setup_mib": _mib(ort_setup_mem.bytes),
        "run_mib": _mib(ours_run_mem.bytes),
        "ort_run_mib": _mib(ort_run_mem.bytes),
        "live_mib": _mib(ours.peak_live_bytes),
        "mem_method": ours_run_mem.method,
        "rel_err": rel,
    }
    row["ratio"] = row["ms"] / row["ort_ms"]
    if args.tier:
        row.update(tier_row(path, feed, ref, args, cache_dir))
    del ours, ref
    gc.collect()
    return row


def tier_row(path: str, feed: dict[str, Any], ref: Any, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """The whole model as one region through the torch-mlir tier (every op type excluded
    from the graph API, tier forced on), timed side by side with ONNX Runtime."""
    ops = ",".join(sorted({n.op_type for n in onnx.load(path).graph.node}))
    t0 = time.perf_counter()
    tier = fgo.InferenceSession(
        path, providers=[(fgo.PROVIDER, {"op_types_to_exclude": ops, "torch_mlir_tier": "on", "cache_dir": cache_dir})]
    )
    tier.run(None, feed)
    setup = time.perf_counter() - t0
    if tier.partition_report().tier_nodes == 0:
        return {"tier_ms": float("nan"), "tier_ort_ms": float("nan"), "tier_setup_s": setup}
    for _ in range(args.warmup):
        tier.run(None, feed)
    t_tier, t_ort = [], []
    for _ in range(max(args.repeat // 2, 3)):
        t = time.perf_counter()
        tier.run(None, feed)
        t_tier.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref.run(None, feed)
        t_ort.append(time.perf_counter() - t)
    return {"tier_ms": statistics.median(t_tier) * 1e3, "tier_ort_ms": statistics.median(t_ort) * 1e3, "tier_setup_s": setup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--engine", default=None, help="pin an engine (default: the selection layer)")
    p.add_argument("--cache-dir", default=None, help="compile cache to use (default: a fresh one, so setup is a cold compile)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--autotune", type=float, default=0.0,
                   help="seconds per model to autotune its partition at setup (provider option autotune); "
                        "the result lands in the tuning database, so later runs without it use it too")
    p.add_argument("--tier", action="store_true",
                   help="also time each whole model compiled through the torch-mlir tier (IREE's ONNX importer) vs ONNX Runtime")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ort.set_default_logger_severity(3)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}")
    with tempfile.TemporaryDirectory(prefix="fusegraph-bench-") as tmp:
        cache = args.cache_dir or tmp
        rows = []
        for name in names:
            print(f"... {name}", file=sys.stderr, flush=True)
            rows.append(bench_model(name, args, cache))
    head = (
        "| model | on fusegraph | subgraphs | engine(s) | setup s (ORT) | fusegraph ms | ORT ms | ratio "
        "| setup+1st run MiB (ORT) | warm run MiB (ORT) | rel err |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(
            f"| {r['model']} | {100 * r['coverage']:.1f}% ({r['fusegraph_nodes']}/{r['nodes']}) | {r['subgraphs']} "
            f"| {','.join(r['engines']) or '-'} | {r['setup_s']:.1f} ({r['ort_setup_s']:.2f}) | {r['ms']:.2f} "
            f"| {r['ort_ms']:.2f} | {r['ratio']:.2f}x | {r['setup_mib']:.0f} ({r['ort_setup_mib']:.0f}) "
            f"| {r['run_mib']:.1f} ({r['ort_run_mib']:.1f}) | {r['rel_err']:.1e} |"
        )
    if args.tier:
        print()
        print("| model | torch-mlir tier ms (whole model) | ORT ms | ratio | tier setup s |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['tier_ms']:.2f} | {r['tier_ort_ms']:.2f} | {r['tier_ms'] / r['tier_ort_ms']:.2f}x "
                  f"| {r['tier_setup_s']:.1f} |")
    geo = math.exp(statistics.mean(math.log(r["ratio"]) for r in rows))
    cov = min(r["coverage"] for r in rows)
    print()
    print(f"geometric mean latency ratio (fusegraph / ONNX Runtime): {geo:.2f}x  (target <= 1.1x)")
    res = [r for r in rows if r["model"] == "resnet50"]
    if res:
        print(f"ResNet-50: {res[0]['ratio']:.2f}x ONNX Runtime  (target <= 1.0x)")
    print(f"lowest share of nodes on fusegraph: {100 * cov:.1f}%  (target >= 90%)")
    print(f"memory method: {rows[0]['mem_method']}; repeat {args.repeat} after {args.warmup} warm-up runs, batch 1, "
          f"{'engine ' + args.engine if args.engine else 'engines chosen by the selection layer'}"
          f"{f', autotune {args.autotune:g} s per model at setup' if args.autotune else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole-model CPU runtimes side by side: ONNX Runtime's configurations against OpenVINO's
CPU plugin, on the corpus exports of ``bench_models.py`` (the same ONNX files).

Issue 14 wants fusegraph ahead of ONNX Runtime on real models; fusegraph's own engines did
not beat ORT's MLAS kernels on these 2 AVX2 cores (docs/models.md), so the question here is
whether another whole-model runtime does, read from the same file. Per model, in a process
of its own (memory is measured per model), all candidates are created in one process and
timed in ``--rounds`` rounds of alternating blocks (the order rotates each round; a pause
between blocks lets a spinning thread pool go quiet; a time-based warm-up before each
block), each block ``--per`` timed calls; a candidate's time is the median of its block
medians, and its ratio to ORT's default is the median over rounds of the paired block
ratios (adjacent blocks saw about the same load). Agreement: the worst relative error of
each candidate's outputs against ORT's default on the export's input and on fresh random
inputs. Setup: session creation (OpenVINO: read + compile) and its resident-set growth
over creation + first call.

    python benchmarks/bench_cpu_runtimes.py --models resnet18,hf_bert --rounds 6
    python benchmarks/bench_cpu_runtimes.py --candidates ort,ort_nospin,ov --json out.json

Needs ``openvino`` (the ``openvino`` extra) for the ``ov*`` candidates and torch plus the
``bench`` extra to export models that are not in the export cache yet.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAUSE_S = 0.05
WARM_S = 0.15
CANDIDATES = ("ort", "ort_nospin", "ort_stopspin", "ort_t1", "ov", "ov_t1", "ov_tput")
DEFAULT_MODELS = ("resnet18,resnet50,mobilenet_v2,mobilenet_v3_small,efficientnet_b0,convnext_tiny,"
                  "regnet_y_400mf,swin_t,timm_vit_tiny,hf_bert,hf_gpt2,hf_llama,hf_t5_encoder,nn_lstm_tagger")

Run = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def make(kind: str, path: str) -> Run:
    """One candidate's call: feed -> outputs as NumPy arrays (each side copies its outputs out)."""
    if kind.startswith("ort"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if kind == "ort_nospin":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if kind == "ort_stopspin":  # spin within a run, stop at its end
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if kind == "ort_t1":
            so.intra_op_num_threads = 1
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

        def ort_run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            return sess.run(None, feed)  # type: ignore[no-any-return]

        return ort_run
    import openvino as ov

    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if kind == "ov_t1":
        config["INFERENCE_NUM_THREADS"] = 1
    if kind == "ov_tput":  # one stream, both cores: what LATENCY should pick anyway
        config = {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", config)
    req = compiled.create_infer_request()
    ports = [p.get_names() for p in compiled.inputs]  # a port may carry several names (GPT-2's input)
    outs = list(compiled.outputs)

    def ov_run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        req.start_async({k: feed[next(n for n in names if n in feed)] for k, names in enumerate(ports)},
                        share_inputs=True)
        req.wait()
        return [np.array(req.get_tensor(o).data, copy=True) for o in outs]

    return ov_run


def rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if g.shape != w.shape or not np.array_equal(np.isfinite(g), np.isfinite(w)):
        return math.inf
    ok = np.isfinite(w)
    return float(np.linalg.norm(g[ok] - w[ok]) / max(float(np.linalg.norm(w[ok])), 1e-30))


def fresh_feed(feed: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Fresh inputs of the export's shapes: normal floats; integers (token ids) drawn below the
    export input's maximum + 1, so embeddings stay in range."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in feed.items():
        if v.dtype.kind == "f":
            out[k] = rng.standard_normal(v.shape).astype(v.dtype)
        else:
            out[k] = rng.integers(0, int(v.max()) + 1, v.shape).astype(v.dtype)
    return out


def _block(fn: Run, feed: dict[str, np.ndarray], per: int) -> float:
    t0 = time.perf_counter()
    fn(feed)
    while time.perf_counter() - t0 < WARM_S:
        fn(feed)
    ts = []
    for _ in range(per):
        t = time.perf_counter()
        fn(feed)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench_models import BY_NAME, export_dir, exported

    spec = BY_NAME[name]
    path, _module, feed = exported(spec, export_dir(args), args.seed)
    del _module
    gc.collect()
    row: dict[str, Any] = {"model": name, "family": spec.family, "load0": os.getloadavg()[0]}
    runs: dict[str, Run] = {}
    for kind in args.candidates.split(","):
        rss0 = _rss_kib()
        t0 = time.perf_counter()
        try:
            runs[kind] = make(kind, str(path))
            runs[kind](feed)
        except Exception as exc:  # a refusal is a row entry, not a failed run
            row[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            runs.pop(kind, None)
            continue
        row[f"{kind}_setup_s"] = time.perf_counter() - t0
        row[f"{kind}_mib"] = (_rss_kib() - rss0) / 1024
    base = runs.get("ort")
    if base is None:
        row["error"] = row.get("ort_error", "no ORT session")
        return row
    feeds = [feed, fresh_feed(feed, args.seed + 1)]
    wants = [base(f) for f in feeds]
    for kind, fn in runs.items():
        row[f"{kind}_rel"] = max(rel(g, w) for f, want in zip(feeds, wants, strict=True)
                                 for g, w in zip(fn(f), want, strict=True))
    blocks: dict[str, list[float]] = {k: [] for k in runs}
    kinds = list(runs)
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            time.sleep(PAUSE_S)
            blocks[kind].append(_block(runs[kind], feed, args.per))
    for kind, bs in blocks.items():
        row[f"{kind}_ms"] = statistics.median(bs) * 1e3
        row[f"{kind}_vs_ort"] = statistics.median(a / b for a, b in zip(bs, blocks["ort"], strict=True))
        if "ort_nospin" in blocks:  # against ORT's faster configuration on a busy machine
            row[f"{kind}_vs_nospin"] = statistics.median(a / b for a, b in zip(bs, blocks["ort_nospin"], strict=True))
    row["load1"] = os.getloadavg()[0]
    return row


def run_isolated(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--one", name, "--row-out", out, "--rounds", str(args.rounds),
           "--per", str(args.per), "--seed", str(args.seed), "--candidates", args.candidates]
    if args.export_dir:
        cmd += ["--export-dir", args.export_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        text = Path(out).read_text() if Path(out).stat().st_size else ""
        if proc.returncode == 0 and text:
            return json.loads(text)  # type: ignore[no-any-return]
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"model": name, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {args.timeout:.0f} s"}
    finally:
        Path(out).unlink(missing_ok=True)


def print_table(rows: list[dict[str, Any]], kinds: list[str]) -> None:
    head = ["model", "ORT ms"] + [f"{k}/ort" for k in kinds if k != "ort"] + ["ov rel err", "ov setup s (ort)", "ov MiB (ort)", "load"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | error: {r['error']} |")
            continue
        cells = [r["model"], f"{r['ort_ms']:.2f}"]
        for k in kinds:
            if k == "ort":
                continue
            if f"{k}_vs_ort" in r:
                cells.append(f"{r[f'{k}_vs_ort']:.2f}x")
                ratios[k].append(r[f"{k}_vs_ort"])
            else:
                cells.append("refused: " + r.get(f"{k}_error", "?")[:60])
        cells.append(f"{r.get('ov_rel', math.nan):.1e}")
        cells.append(f"{r.get('ov_setup_s', math.nan):.2f} ({r.get('ort_setup_s', math.nan):.2f})")
        cells.append(f"{r.get('ov_mib', math.nan):.0f} ({r.get('ort_mib', math.nan):.0f})")
        cells.append(f"{r['load0']:.1f}-{r['load1']:.1f}")
        print("| " + " | ".join(cells) + " |")
    for k, xs in ratios.items():
        if xs:
            print(f"{k}: {_summary(xs)} ORT default")
        ns = [r[f"{k}_vs_nospin"] for r in rows if f"{k}_vs_nospin" in r]
        if ns and k not in ("ort", "ort_nospin"):
            print(f"{k}: {_summary(ns)} ORT without spinning")


def _summary(xs: list[float]) -> str:
    g = math.exp(sum(math.log(x) for x in xs) / len(xs))
    return (f"geomean {g:.3f}x over {len(xs)} models; <=0.97x on {sum(x <= 0.97 for x in xs)}; "
            f"min {min(xs):.2f}x, max {max(xs):.2f}x of""")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--per", type=int, default=10, help="timed calls per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-dir", default=None)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default="bench_cpu_runtimes.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "ort" not in args.candidates.split(","):
        args.candidates = "ort," + args.candidates
    if args.one:
        import onnxruntime as ort

        ort.set_default_logger_severity(3)
        row = bench_one(args.one, args)
        Path(args.row_out).write_text(json.dumps(row))
        return 0
    rows = []
    for name in args.models.split(","):
        row = run_isolated(name, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print_table(rows, args.candidates.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The nine light ONNX models (batch 1, or --batch N): fusegraph's execution provider side by side with
ONNX Runtime (CPU) in one process.

For each model: the share of non-constant nodes that run on fusegraph engines, the
number of subgraphs, the session setup time (import, partition, compile; with a fresh
compile cache unless --cache-dir is given), the median latency of both after a warm-up,
peak memory, and the relative error of every output against ONNX Runtime. Memory is the
peak resident-set growth (the kernel's VmHWM, reset before each measurement through
/proc/self/clear_refs) over (a) session creation plus the first run and (b) one warm run,
measured the same way for both; see fusegraph/onnx/memory.py.

Weights: the light models ship none (every weight is a ConstantOfShape fill of one value,
so every output is constant and an error comparison means nothing). By default they run
with random weights (fusegraph.onnx.weights.randomize_weights: He-scaled, fixed --seed),
and the logits (the softmax's input) are an extra output, compared too;
--shipped-weights runs the files as they are.

Fairness: fusegraph runs in this process, ONNX Runtime in a worker process of its own
(OrtWorker), in ROUNDS rounds of three blocks, each alone, after a short pause and a
time-based warm-up: fusegraph; ORT's default configuration; ORT with
"session.intra_op.allow_spinning" off. Separate processes because sharing one skewed
both ways: ORT's spinning threads slowed whatever ran next (a PyTorch ResNet-50 took 71 ms
right after an ORT run vs 34 ms), even non-spinning interleaved runs cost ~12%, and ORT's
allocations left fusegraph's heap trimmed after every run (DenseNet-121: ~17,000 page
faults and 42 ms a run instead of none and 24 ms). ORT's latency is the faster of its two
configurations (its spinning keeps its threads hot between parallel sections: alone on 2
cores, light SqueezeNet 1.7 ms with spinning, 2.2 ms without), so fusegraph is compared
against ORT at its best; both are printed. The machine may be shared: "others' CPU" is
the share of CPU time other processes used meanwhile (a busy neighbour slowed small
multi-threaded kernels up to 60x here).

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
import os
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
from fusegraph.onnx.weights import randomize_weights

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = sorted(p.stem.removeprefix("light_") for p in LIGHT.glob("light_*.onnx"))


def _mib(n: int) -> float:
    return n / 2**20


ROUNDS = 4  # alternating rounds of the three timing blocks
PAUSE_S = 0.05  # between blocks: lets a spinning ORT pool go quiet
WARM_S = 0.3  # each block's warm-up lasts at least this long (see _warm)


def _ort_session(src: str | bytes, *, spin: bool, threads: int = 0) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(src, sess_options=so, providers=["CPUExecutionProvider"])


def _ort_worker(conn: Any) -> None:
    """The ONNX Runtime side, in a process of its own: its thread pool, arena and heap never
    share a process with fusegraph's (in one process, ORT's allocations left fusegraph's
    torch heap trimmed after every run: DenseNet-121 then took ~17,000 page faults and
    42 ms a run instead of 0 and 24 ms, while any allocator tuning slowed ORT instead)."""
    ort.set_default_logger_severity(3)
    sessions: dict[str, ort.InferenceSession] = {}
    feed: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "load":
            _, src, feed = msg
            sessions.clear()
            gc.collect()
            t0 = time.perf_counter()
            with measure_peak() as mem:
                sessions["default"] = _ort_session(src, spin=True)  # ORT as a user gets it
                want = sessions["default"].run(None, feed)
            setup_s = time.perf_counter() - t0
            sessions["no-spin"] = _ort_session(src, spin=False)
            sessions["no-spin"].run(None, feed)
            conn.send((want, setup_s, mem.bytes))
        elif op == "one-thread":  # a single-threaded session too, made on request
            sessions["one-thread"] = _ort_session(src, spin=False, threads=1)
            sessions["one-thread"].run(None, feed)
            conn.send(None)
        elif op == "time":
            _, which, warmup, n = msg
            run = sessions[which].run
            cpu0 = sum(os.times()[:2])
            _warm(run, feed, warmup)
            times: list[float] = []
            for _ in range(n):
                _time(run, feed, times)
            conn.send((times, sum(os.times()[:2]) - cpu0))
        elif op == "mem":
            with measure_peak() as mem:
                sessions[msg[1]].run(None, feed)
            conn.send(mem.bytes)
        else:
            conn.send(None)
            return


class OrtWorker:
    """Drives _ort_worker: ORT's sessions for the current model, timed on request."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_ort_worker, args=(child,), daemon=True)
        self._proc.start()
        self.cpu_s = 0.0  # CPU time the worker spent timing (not "others'" CPU)

    def load(self, src: str, feed: dict[str, Any]) -> tuple[list[np.ndarray], float, int]:
        self._conn.send(("load", src, feed))
        return self._conn.recv()  # type: ignore[no-any-return]

    def add_one_thread(self) -> None:
        """Adds an ``intra_op_num_threads=1`` session of the loaded model (``time("one-thread", ...)``)."""
        self._conn.send(("one-thread",))
        self._conn.recv()

    def time(self, which: str, warmup: int, n: int) -> list[float]:
        self._conn.send(("time", which, warmup, n))
        times, cpu = self._conn.recv()
        self.cpu_s += cpu
        return times  # type: ignore[no-any-return]

    def mem(self, which: str) -> int:
        self._conn.send(("mem", which))
        return int(self._conn.recv())

    def close(self) -> None:
        self._conn.send(("close",))
        self._conn.recv()
        self._proc.join(timeout=10)


def _model_source(name: str, args: argparse.Namespace) -> tuple[str | bytes, str | None]:
    """The model as given to both sessions (a path as shipped, else the bytes of the
    randomized model) and the name of the exposed logits output, if any."""
    path = str(LIGHT / f"light_{name}.onnx")
    if args.shipped_weights and args.batch == 1:
        return path, None
    shipped = onnx.load(path)
    model = shipped if args.shipped_weights else randomize_weights(shipped, np.random.default_rng(args.seed))
    if args.batch != 1:
        model = _with_batch(model, args.batch)
    known = {o.name for o in shipped.graph.output}
    extra = [o.name for o in model.graph.output if o.name not in known]
    return model.SerializeToString(), (extra[0] if extra else None)


def _with_batch(model: onnx.ModelProto, n: int) -> onnx.ModelProto:
    """The light model at batch ``n``: its data input's first dim, and the Reshape shapes
    that pin a batch of 1 (they flatten to [1, C] before the classifier)."""
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {i.name: i for i in out.graph.initializer}
    for v in [*out.graph.input, *out.graph.output]:
        if v.name in inits or not v.type.tensor_type.shape.dim:
            continue
        d = v.type.tensor_type.shape.dim[0]
        if d.dim_value == 1:
            d.dim_value = n
    for node in out.graph.node:
        if node.op_type == "Reshape" and node.input[1] in inits:
            shape = numpy_helper.to_array(inits[node.input[1]]).copy()
            if shape.size and shape[0] == 1:
                shape[0] = n
                inits[node.input[1]].CopyFrom(numpy_helper.from_array(shape, node.input[1]))
    del out.graph.value_info[:]
    return out


class _OthersCpu:
    """The share of the machine's CPU time that other processes used while timing: the
    machine is shared, and on 2 cores a busy neighbour can slow small multi-threaded
    kernels by an order of magnitude (threads wait at every barrier for a core), so the
    table says how quiet the machine was. Linux only (NaN elsewhere)."""

    def __init__(self, worker: OrtWorker | None = None) -> None:
        self.worker = worker
        self.share = math.nan

    def __enter__(self) -> _OthersCpu:
        self.share = math.nan
        self._worker0 = self.worker.cpu_s if self.worker else 0.0
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start is None or end is None:
            return
        busy, ours, wall = (e - s for e, s in zip(end, self._start, strict=True))
        if self.worker is not None:
            ours += self.worker.cpu_s - self._worker0
        self.share = max(busy - ours, 0.0) / max(wall * (os.cpu_count() or 1), 1e-9)

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        t = os.times()
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic()


def _time(fn: Any, feed: dict[str, Any], out: list[float]) -> None:
    t = time.perf_counter()
    fn(None, feed)
    out.append(time.perf_counter() - t)


def _warm(run: Any, feed: dict[str, Any], runs: int) -> None:
    """At least ``runs`` runs and WARM_S seconds: after even a short idle spell this 2-vCPU
    machine runs slowly for tens of milliseconds (fusegraph's SqueezeNet: ~6 ms a run for
    the first ~70 ms after a 1 s pause, 3.8 ms after), so a count-based warm-up would time
    whoever follows a pause in that slow spell."""
    t0 = time.perf_counter()
    k = 0
    while k < runs or time.perf_counter() - t0 < WARM_S:
        run(None, feed)
        k += 1


def bench_model(name: str, args: argparse.Namespace, cache_dir: str, worker: OrtWorker, tmp: str) -> dict[str, Any]:
    src, logits = _model_source(name, args)
    if isinstance(src, bytes):  # the worker loads it from a file, not through the pipe
        path = str(Path(tmp) / f"{name}.onnx")
        Path(path).write_bytes(src)
        src = path
    opts: dict[str, Any] = {"cache_dir": cache_dir}
    if args.engine:
        opts["engine"] = args.engine
    if args.autotune:
        opts["autotune"] = args.autotune
    if args.device != "cpu":
        opts["device"] = args.device
    rng = np.random.default_rng(0)

    gc.collect()
    t0 = time.perf_counter()
    with measure_peak() as ours_setup_mem:
        ours = fgo.InferenceSession(src, providers=[(fgo.PROVIDER, opts), "CPUExecutionProvider"])
        x = rng.standard_normal((args.batch, 3, 224, 224), dtype=np.float32)
        feed = {ours.get_inputs()[0].name: x}
        got = ours.run(None, feed)
    setup_s = time.perf_counter() - t0
    report = ours.partition_report()
    want, ort_setup_s, ort_setup_bytes = worker.load(src, feed)

    names = [o.name for o in ours.get_outputs()]
    errs: dict[str, float] = {}
    for n, g, w in zip(names, got, want, strict=True):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs["logits" if n == logits else n] = float(np.linalg.norm(g64 - w64)) / max(float(np.linalg.norm(w64)), 1e-30)
    worst = max(errs, key=lambda k: errs[k])

    t_ours: list[float] = []
    t_calm: list[float] = []
    t_ref: list[float] = []
    with _OthersCpu(worker) as others:
        # Rounds of three blocks, each alone after a pause: fusegraph here, then ORT's
        # default configuration and ORT without spinning in the worker process (this one
        # idle meanwhile). Nothing interleaves with anything.
        per_round = max(1, -(-args.repeat // ROUNDS))
        for _ in range(ROUNDS):
            time.sleep(PAUSE_S)
            _warm(ours.run, feed, args.warmup)
            for _ in range(per_round):
                _time(ours.run, feed, t_ours)
            time.sleep(PAUSE_S)
            t_ref += worker.time("default", args.warmup, per_round)
            time.sleep(PAUSE_S)
            t_calm += worker.time("no-spin", args.warmup, per_round)
    time.sleep(PAUSE_S)

    with measure_peak() as ours_run_mem:
        ours.run(None, feed)
    ort_run_bytes = worker.mem("default")
    ort_default_ms = statistics.median(t_ref) * 1e3
    ort_nospin_ms = statistics.median(t_calm) * 1e3
    row: dict[str, Any] = {
        "model": name,
        "weights": "shipped" if args.shipped_weights else f"random (seed {args.seed})",
        "coverage": report.coverage,
        "fusegraph_nodes": report.fusegraph_nodes,
        "nodes": report.running_nodes,
        "subgraphs": len(report.subgraphs),
        "engines": sorted({s.engine.split("[")[0] for s in report.subgraphs if s.kind == "fusegraph"}),
        "engine_configs": sorted({s.engine for s in report.subgraphs if s.kind == "fusegraph"}),
        "setup_s": setup_s,
        "ort_setup_s": ort_setup_s,
        "ms": statistics.median(t_ours) * 1e3,
        "ort_default_ms": ort_default_ms,
        "ort_nospin_ms": ort_nospin_ms,
        "ort_ms": min(ort_default_ms, ort_nospin_ms),
        "ort_best": "default" if ort_default_ms <= ort_nospin_ms else "no-spin",
        "setup_mib": _mib(ours_setup_mem.bytes),
        "ort_setup_mib": _mib(ort_setup_bytes),
        "run_mib": _mib(ours_run_mem.bytes),
        "ort_run_mib": _mib(ort_run_bytes),
        "live_mib": _mib(ours.peak_live_bytes),
        "mem_method": ours_run_mem.method,
        "others_cpu": others.share,
        "rel_errs": errs,
        "rel_err": errs[worst],
        "worst_output": worst,
    }
    row["ratio"] = row["ms"] / row["ort_ms"]
    if args.tier:
        row.update(tier_row(src, feed, args, cache_dir))
        row["tier_ort_ms"] = row["ort_ms"]
    del ours
    gc.collect()
    return row


def tier_row(src: str, feed: dict[str, Any], args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """The whole model as one region through the torch-mlir tier (every op type excluded
    from the graph API, tier forced on), timed alone; compared with ORT's best timing."""
    model = onnx.load(src)
    ops = ",".join(sorted({n.op_type for n in model.graph.node}))
    del model
    t0 = time.perf_counter()
    tier = fgo.InferenceSession(
        src, providers=[(fgo.PROVIDER, {"op_types_to_exclude": ops, "torch_mlir_tier": "on", "cache_dir": cache_dir})]
    )
    tier.run(None, feed)
    setup = time.perf_counter() - t0
    if tier.partition_report().tier_nodes == 0:
        return {"tier_ms": float("nan"), "tier_setup_s": setup}
    _warm(tier.run, feed, args.warmup)
    t_tier: list[float] = []
    for _ in range(max(args.repeat // 2, 3)):
        _time(tier.run, feed, t_tier)
    return {"tier_ms": statistics.median(t_tier) * 1e3, "tier_setup_s": setup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--engine", default=None, help="pin an engine (default: the selection layer)")
    p.add_argument("--batch", type=int, default=1, help="batch size (the light models are rewritten from their batch of 1)")
    p.add_argument("--device", default="cpu",
                   help="where fusegraph runs (cpu, cuda:0); ONNX Runtime always runs on the CPU, so on a GPU the "
                        "ratio is against ORT's CPU provider")
    p.add_argument("--cache-dir", default=None, help="compile cache to use (default: a fresh one, so setup is a cold compile)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--autotune", type=float, default=0.0,
                   help="seconds per model to autotune its partition at setup (provider option autotune); "
                        "the result lands in the tuning database, so later runs without it use it too")
    p.add_argument("--shipped-weights", action="store_true",
                   help="run the models as shipped (constant ConstantOfShape weights: constant outputs, "
                        "so the error column means little) instead of with random weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--tier", action="store_true",
                   help="also time each whole model compiled through the torch-mlir tier (IREE's ONNX importer) vs ONNX Runtime")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ort.set_default_logger_severity(3)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}")
    worker = OrtWorker()
    try:
        with tempfile.TemporaryDirectory(prefix="fusegraph-bench-") as tmp:
            cache = args.cache_dir or str(Path(tmp) / "cache")
            rows = []
            for name in names:
                print(f"... {name}", file=sys.stderr, flush=True)
                rows.append(bench_model(name, args, cache, worker, tmp))
    finally:
        worker.close()
    head = (
        "| model | on fusegraph | subgraphs | engine(s) | setup s (ORT) | fusegraph ms | ORT ms | ratio "
        "| ORT default / no-spin ms | others' CPU | setup+1st run MiB (ORT) | warm run MiB (ORT) | rel err per output | worst |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_errs"].items())
        print(
            f"| {r['model']} | {100 * r['coverage']:.1f}% ({r['fusegraph_nodes']}/{r['nodes']}) | {r['subgraphs']} "
            f"| {','.join(r['engines']) or '-'} | {r['setup_s']:.1f} ({r['ort_setup_s']:.2f}) | {r['ms']:.2f} "
            f"| {r['ort_ms']:.2f} | {r['ratio']:.2f}x | {r['ort_default_ms']:.2f} / {r['ort_nospin_ms']:.2f} "
            f"| {100 * r['others_cpu']:.0f}% "
            f"| {r['setup_mib']:.0f} ({r['ort_setup_mib']:.0f}) "
            f"| {r['run_mib']:.1f} ({r['ort_run_mib']:.1f}) | {errs} | {r['worst_output']} {r['rel_err']:.1e} |"
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
    worst = max(rows, key=lambda r: r["rel_err"])
    print(f"largest relative error: {worst['rel_err']:.1e} ({worst['model']}, output {worst['worst_output']})")
    print(f"ORT ms = the faster of ORT's default config (spinning) and no-spin, each timed alone in a process of "
          f"its own; the default was faster on {sum(r['ort_best'] == 'default' for r in rows)}/{len(rows)} models")
    print("others' CPU: share of the machine's CPU time used by other processes while timing (a busy "
          "neighbour makes latencies unreliable)")
    print(f"fusegraph on {args.device}; memory method: {rows[0]['mem_method']}; repeat {args.repeat} after {args.warmup} warm-up runs, batch {args.batch}, "
          f"{'weights as shipped' if args.shipped_weights else f'random weights (seed {args.seed})'}, "
          f"{'engine ' + args.engine if args.engine else 'engines chosen by the selection layer'}"
          f"{f', autotune {args.autotune:g} s per model at setup' if args.autotune else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU paths for the same claimed fusegraph graphs, side by side with ONNX Runtime (issue 14).

For each corpus model (``bench_models.py``'s exports), a fusegraph session is built with the
torch engine and the floor off, so every claimed subgraph is a fusegraph unit; then each
unit's plan is swapped for one CPU path after another and the whole session is timed, the
unclaimed rest running on ONNX Runtime as usual. The paths:

* ``onednn_graph``: the torch engine's CPU path before issue 14 -- the TorchScript oneDNN
  Graph bridge, or op-by-op eager where the bridge refuses the graph;
* ``eager``: the torch engine's op-by-op plan (its default CPU path since cpu_compile is off by default);
* ``chain``: the torch engine's compiled CPU chain, ``cpu_compile=auto`` (opt-in;
  ``engines/torch/frozen.py``: the AOTInductor package, compiled or loaded from the cache,
  else Inductor; threads adaptive);
* ``inductor``: the plan's graph function traced once with ``make_fx`` (weights as constants
  of the FX graph) and compiled by Inductor (``torch._inductor.compile``, no Dynamo guards per
  call) with ``freezing`` on: conv/linear weights prepacked for oneDNN;
  ``inductor_cpp``: the same with ``cpp_wrapper``;
* ``aoti``: ``torch.export`` + AOTInductor (``aoti_compile_and_package``), loaded from the
  package (what a warm session would load from the cache directory), freezing on;
* ``iree``: a fusegraph session pinned to the IREE engine (its CPU default: data tiling,
  IREE's ukernels), the same claimed graph (packed for IREE);
* ``<path>_t1`` (``inductor_t1``, ``aoti_t1``): the compiled path with one intra-op thread
  while it runs, also compared with a single-threaded ONNX Runtime session -- the kernels'
  quality apart from threading, which on a shared, oversubscribed 2-core machine decides
  more than anything else (a team of two OpenMP threads waits at every barrier for a core).

ONNX Runtime runs in a worker process (``bench_onnx.OrtWorker``), default configuration and
``allow_spinning=0``; all blocks alternate in rounds, each after a pause and a time-based
warm-up. Printed per model: each path's median ms and its ratio to ONNX Runtime's better
configuration (median of runs; and best block against best block, which a neighbour's
burst on this shared machine disturbs less), agreement with ONNX Runtime, and setup: ONNX
Runtime's session creation, fusegraph's session creation (current path), each compiled
path's compile time cold (empty Inductor cache) and warm (a fresh process with the cache
the cold compile left; AOTInductor: loading the package).

    python benchmarks/bench_cpu_paths.py --models resnet18,hf_bert --rounds 8
    python benchmarks/bench_cpu_paths.py --paths current,inductor,aoti --json cpu_paths.json
"""

from __future__ import annotations

import argparse
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

PATHS = ("onednn_graph", "eager", "chain", "inductor", "inductor_cpp", "inductor_t1", "aoti", "aoti_t1", "iree")
DEFAULT_PATHS = "onednn_graph,eager,chain,inductor_t1,aoti_t1,iree"
DEFAULT_MODELS = (
    "resnet18,mobilenet_v2,efficientnet_b0,timm_convnext_atto,hf_bert,hf_gpt2,timm_vit_tiny,nn_lstm_tagger"
)


# ---- the compiled candidates (over one unit's graph) ------------------------------------------
def _graph_module(unit: Any) -> Any:
    """The unit's graph as a torch Module: weights as buffers, activations as arguments."""
    import torch

    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.torch.context import _Ctx
    from fusegraph.engines.torch.function import _graph_function

    graph = unit.graph
    ctx = _Ctx(graph, unit.handle, EngineConfig("torch", (("compile", True),)))
    ctx.functional = True
    fn = _graph_function(graph, ctx, torch.device("cpu"), {})
    by_name = {t.name: t for t in graph.inputs()}
    weights = {n: _torch_value(by_name[n], v).clone() for n, v in unit.weights.items()}
    acts = [t for t in graph.inputs() if t.name not in weights]
    outs = [t.name for t in graph.outputs()]

    class GraphModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.names = list(weights)
            for i, n in enumerate(self.names):
                self.register_buffer(f"w{i}", weights[n])

        def forward(self, *xs: Any) -> Any:
            env = {n: getattr(self, f"w{i}") for i, n in enumerate(self.names)}
            env.update({t.name: x for t, x in zip(acts, xs, strict=True)})
            r = fn(env)
            return tuple(r[n] for n in outs)

    return GraphModule().eval(), acts, outs


def _torch_value(t: Any, value: Any) -> Any:
    import torch

    from fusegraph.engines.torch.convert import from_numpy
    from fusegraph.graph import layout

    x = from_numpy(np.asarray(value), t.dtype)
    if not layout.same_strides(t.shape, x.stride(), t.strides):
        x = torch.empty_strided(t.shape, t.strides, dtype=x.dtype).copy_(x)
    return x


def _example(acts: list[Any]) -> tuple[Any, ...]:
    import torch

    from fusegraph.engines.torch.convert import torch_dtype

    rng = np.random.default_rng(0)
    out = []
    for t in acts:
        x = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(t.dtype))
        if t.dtype.is_float:
            x.copy_(torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)))
        else:
            x.zero_()
        out.append(x)
    return tuple(out)


class Compiled:
    """One unit's graph through a compiled path; ``execute`` takes the unit's packs."""

    def __init__(self, unit: Any, path: str, workdir: str) -> None:
        import torch

        self.path = path
        self.threads = 1 if path.endswith("_t1") else 0
        path = path.removesuffix("_t1")
        self.module, self.acts, self.outs = _graph_module(unit)
        example = _example(self.acts)
        t0 = time.perf_counter()
        if path.startswith("inductor"):
            # Traced once with make_fx (weights as constants of the FX graph, no Dynamo guards
            # per call) and compiled by Inductor with freezing: conv/linear weights prepacked.
            import torch._inductor.config as ic
            from torch.fx.experimental.proxy_tensor import make_fx

            module = self.module
            with ic.patch(freezing=True, cpp_wrapper=path == "inductor_cpp"), torch.no_grad():
                gm = make_fx(lambda *xs: list(module(*xs)))(*example)
                self.fn = torch._inductor.compile(gm, list(example))
                self.fn(*example)
            self.load_s = math.nan
        elif path == "aoti":
            import torch._inductor.config as ic

            with torch.no_grad():  # freezing needs grad off: weights prepacked for oneDNN in the .so
                ep = torch.export.export(self.module, example)
                self.package = str(Path(workdir) / f"{unit.name}-{os.getpid()}.pt2")
                torch._inductor.aoti_compile_and_package(ep, package_path=self.package,
                                                         inductor_configs={"freezing": True})
            t1 = time.perf_counter()
            self.fn = torch._inductor.aoti_load_package(self.package)
            self.load_s = time.perf_counter() - t1
        else:
            raise ValueError(path)
        self.compile_s = time.perf_counter() - t0

    def bind_constants(self, values: Any) -> bool:
        return True

    def execute(self, pack: Any) -> dict[str, Any]:
        import torch

        xs = [_torch_value(t, pack[t.name]) for t in self.acts]
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                r = self.fn(*xs)
        finally:
            if self.threads:
                torch.set_num_threads(before)
        return {n: v.numpy() for n, v in zip(self.outs, r, strict=True)}


# ---- one model, in its own process -----------------------------------------------------------
def _units(sess: Any) -> list[Any]:
    from fusegraph.onnx.units import FusegraphUnit

    (plan,) = sess._plans.values()
    return [u for u in plan.units if isinstance(u, FusegraphUnit)]


def _swapped(sess: Any, plans: dict[str, Any]) -> Callable[[Any, Any], Any]:
    """sess.run with each fusegraph unit's plan replaced by ``plans[unit.name]``."""
    units = _units(sess)
    own = {u.name: (u.plan, u._kept, u._relayouts) for u in units}

    def run(names: Any, feed: Any) -> Any:
        for u in units:
            u.plan, u._kept, u._relayouts = plans[u.name], True, False
        try:
            return sess.run(names, feed)
        finally:
            for u in units:
                u.plan, u._kept, u._relayouts = own[u.name]

    return run


def _knob_plans(units: list[Any], knobs: dict[str, Any], feed: Any, sess: Any) -> dict[str, Any]:
    """Each unit's plan built anew with ``knobs`` over the unit's own, weights bound, and run
    once inside the session (where the compiled path settles)."""
    from fusegraph.engines.base import EngineConfig

    plans = {}
    for u in units:
        own = dict(u.plan.config.knobs)
        own.update({k: v for k, v in knobs.items() if k != "onednn_graph" or "onednn_graph" in own or v})
        plan = u.graph.build(u.handle, config=EngineConfig("torch", tuple(own.items())))
        plan.bind_constants(u.weights)
        plans[u.name] = plan
    _swapped(sess, plans)(None, feed)
    return plans


def _rel(got: Any, want: Any) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if g.shape != w.shape:
        return math.inf
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def bench_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort
    from bench_models import BY_NAME, export_dir, exported
    from bench_onnx import PAUSE_S, OrtWorker, _OthersCpu, _time, _warm

    import fusegraph.onnx as fgo

    ort.set_default_logger_severity(3)
    path, _, feed = exported(BY_NAME[name], export_dir(args), args.seed)
    paths = [p for p in args.paths.split(",") if p]
    row: dict[str, Any] = {"model": name, "paths": {}}
    worker = OrtWorker()
    try:
        want, ort_setup_s, _ = worker.load(str(path), feed)
        one_thread = any(p.endswith("_t1") for p in paths)
        if one_thread:
            worker.add_one_thread()
        row["ort_setup_s"] = ort_setup_s
        runs: dict[str, Callable[[Any, Any], Any]] = {}
        with tempfile.TemporaryDirectory(prefix="fusegraph-cpu-paths-") as tmp:
            os.environ["FUSEGRAPH_CACHE_DIR"] = str(Path(tmp) / "fg")  # AOTInductor packages: cold
            os.environ["FUSEGRAPH_TORCH_CPU_COMPILE"] = "off"  # the session's own plans: eager (swapped below)
            t0 = time.perf_counter()
            sess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {
                "engine": "torch", "floor": "off", "cache_dir": str(Path(tmp) / "fg")})])
            sess.run(None, feed)
            row["fusegraph_setup_s"] = time.perf_counter() - t0
            units = _units(sess)
            report = sess.partition_report()
            row["coverage"] = report.coverage
            row["units"] = len(report.subgraphs)
            row["fusegraph_units"] = len(units)
            for p in paths:
                info: dict[str, Any] = {}
                row["paths"][p] = info
                try:
                    if p in ("onednn_graph", "eager", "chain"):
                        knobs = {"onednn_graph": {"onednn_graph": True, "cpu_compile": "off"},
                                 "eager": {"onednn_graph": False, "cpu_compile": "off"},
                                 "chain": {"onednn_graph": False, "cpu_compile": "auto"}}[p]
                        t0 = time.perf_counter()
                        plans = _knob_plans(units, knobs, feed, sess)
                        info["compile_s"] = time.perf_counter() - t0
                        if p == "chain":
                            t0 = time.perf_counter()
                            _knob_plans(units, knobs, feed, sess)  # again: packages from the cache
                            info["warm_s"] = time.perf_counter() - t0
                        info["cpu_path"] = [pl.describe().get("cpu_path") for pl in plans.values()]
                        info["attempts"] = [pl.describe().get("cpu_path_attempts") for pl in plans.values()]
                        runs[p] = _swapped(sess, plans)
                    elif p == "iree":
                        t0 = time.perf_counter()
                        isess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {
                            "engine": "iree", "floor": "off", "cache_dir": str(Path(tmp) / "iree")})])
                        isess.run(None, feed)
                        info["compile_s"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        isess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {
                            "engine": "iree", "floor": "off", "cache_dir": str(Path(tmp) / "iree")})])
                        isess.run(None, feed)
                        info["warm_s"] = time.perf_counter() - t0
                        runs[p] = isess.run
                    else:
                        plans = {u.name: Compiled(u, p, tmp) for u in units}
                        info["compile_s"] = sum(c.compile_s for c in plans.values())
                        if p.startswith("aoti"):
                            info["warm_s"] = sum(c.load_s for c in plans.values())
                        elif args.warm_inductor:
                            info["warm_s"] = _warm_compile(name, p, args)
                        runs[p] = _swapped(sess, plans)
                    info["rel_err"] = _rel(runs[p](None, feed)[0], want[0])
                except Exception as exc:  # a path that refuses the graph is a row, not a crash
                    info["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                    runs.pop(p, None)
            ort_blocks = {"ort": "default", "ort_nospin": "no-spin", **({"ort_1t": "one-thread"} if one_thread else {})}
            times: dict[str, list[list[float]]] = {p: [] for p in [*runs, *ort_blocks]}
            with _OthersCpu(worker) as others:
                for _ in range(args.rounds):
                    for p, fn in runs.items():
                        time.sleep(PAUSE_S)
                        _warm(fn, feed, 2)
                        block: list[float] = []
                        for _ in range(args.repeat):
                            _time(fn, feed, block)
                        times[p].append(block)
                    for key, which in ort_blocks.items():
                        time.sleep(PAUSE_S)
                        times[key].append(worker.time(which, 2, args.repeat))
        row["others_cpu"] = others.share
        row["loadavg"] = Path("/proc/loadavg").read_text().split()[0]
        med = {p: statistics.median([t for b in bl for t in b]) * 1e3 for p, bl in times.items()}
        best = {p: min(statistics.median(b) for b in bl) * 1e3 for p, bl in times.items()}
        ort_med, ort_best = min(med["ort"], med["ort_nospin"]), min(best["ort"], best["ort_nospin"])
        row["ort_ms"], row["ort_default_ms"], row["ort_best_block_ms"] = ort_med, med["ort"], ort_best
        if one_thread:
            row["ort_1t_ms"], row["ort_1t_best_block_ms"] = med["ort_1t"], best["ort_1t"]
        for p in runs:
            row["paths"][p].update({"ms": med[p], "vs_ort": med[p] / ort_med, "best_ms": best[p],
                                    "best_vs_ort": best[p] / ort_best})
            if p.endswith("_t1"):
                row["paths"][p]["vs_ort_1t"] = med[p] / med["ort_1t"]
    finally:
        worker.close()
    return row


def _warm_compile(name: str, path: str, args: argparse.Namespace) -> float:
    """The compile time in a fresh process, with the Inductor cache the cold compile left."""
    cmd = [sys.executable, __file__, "--compile-only", name, "--paths", path, "--seed", str(args.seed)]
    if args.export_dir:
        cmd += ["--export-dir", args.export_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
    for line in proc.stdout.splitlines():
        if line.startswith("compile_s "):
            return float(line.split()[1])
    return math.nan


def compile_only(name: str, args: argparse.Namespace) -> None:
    from bench_models import BY_NAME, export_dir, exported

    import fusegraph.onnx as fgo

    path, _, _ = exported(BY_NAME[name], export_dir(args), args.seed)
    with tempfile.TemporaryDirectory(prefix="fusegraph-cpu-paths-") as tmp:
        sess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {
            "engine": "torch", "floor": "off", "cache_dir": str(Path(tmp) / "fg")})])
        total = sum(Compiled(u, args.paths, tmp).compile_s for u in _units(sess))
    print(f"compile_s {total}")


# ---- the driver ------------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(rows: list[dict[str, Any]], paths: list[str]) -> None:
    head = ["model", "ORT ms (1 thread)", *[f"{p} / ORT (best block)" for p in paths], "setup s: ORT / fusegraph",
            *[f"{p} compile s cold / warm" for p in paths if p not in ("onednn_graph", "eager")], "load"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['error']} |")
            continue
        cells = [r["model"], f"{_fmt(r['ort_ms'])} ({_fmt(r.get('ort_1t_ms'))})"]
        for p in paths:
            i = r["paths"].get(p, {})
            cell = i["error"][:60] if "error" in i else f"{_fmt(i.get('vs_ort'))}x ({_fmt(i.get('best_vs_ort'))}x)"
            if "vs_ort_1t" in i:
                cell += f" [1t: {_fmt(i['vs_ort_1t'])}x]"
            cells.append(cell)
        cells.append(f"{_fmt(r['ort_setup_s'])} / {_fmt(r['fusegraph_setup_s'], '.1f')}")
        for p in paths:
            if p in ("onednn_graph", "eager"):
                continue
            i = r["paths"].get(p, {})
            cells.append(f"{_fmt(i.get('compile_s'), '.1f')} / {_fmt(i.get('warm_s'))}")
        cells.append(f"{r.get('loadavg', '-')} ({_fmt(100 * r.get('others_cpu', math.nan), '.0f')}%)")
        print("| " + " | ".join(cells) + " |")
    for p in paths:
        vals = [r["paths"][p]["vs_ort"] for r in rows if "error" not in r and "vs_ort" in r["paths"].get(p, {})]
        best = [r["paths"][p]["best_vs_ort"] for r in rows if "error" not in r and "best_vs_ort" in r["paths"].get(p, {})]
        if vals:
            g = math.exp(statistics.fmean(math.log(v) for v in vals))
            gb = math.exp(statistics.fmean(math.log(v) for v in best))
            one = [r["paths"][p]["vs_ort_1t"] for r in rows if "error" not in r and "vs_ort_1t" in r["paths"].get(p, {})]
            g1 = f"; {math.exp(statistics.fmean(math.log(v) for v in one)):.2f}x vs ORT 1 thread" if one else ""
            print(f"geomean {p}: {g:.2f}x ({gb:.2f}x best block{g1}) over {len(vals)} models")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--paths", default=DEFAULT_PATHS, help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-dir")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--warm-inductor", action="store_true",
                    help="also time an Inductor path's compile in a fresh process with the cache the first left")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_only:
        compile_only(args.compile_only, args)
        return 0
    if args.one:
        row = bench_one(args.one, args)
        Path(args.row_out).write_text(json.dumps(row))
        return 0
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="fusegraph-inductor-") as ind, \
                tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": ind}  # cold: an empty Inductor cache per model
            cmd = [sys.executable, __file__, "--one", name, "--row-out", f.name, "--paths", args.paths,
                   "--rounds", str(args.rounds), "--repeat", str(args.repeat), "--seed", str(args.seed),
                   "--timeout", str(args.timeout)]
            if args.export_dir:
                cmd += ["--export-dir", args.export_dir]
            if args.warm_inductor:
                cmd.append("--warm-inductor")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                text = Path(f.name).read_text()
                row = json.loads(text) if proc.returncode == 0 and text else {
                    "model": name, "error": f"exit {proc.returncode}: "
                    + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])}
            except subprocess.TimeoutExpired:
                row = {"model": name, "error": f"timed out after {args.timeout:.0f} s"}
            Path(f.name).unlink(missing_ok=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows, args.paths.split(","))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

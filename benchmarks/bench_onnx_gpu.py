"""Real ONNX models on the GPU (issue 24 item 8): fusegraph's execution provider, each claimed
unit run region by region (fusegraph/onnx/plan_regions.py; ``regions=auto`` is on for a GPU),
against the same PyTorch module on the same GPU -- eager and ``torch.compile`` (default
mode) -- side by side in one process, timed interleaved by fusegraph's one timing routine
(select/timing.py: warm-up to a steady state, rotating rounds, medians).

Each model is built with random weights (torchvision / transformers configurations, no
downloads; ``unet`` is a diffusion-style UNet: the corpus is onnx_gpu_models.py), exported
with ``torch.onnx.export`` (opset 17) and opened with
``InferenceSession(path, providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
provider_options=[{"device": "cuda:0"}, {}])``, NumPy in and out, as a new user would;
PyTorch gets CUDA tensors in and out with ``cudnn.benchmark`` on. Reported per model and
batch: agreement with eager (relative), session setup and compile times, medians, the
ratios eager / fusegraph and compile / fusegraph, and the partition report's summary
(which regions ran on which engine). ``--variants`` adds ``fusegraph-whole`` (regions off:
the unit on one engine, as before regions) to see what the region path changed, and
``fusegraph-cuda``: the same session through ``io_binding`` with CUDA tensors in and out
(issue 24 item 5: no host copies, as the PyTorch side is timed).

Setup (``setup_s``, issue 24 items 6 and 8): each fusegraph session's open + first run; then
``-ready``, until ``wait_for_evaluation()`` returned (regions without a stored verdict built
and measured in the background, the upgraded plan in place: full speed; the steady state is
timed after it, and the agreement is the upgraded plan's). ``--warm-setup`` opens the model
again in this process (``fusegraph-warm``: caches and imported libraries hot) and in a new
Python process (``fusegraph-warm-process``: same interpreter, environment and cache
directory, as a restarted server meets it; its imports and CUDA context creation are timed
apart, in ``warm_process``). Printed as
``fusegraph setup 4.1 s (ready 9.0 s; warm 0.9 s, new process 2.8 s)``.

    python benchmarks/bench_onnx_gpu.py --json onnx_gpu.json --png onnx_gpu.png
    python benchmarks/bench_onnx_gpu.py --models resnet50,vit_b_16,bert --batch 1,8
    python benchmarks/bench_onnx_gpu.py --models bert --options autotune=30   # regions tuned across engines
    python benchmarks/bench_onnx_gpu.py --precision fp16 --variants fusegraph,fusegraph-cuda,eager,compile
    python benchmarks/bench_onnx_gpu.py --quick            # CPU smoke (built-in models, regions=on)

Precision (``--precision``, issue 24 item 4): fp32 as exported; fp16 / bf16 give fusegraph the
provider option ``precision`` and run the PyTorch module and its float inputs converted
(``.half()`` / ``.bfloat16()``); tf32 gives fusegraph ``precision=tf32`` and runs PyTorch with
``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32`` on; at fp32 both are off
(PyTorch's default rounds convolutions to TF32: not the same precision). Agreement is always
against the float32 eager module; the row also keeps the precision line of fusegraph's
report (regions in the reduced type, those kept float32, the accuracy it measured).
Targets (issue 24, H200): every model >= 1.0x eager; geomean >= 1.3x eager and >= 1.0x
compile; attention-heavy models >= 1.2x eager; fp32 agreement <= 1e-3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fusegraph
import fusegraph.onnx as fgo
from fusegraph.runtime.cache_dir import CACHE_DIR_ENV, cache_root
from fusegraph.select.timing import time_candidates

sys.path.insert(0, str(Path(__file__).parent))
from onnx_gpu_models import (  # noqa: F401  (the corpus; its names stay importable from here)
    ATTENTION,
    DEFAULT,
    MODELS,
    Block,
    Case,
    HFOut,
    UNet,
    _no_zero_parameters,
    export,
)

VARIANTS = ("fusegraph", "eager", "compile", "fusegraph-whole", "fusegraph-cuda")
PRECISIONS = ("fp32", "fp16", "bf16", "tf32")
TORCH_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# setup_s's fusegraph columns: open + first run; "-ready": until wait_for_evaluation returned;
# "-warm": a second session in this process; "-warm-process": one in a new process
SETUP_COLUMNS = tuple(f"{v}{s}" for v in ("fusegraph", "fusegraph-cuda", "fusegraph-whole", "fusegraph-warm",
                                          "fusegraph-warm-process") for s in ("", "-ready"))


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    if not np.linalg.norm(want):  # an all-zero reference agrees with anything near zero: no check
        return float("nan")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def profile(call: Callable[[], object], device: torch.device, top: int, runs: int = 5) -> list[dict[str, Any]]:
    """The ``top`` device kernels (or host ops on the CPU) of ``runs`` warm calls by total
    time, per call: where a variant's time goes, without a separate profiling session."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    call()
    with torch_profile(activities=acts) as prof:
        for _ in range(runs):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    on_device = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        us = (e.device_time_total if on_device else e.self_cpu_time_total) / runs
        if us > 0:
            rows.append({"name": e.key[:120], "us_per_call": round(us, 1), "calls": e.count // runs})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows[:top]


def bench(name: str, batch: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    family, make = MODELS[name]
    torch.manual_seed(args.seed)
    module, inputs, names = make(batch)
    _no_zero_parameters(module)
    module = module.eval()
    path = workdir / f"{name}_b{batch}.onnx"
    with torch.no_grad():
        export(module, inputs, names, path)
    module = module.to(device)
    dev_inputs = tuple(x.to(device) for x in inputs)
    feed = {n: x.numpy() for n, x in zip(names, inputs, strict=True)}
    row: dict[str, Any] = {"model": name, "family": family, "batch": batch, "setup_s": {}, "rel_err": {}}
    with torch.inference_mode():
        want = module(*dev_inputs).float().cpu().numpy()  # float32: every variant's agreement is against it
    low = TORCH_TYPES.get(args.precision)
    if low is not None:  # the PyTorch side at the same precision
        module = module.to(low)
        dev_inputs = tuple(x.to(low) if x.is_floating_point() else x for x in dev_inputs)
    calls: dict[str, Callable[[], object]] = {}
    sessions: dict[str, Any] = {}
    opened: dict[str, dict[str, Any]] = {}  # the provider options each session was opened with
    for variant in args.variants:
        t0 = time.perf_counter()
        if variant == "fusegraph-whole" and args.precision in TORCH_TYPES:
            row["rel_err"][variant] = float("nan")
            row[f"{variant}_report"] = f"skipped: precision={args.precision} needs the region path"
            continue
        if variant.startswith("fusegraph"):
            whole = variant == "fusegraph-whole"
            opts = {"device": args.device, **args.options, **({"regions": "off"} if whole else {})}
            if args.precision != "fp32":
                opts["precision"] = args.precision
            if device.type == "cpu":  # the smoke run: the region path on the CPU, torch pinned, no runners
                opts |= {"regions": "off" if whole else "on", "engine": "torch", "runners": "off",
                         "floor_mode": "inline", **args.options}  # --options still win
            key = "whole" if whole else "regions"
            sess = sessions.get(key)
            opened[key] = opts
            if sess is None:
                sess = _open(path, opts)
                sessions[key] = sess
            if variant == "fusegraph-cuda":  # io_binding: CUDA tensors in, the output allocated on the device
                binding = sess.io_binding()
                for n, x in zip(names, inputs, strict=True):
                    binding.bind_input(n, x.to(device) if device.type == "cuda" else x.numpy())
                binding.bind_output("out", "cuda" if device.type == "cuda" else "cpu")

                def first(sess: Any = sess, b: Any = binding) -> Any:
                    sess.run_with_iobinding(b)
                    return b.copy_outputs_to_cpu()[0]

                calls[variant] = lambda sess=sess, b=binding: sess.run_with_iobinding(b)  # type: ignore[misc]
            else:
                def first(sess: Any = sess, b: Any = None) -> Any:
                    return sess.run(None, feed)[0]

                calls[variant] = lambda sess=sess: sess.run(None, feed)  # type: ignore[misc]
            got = first()
            row["setup_s"][variant] = time.perf_counter() - t0
            if _wait_ready(row, variant, sess, t0, args.ready_timeout):  # the plan timed below: its agreement
                row["rel_err"][f"{variant}-first"] = _rel(got, want)  # the first run's plan, since replaced
                got = first()
            row["rel_err"][variant] = _rel(got, want)
            if variant != "fusegraph-cuda" or "fusegraph" not in args.variants:  # the report of the plan timed
                _report(row, "fusegraph" if variant == "fusegraph-cuda" else variant, sess, args.verbose)
            continue
        fn: Any = module if variant == "eager" else torch.compile(module)
        with torch.inference_mode():
            got_t = fn(*dev_inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        row["setup_s"][variant] = time.perf_counter() - t0
        row["rel_err"][variant] = _rel(got_t.float().cpu().numpy(), want)

        def call(fn: Any = fn) -> object:
            with torch.inference_mode():
                return fn(*dev_inputs)

        calls[variant] = call
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    timings = time_candidates(calls, sync=sync, warmup_s=args.warmup_s, min_rounds=args.rounds)
    row["ms"] = {k: t.median_ms for k, t in timings.items()}
    if args.warm_setup and "regions" in opened:
        # a second session of the same model in this process: plans, verdicts and cuDNN plans in
        # the cache, and Inductor, Triton and cuDNN already imported and initialised
        t0 = time.perf_counter()
        again = _open(path, opened["regions"])
        again.run(None, feed)
        row["setup_s"]["fusegraph-warm"] = time.perf_counter() - t0
        _wait_ready(row, "fusegraph-warm", again, t0, args.ready_timeout)
        del again
        # ... and in a new process, as a restarted server meets it
        feed_path = path.with_suffix(".npz")
        feed_any: dict[str, Any] = dict(feed)
        np.savez(feed_path, **feed_any)
        _warm_process(row, path, feed_path, opened["regions"], want, args)
    if args.profile:
        row["profile"] = {k: profile(call, device, args.profile) for k, call in calls.items()}
    fg = row["ms"].get("fusegraph")
    for base in ("eager", "compile"):
        if fg and base in row["ms"]:
            row[f"{base}_over_fusegraph"] = row["ms"][base] / fg
        fgc = row["ms"].get("fusegraph-cuda")
        if fgc and base in row["ms"]:  # CUDA tensors in and out on both sides
            row[f"{base}_over_fusegraph_cuda"] = row["ms"][base] / fgc
    return row


def _open(path: Path, opts: dict[str, Any]) -> Any:
    return fgo.InferenceSession(str(path), providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                provider_options=[opts, {}])


def _wait_ready(row: dict[str, Any], variant: str, sess: Any, t0: float, timeout: float) -> bool:
    """``setup_s[variant + "-ready"]``: from ``t0`` (the open) until the session's background
    evaluation is over and its upgraded plan in place (``wait_for_evaluation``) -- when the
    session is at full speed. Where nothing was pending that is the first run's end. True
    where something was pending (the first run's plan may have been replaced)."""
    pending = not sess.wait_for_evaluation(timeout=0)
    row[f"{variant}_pending"] = pending
    if not pending or sess.wait_for_evaluation(timeout=timeout):
        row["setup_s"][f"{variant}-ready"] = time.perf_counter() - t0
    else:
        row[f"{variant}_ready_error"] = f"still evaluating after {timeout:g} s (the plan in place then is timed)"
    return pending


# A new Python process (issue 24 item 6: what a restarted server meets): imports timed apart
# from the setup (numpy, onnx, torch where installed -- fusegraph's engines import it at the
# open otherwise -- and fusegraph.onnx) and, on a GPU, CUDA's context creation (any GPU
# framework pays it); then the open, the first run and the wait for the upgraded plan, as the
# parent times them. Arguments: model, feed (.npz), output (.npy), options (JSON), device,
# timeout of the wait, CHILD_TAG. One line on stdout starts with the tag: the numbers, as JSON.
CHILD_TAG = "bench_onnx_gpu child:"
CHILD = """
import importlib, json, sys, time
imports = {}
def timed(name):
    t = time.perf_counter()
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return None
    imports[name] = time.perf_counter() - t
    return mod
np = timed("numpy")
timed("onnx")
torch = timed("torch")
fgo = timed("fusegraph.onnx")
model, feed_path, out_path, opts, device, timeout, tag = sys.argv[1:8]
cuda_init = None
if torch is not None and device.startswith("cuda"):
    t = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    cuda_init = time.perf_counter() - t
feed = dict(np.load(feed_path))
t0 = time.perf_counter()
sess = fgo.InferenceSession(model, providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                            provider_options=[json.loads(opts), {}])
opened = time.perf_counter() - t0
got = sess.run(None, feed)[0]
setup = time.perf_counter() - t0
pending = not sess.wait_for_evaluation(timeout=0)
ready = None
if not pending or sess.wait_for_evaluation(timeout=float(timeout)):
    ready = time.perf_counter() - t0
if pending:
    got = sess.run(None, feed)[0]
np.save(out_path, got)
print(tag + " " + json.dumps({"imports_s": imports, "cuda_init_s": cuda_init, "open_s": opened, "setup_s": setup,
                          "ready_s": ready, "pending": pending}), flush=True)
"""


def _warm_process(row: dict[str, Any], path: Path, feed_path: Path, opts: dict[str, Any], want: np.ndarray,
                  args: argparse.Namespace) -> None:
    """``setup_s["fusegraph-warm-process"]`` (open + first run in a fresh interpreter, same
    environment and cache directory) and its ``-ready``; ``warm_process`` keeps the child's
    import and CUDA-init seconds. A failing child leaves ``warm_process_error`` saying why."""
    out_path = path.with_name(path.stem + "_warm_process_out.npy")
    env = dict(os.environ)
    env[CACHE_DIR_ENV] = str(cache_root())  # the cache the parent's sessions used, explicitly
    # the fusegraph this process imported, whatever the interpreter's install points at
    root = str(Path(fusegraph.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-c", CHILD, str(path), str(feed_path), str(out_path),
            json.dumps(opts), args.device, str(args.ready_timeout), CHILD_TAG]
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.process_timeout)
    except subprocess.TimeoutExpired:
        row["warm_process_error"] = f"the new process ran past --process-timeout {args.process_timeout:g} s"
        return
    except OSError as exc:
        row["warm_process_error"] = f"the new process did not start: {exc}"
        return
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_TAG)]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        row["warm_process_error"] = f"the new process exited {proc.returncode}: {tail[:300]}"
        return
    try:
        got = json.loads(lines[-1][len(CHILD_TAG):])
        out = np.load(out_path)
    except (ValueError, OSError) as exc:
        row["warm_process_error"] = f"the new process's result could not be read: {exc}"
        return
    row["warm_process"] = got
    row["setup_s"]["fusegraph-warm-process"] = got["setup_s"]
    if got["ready_s"] is None:
        row["warm_process_error"] = f"the new process was still evaluating after {args.ready_timeout:g} s"
    else:
        row["setup_s"]["fusegraph-warm-process-ready"] = got["ready_s"]
    row["rel_err"]["fusegraph-warm-process"] = _rel(out, want)


def _report(row: dict[str, Any], variant: str, sess: Any, verbose: bool) -> None:
    report = sess.partition_report()
    row[f"{variant}_precision"] = [s.floor[s.floor.index("precision "):] for s in report.subgraphs
                                   if "precision " in s.floor]
    row[f"{variant}_report"] = report.summary()
    row[f"{variant}_regions"] = [
        {"pattern": r.pattern, "where": r.where, "source": r.source, "fusegraph_ms": r.fusegraph_ms,
         "incumbent_ms": r.incumbent_ms, "nodes": len(r.nodes)}
        for s in report.subgraphs for r in s.regions
    ]
    if verbose:
        print(report, file=sys.stderr)


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def chart(rows: list[dict[str, Any]], path: str, device: str, precision: str = "fp32") -> None:
    """The ratios per row and, beside them, fusegraph's setup seconds (log scale): open + first
    run, until full speed, warm in this process, warm in a new process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} b{r['batch']}" for r in rows]
    setups = [(label, [_setup_value(r, col) for r in rows]) for label, col in
              (("first run", ""), ("ready", "-ready"), ("warm", "warm"), ("new process", "warm-process"))]
    setups = [(label, vals) for label, vals in setups if any(v > 0 for v in vals)]
    width = max(6.0, 0.5 * len(rows) + 2)
    fig, axes = plt.subplots(1, 2 if setups else 1, figsize=(2 * width if setups else width, 4), squeeze=False)
    ax = axes[0][0]
    xs = np.arange(len(rows))
    for k, base in enumerate(("eager", "compile")):
        vals = [r.get(f"{base}_over_fusegraph", 0.0) for r in rows]
        ax.bar(xs + (k - 0.5) * 0.4, vals, 0.4, label=f"{base} / fusegraph")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, labels, rotation=60, ha="right")
    ax.set_ylabel("speed-up of fusegraph (x)")
    ax.set_title(f"ONNX models on {device}, {precision}")
    ax.legend()
    if setups:
        ax = axes[0][1]
        w = 0.8 / len(setups)
        for k, (label, vals) in enumerate(setups):
            ax.bar(xs + (k - (len(setups) - 1) / 2) * w, vals, w, label=label)
        ax.set_yscale("log")
        ax.set_xticks(xs, labels, rotation=60, ha="right")
        ax.set_ylabel("fusegraph setup (s)")
        ax.set_title("setup: open + first run, until full speed, warm")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _setup_value(row: dict[str, Any], col: str) -> float:
    """A row's setup seconds for the chart (0: not measured): ``col`` "" / "-ready" of the
    reported variant, "warm" / "warm-process" of the warm sessions."""
    key = _setup_column(row)
    if key is None:
        return 0.0
    name = key + col if col in ("", "-ready") else f"fusegraph-{col}"
    return float(row["setup_s"].get(name, 0.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated, among {list(MODELS)} (default: all but convnet, block)")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--variants", help=f"comma-separated, among {list(VARIANTS)} (default: fusegraph,eager,compile; "
                                       "--quick: fusegraph,eager,fusegraph-whole)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="fp32 as exported; fp16 / bf16 / tf32 for fusegraph (provider option) and PyTorch alike")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (medians)")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--options", default="", help="extra provider options for fusegraph, k=v,k=v (autotune=30, floor=off)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--png", help="a chart of the ratios (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke: convnet and block (unless --models), batch 1, few rounds; --options override its "
                        "provider options")
    p.add_argument("--verbose", action="store_true", help="print each partition report (stderr)")
    p.add_argument("--warm-setup", action="store_true",
                   help="also open each model a second time, its plans and verdicts cached (setup + first run), "
                        "in this process and in a new one")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="longest wait for a session's background evaluation (wait_for_evaluation)")
    p.add_argument("--process-timeout", type=float, default=1200.0, metavar="S",
                   help="--warm-setup: longest run of the new process (imports, open, first run, wait)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, the N costliest device kernels of each variant per call (torch.profiler; "
                        "in the JSON and printed)")
    args = p.parse_args(argv)
    if args.quick:
        args.models = args.models or "convnet,block"
        args.batch, args.device, args.rounds, args.warmup_s = "1", "cpu", 3, 0.05
        args.variants = args.variants or "fusegraph,eager,fusegraph-whole"
    args.models = args.models or ",".join(DEFAULT)
    args.variants = args.variants or "fusegraph,eager,compile"
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        args.options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv.strip())
    except ValueError:
        p.error(f"--options {args.options!r}: expected k=v,k=v")
    bad = [v for v in args.variants if v not in VARIANTS] + [m for m in args.models.split(",") if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) or variant(s) {bad}")
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: no CUDA device here (use --quick for the CPU smoke run)")
        torch.backends.cudnn.benchmark = True
        # The same precision on both sides: at fp32 PyTorch's convolutions lose their default
        # TF32 rounding (fusegraph's float32 is float32); tf32 is PyTorch's default and more
        # (matmuls too), set while fusegraph's units run by its own option.
        torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if torch.device(args.device).type == "cuda" else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-onnx-gpu-") as tmp:
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                try:
                    row = bench(name, batch, args, Path(tmp))
                except Exception as exc:  # one model failing does not end the run: its row says why
                    row = {"model": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                _print(row)
    summary = {f"geomean_{b}_over_{key}": _geomean([r[f"{b}_over_{key}"] for r in rows if f"{b}_over_{key}" in r])
               for key in ("fusegraph", "fusegraph_cuda") for b in ("eager", "compile")
               if any(f"{b}_over_{key}" in r for r in rows)}
    print(f"{gpu}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    setup = {c: _geomean([r["setup_s"][c] for r in rows if c in r.get("setup_s", {})]) for c in SETUP_COLUMNS
             if any(c in r.get("setup_s", {}) for r in rows)}
    if setup:
        print("setup, geomean over rows: " + ", ".join(f"{k} {v:.2f} s" for k, v in setup.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": gpu, "torch": torch.__version__, "precision": args.precision,
                                               "rows": rows, **summary, "geomean_setup_s": setup},
                                              indent=1, default=str))
    if args.png:
        try:
            chart([r for r in rows if "ms" in r], args.png, gpu, args.precision)
        except ImportError:
            print("no matplotlib: no chart", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


def _setup_column(row: dict[str, Any]) -> str | None:
    """The variant whose setup the row reports: the NumPy session, else the io_binding one."""
    return next((k for k in ("fusegraph", "fusegraph-cuda") if k in row["setup_s"]), None)


def _setup_text(row: dict[str, Any]) -> str:
    """``  fusegraph setup 4.1 s (ready 9.0 s; warm 0.9 s, new process 2.8 s)``: open + first
    run, then until full speed (the background evaluation over), then with the caches warm."""
    s, key = row["setup_s"], _setup_column(row)
    if key is None:
        return ""

    def with_ready(name: str, label: str) -> str:
        ready = s.get(f"{name}-ready")
        late = ready is not None and row.get(f"{name}_pending")
        return f"{label} {s[name]:.1f} s" + (f" [ready {ready:.1f} s]" if late else "")

    ready = f"ready {s[key + '-ready']:.1f} s" if f"{key}-ready" in s else "ready: not yet"
    warm = []
    if "fusegraph-warm" in s:
        warm.append(with_ready("fusegraph-warm", "warm"))
    if "fusegraph-warm-process" in s:
        warm.append(with_ready("fusegraph-warm-process", "new process"))
    if "warm_process_error" in row:
        warm.append(f"new process: {row['warm_process_error'][:160]}")
    return f"  fusegraph setup {s[key]:.1f} s ({'; '.join([ready, ', '.join(warm)] if warm else [ready])})"


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['model']:<20} b{row['batch']:<3} ERROR {row['error']}")
        return
    ms = "  ".join(f"{k} {v:8.3f} ms" for k, v in row["ms"].items())
    ratio = "  ".join(f"{b}/{k} {row[f'{b}_over_{key}']:.2f}x" for b in ("eager", "compile")
                      for k, key in (("fg", "fusegraph"), ("fg-cuda", "fusegraph_cuda")) if f"{b}_over_{key}" in row)
    err = max((v for v in row["rel_err"].values() if not math.isnan(v)), default=float("nan"))
    print(f"{row['model']:<20} b{row['batch']:<3} {ms}  {ratio}  max rel err {err:.1e}{_setup_text(row)}")
    child = row.get("warm_process")
    if child:
        imports = ", ".join(f"{k} {v:.1f}" for k, v in child["imports_s"].items())
        cuda = f", CUDA init {child['cuda_init_s']:.1f} s" if child.get("cuda_init_s") is not None else ""
        print(f"    new process: imports {sum(child['imports_s'].values()):.1f} s ({imports}){cuda}, not setup; "
              f"open {child['open_s']:.1f} s + first run {child['setup_s'] - child['open_s']:.1f} s")
    if "fusegraph_report" in row:
        print(f"    {row['fusegraph_report']}")
    for line in dict.fromkeys(row.get("fusegraph_precision", [])):
        print(f"    {line}")
    for variant, kernels in row.get("profile", {}).items():
        total = sum(k["us_per_call"] for k in kernels)
        print(f"    {variant}: top {len(kernels)} kernels, {total:.0f} us a call")
        for k in kernels:
            print(f"      {k['us_per_call']:9.1f} us  x{k['calls']:<4} {k['name']}")


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's device time goes, by kernel class, under eager and Inductor (and
the backend on request): the ceiling on what fusing, tuning or replacing any class of kernels
can gain over ``torch.compile``.

Issue 23 asks fusegraph's backend to train >= 1.05x faster than Inductor. Every region the
region floor measured on an H200 lost or tied (docs/torch.md), and the step is a mix of
kernels both sides run through the same vendor library (cuBLAS GEMMs, cuDNN convolutions
and attention) and kernels Inductor writes itself (Triton: the fused pointwise, norm and
reduction work). Only the second kind is fusegraph's to win, so its share of Inductor's
step bounds the gain any fused kernel can bring: this script measures that share.

    python benchmarks/profile_step.py --models gpt2,llama              # GPU: bf16 training
    python benchmarks/profile_step.py --models gpt2 --variants eager,inductor,fusegraph --json out.json
    python benchmarks/profile_step.py --device cpu --size tiny --models gpt2   # CPU: op self times

Per variant (compiled, ``--warm-steps`` steps, then ``--steps`` steps timed with the device
synchronized at each, median; then ``--steps`` steps under ``torch.profiler``): the step's
wall time, its kernels' summed time and their union (the device busy), each class's time.
On a GPU the classes come from the kernel names (``classify``); on the CPU from each
operator's self time, the compiled code's own time as ``fused``. The ceiling lines, from
Inductor's breakdown: with the vendor classes as they are, how much faster every other
kernel must get for the whole step to reach 1.05x, and the step if those took no time.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_torch as bt
import torch_models as tm

# kernel classes, matched in this order on the kernel's (or CPU operator's) name, lower case
CLASSES: tuple[tuple[str, str], ...] = (
    ("gemm", r"^triton_tem"),  # Inductor's matmul templates (max-autotune)
    ("fused", r"^triton|^fg_|compiledfunction|torch-compiled region|call compiledfxgraph|cpp_fused"),
    ("attention", r"fmha|flash|sdpa|attention|\bmha"),
    ("conv", r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_gemm|implicit_convolve"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|xmma|matmul|splitkreduce|aten::mm\b|aten::addmm|aten::bmm"
             r"|aten::baddbmm|mkldnn_linear|aten::linear"),
    ("optimizer", r"multi_tensor_apply|foreach|fused_adam|fused_sgd|optim"),
    ("norm", r"batch_norm|layer_norm|group_norm|rms_norm|bn_fw|bn_bw|welford|cudnn::bn|gammabeta|moments"),
    ("reduction", r"reduce|softmax|cross_entropy|nll_loss|sum_kernel|norm_kernel"),
    # CPU only: what the host does around the kernels (autograd's nodes, views, Dynamo's guards)
    ("host", r"autograd::|backward0|cache lookup|profilerstep|aten::(view|t|reshape|expand|as_strided|"
             r"_unsafe_view|unsqueeze|squeeze|permute|detach|empty|empty_like|zeros_like|alias|transpose)$"),
    ("copy", r"memcpy|memset|copy|\bcat\b|catarray|transpose|contiguous|fill|nchwtonhwc|nhwctonchw"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|index|aten::"),
)
CLASS_NAMES = (*dict.fromkeys(name for name, _ in CLASSES), "other")
VENDOR = ("attention", "conv", "gemm")  # the same libraries under every variant
_PATTERNS = tuple((name, re.compile(rx)) for name, rx in CLASSES)
TARGET = 1.05  # issue 23's training target over Inductor


def classify(name: str) -> str:
    """The class of a kernel (or CPU operator) by its name: the first of CLASSES it matches."""
    low = name.lower()
    return next((cls for cls, rx in _PATTERNS if rx.search(low)), "other")


def _union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) spans: the time some kernel ran."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def breakdown(prof: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """Per step: each class's time, the kernels' sum and union (GPU), the top kernels."""
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans: list[tuple[float, float]] = []
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.end - e.time_range.start
            spans.append((e.time_range.start, e.time_range.end))
            by_class[classify(e.name)] += us
            by_name[e.name][0] += us
            by_name[e.name][1] += 1
    if not spans:  # the CPU (each operator's self time), or a profiler that gave no kernel events
        for e in prof.key_averages():
            us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
            if us <= 0:
                continue
            by_class[classify(e.key)] += us
            by_name[e.key][0] += us
            by_name[e.key][1] += e.count
    total = sum(by_class.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "classes_ms": {c: by_class.get(c, 0.0) / steps / 1e3 for c in CLASS_NAMES},
        "kernels_ms": total / steps / 1e3,
        "busy_ms": (_union_us(spans) / steps / 1e3) if spans else None,
        "top": [{"name": n[:160], "class": classify(n), "ms": v[0] / steps / 1e3, "calls": v[1] / steps}
                for n, v in top],
    }


def ceiling(d: dict[str, Any]) -> dict[str, float]:
    """From one variant's breakdown: the share of its kernel time outside the vendor classes,
    the optimizer and the host (what fusing and kernel writing can change), how much faster those
    kernels must get for the step to reach TARGET with everything else as it is, and the
    speed-up if they took no time at all."""
    cls = d["classes_ms"]
    rest = d["kernels_ms"] - sum(cls[c] for c in VENDOR) - cls["optimizer"] - cls["host"]
    step = d["step_ms"]
    cut = step * (1 - 1 / TARGET)
    return {"rest_ms": rest, "rest_share": rest / step if step else 0.0,
            "rest_faster_for_target": (rest / (rest - cut)) if rest > cut else float("inf"),
            "rest_free_speedup": step / (step - rest) if step > rest else float("inf")}


def profile(name: str, variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    case = tm.case(name, args.size, args.batch)
    base, inputs, target = case.on(device)
    model = copy.deepcopy(base).train()
    step = bt.training_step(case, model, bt._compile(variant, model, bt._options(args.options)), inputs, target,
                            device, args.dtype)
    gpu = device.type == "cuda"

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    step()
    sync()
    out: dict[str, Any] = {"compile_s": time.perf_counter() - t0}
    for _ in range(args.warm_steps):
        step()
    sync()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync()
        walls.append((time.perf_counter() - t) * 1e3)
    out["step_ms"] = statistics.median(walls)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        sync()
    out.update(breakdown(prof, args.steps, device))
    out["ceiling"] = ceiling(out)
    return out


def print_model(name: str, rows: dict[str, dict[str, Any]]) -> None:
    head = ["variant", "step ms", "kernels ms", "busy ms", *CLASS_NAMES]
    print(f"\n{name}")
    print(" | ".join(head))
    for variant, d in rows.items():
        if "error" in d:
            print(f"{variant} | {d['error'][:200]}")
            continue
        busy = f"{d['busy_ms']:.2f}" if d["busy_ms"] is not None else "-"
        cells = [variant, f"{d['step_ms']:.2f}", f"{d['kernels_ms']:.2f}", busy,
                 *(f"{d['classes_ms'][c]:.2f}" for c in CLASS_NAMES)]
        print(" | ".join(cells))
    ind = rows.get("inductor")
    if ind and "error" not in ind:
        c = ind["ceiling"]
        if ind["busy_ms"] is not None:
            print(f"Inductor: the device ran kernels {ind['busy_ms'] / ind['step_ms']:.0%} of the step's wall time")
        print(f"Inductor: {c['rest_ms']:.2f} ms ({c['rest_share']:.0%} of the step) in kernels other than "
              f"{'/'.join(VENDOR)}, the optimizer and the host; {TARGET}x the step needs them {c['rest_faster_for_target']:.2f}x "
              f"faster; were they free, the step would run {c['rest_free_speedup']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", default=bt.DEFAULT_MODELS, help="comma-separated, as bench_torch.py's")
    ap.add_argument("--variants", default="eager,inductor", help=f"of {', '.join(bt.VARIANTS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("full", "tiny"), help="model size (default: full on a GPU, tiny on the CPU)")
    ap.add_argument("--batch", type=int, help="training batch (default: each model's)")
    ap.add_argument("--dtype", choices=sorted(bt.DTYPES), help="autocast dtype (default bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--warm-steps", type=int, default=10, help="steps after the first, before any timing")
    ap.add_argument("--steps", type=int, default=10, help="steps timed, then steps profiled")
    ap.add_argument("--options", default="", help="backend options for the fusegraph variants, k=v,k=v")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.size = args.size or ("full" if device.type == "cuda" else "tiny")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in bt.VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(bt.VARIANTS)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dtype": args.dtype, "size": args.size, "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows: dict[str, dict[str, Any]] = {}
        for variant in variants:
            try:
                rows[variant] = profile(name, variant, args, device)
            except Exception as exc:  # one variant failing leaves the others' rows
                rows[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            bt._free(device)
        result["models"][name] = rows
        print_model(name, rows)
        if args.json:  # after every model: a run stopped by a time limit keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

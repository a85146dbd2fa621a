"""What one claimed region costs through ``torch.compile(backend="fusegraph")`` against
Inductor's code for the same ops: single-op functions (layer norm, RMS norm, a linear layer,
causal attention, GELU) compiled three ways -- Inductor, the backend with the region claimed
(floor off, nothing else in the graph), eager -- timed side by side by fusegraph's timing
routine (interleaved rounds, medians), then the claimed call profiled (cProfile, its
costliest Python functions by own time). On a GPU the difference between the claimed call
and Inductor's is mostly host time when the kernels are short: this says where it goes.

    python benchmarks/bench_region_call.py                      # CUDA if present, else CPU
    python benchmarks/bench_region_call.py --device cpu --cases layernorm,linear
    python benchmarks/bench_region_call.py --profile 0          # no profile
    python benchmarks/bench_region_call.py --floor              # the floor on: each region's verdict

With ``--floor`` the backend runs as users get it (floor and whole-graph check on; on a GPU
the region is built on a kernel engine and measured on device time) and each case prints
its region's verdict: how its kernels compare with Inductor's, apart from the host cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from fusegraph.regions.report import Report
from fusegraph.select.timing import time_candidates
from fusegraph.torch.compile_backend import collecting, fusegraph_backend


def _cases(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    rows, d, heads, seq = (256, 64, 2, 64) if small else (8192, 768, 12, 1024)
    return {
        "layernorm": (lambda x, w, b: F.layer_norm(x, (d,), w, b), (r(rows, d), r(d), r(d))),
        "rmsnorm": (lambda x, w: F.rms_norm(x, (d,), w, 1e-6), (r(rows, d), r(d))),
        "linear": (lambda x, w, b: F.linear(x, w, b), (r(rows, d), r(4 * d, d), r(4 * d))),
        "linear_gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)), (r(rows, d), r(4 * d, d), r(4 * d))),
        "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      tuple(r(rows // seq if not small else 1, heads, seq, d // heads) for _ in range(3))),
    }


def _one(name: str, fn: Callable[..., Any], inputs: tuple[Any, ...], sync: Callable[[], None] | None,
         budget: float, profile: int, floor: bool = False) -> None:
    torch._dynamo.reset()
    ind = torch.compile(fn)
    options = {} if floor else {"floor": False, "whole_graph": False}
    fg = torch.compile(fn, backend=partial(fusegraph_backend, options=options))
    with torch.no_grad():
        with collecting() as rows:
            fg(*inputs)
        ind(*inputs)
        engines = sorted({r.where for r in Report(tuple(rows)).rows if r.fusegraph}) or ["nothing claimed"]
        t = time_candidates({"eager": lambda: fn(*inputs), "inductor": lambda: ind(*inputs),
                             "fusegraph": lambda: fg(*inputs)}, sync=sync, warmup_s=0.5, budget_s=budget)
        ms = {k: v.median_ms for k, v in t.items()}
        print(f"{name:<12} {ms['eager']:9.4f} {ms['inductor']:9.4f} {ms['fusegraph']:9.4f} "
              f"{(ms['fusegraph'] - ms['inductor']) * 1e3:9.1f}  {', '.join(engines)}")
        if floor:
            for why in sorted({f"{r.pattern} -> {r.where}: {r.why}" for r in rows if r.region is not None}):
                print(f"    {why}")
        if profile <= 0:
            return
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(profile):
            fg(*inputs)
        if sync is not None:
            sync()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    first = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    print(f"  profile of {profile} claimed calls (own time, costliest first):")
    for ln in lines[first:first + 13]:
        print("    " + ln)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--cases", default="", help="comma-separated (default: all)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of interleaved timing per case")
    ap.add_argument("--profile", type=int, default=300, help="claimed calls to profile per case (0: none)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU default)")
    ap.add_argument("--floor", action="store_true", help="the floor on, as users get it; print each region's verdict")
    args = ap.parse_args()
    device = torch.device(args.device)
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = names[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    small = args.small or device.type == "cpu"
    cases = _cases(device, dtype, small)
    wanted = [c for c in args.cases.split(",") if c] or list(cases)
    bad = [c for c in wanted if c not in cases]
    if bad:
        ap.error(f"unknown cases {bad}; known: {list(cases)}")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {gpu}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
          f"{'small' if small else 'full'} shapes")
    print(f"{'case':<12} {'eager ms':>9} {'inductor':>9} {'fusegraph':>9} {'fg-ind us':>9}  engine")
    for name in wanted:
        fn, inputs = cases[name]
        _one(name, fn, inputs, sync, args.budget, args.profile, args.floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())

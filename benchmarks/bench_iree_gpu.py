"""IREE engine (CUDA, sm_80 PTX) vs PyTorch on an NVIDIA GPU, measured side by side.

    python benchmarks/bench_iree_gpu.py            # full suite
    python benchmarks/bench_iree_gpu.py --quick    # fewer shapes and repeats
    python benchmarks/bench_iree_gpu.py --compile  # also torch.compile (Inductor) columns

Per case, interleaved rounds of short blocks (first call of a block untimed), median:
  IREE     plan's VM invoke with device-resident Buffers (its sync ABI waits for the GPU)
  ovh      ``plan.execute`` with Buffers minus that invoke time
  torch    eager PyTorch (cuDNN/cuBLAS) on CUDA tensors, followed by synchronize()
  x        speed ratio torch / IREE (> 1: IREE faster)
Layouts: channels-last for convolutions on both sides (NHWC activations; PyTorch
``memory_format=torch.channels_last``), f16 with f32 accumulation unless noted.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusegraph as fg
from fusegraph.graph import layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_iree_cpu import HWCF, RESNET50_CONVS


@dataclass
class GpuCase:
    name: str
    graph: Callable[[], fg.Graph]
    torch_fn: Callable[[dict[str, Any]], Any]  # logical torch tensors by input name -> output


def conv_case(name: str, n: int, c: int, k: int, r: int, s: int, h: int, dt: str, bias_relu: bool = False) -> GpuCase:
    import torch
    import torch.nn.functional as F

    pad = (r - 1) // 2
    xdims, wdims = [n, c, h, h], [k, c, r, r]

    def graph() -> fg.Graph:
        g = fg.Graph(f"gconv_{name}_n{n}".replace(" ", "_").replace("/", "s"), io_data_type=dt, compute_data_type="float")
        x = g.tensor("x", xdims, fg.strides_for(xdims, "NHWC"))
        w = g.tensor("w", wdims, layout.packed_strides(wdims, HWCF))
        y = g.conv_fprop(x, w, padding=[pad, pad], stride=[s, s])
        if bias_relu:
            y = g.relu(g.bias(y, g.tensor("b", [1, k, 1, 1], fg.strides_for([1, k, 1, 1], "NHWC"))))
        y.set_output(True).set_name("y")
        return g.validate()

    def run(t: dict[str, Any]) -> Any:
        y = F.conv2d(t["x"], t["w"], t["b"].reshape(-1) if bias_relu else None, stride=s, padding=pad)
        return torch.relu(y) if bias_relu else y

    return GpuCase(f"{name} n{n}", graph, run)


def gemm_case(m: int, dt: str) -> GpuCase:
    import torch

    def graph() -> fg.Graph:
        g = fg.Graph(f"ggemm{m}", io_data_type=dt, compute_data_type="float")
        g.matmul(g.tensor("a", [m, m]), g.tensor("b", [m, m])).set_output(True).set_name("y")
        return g.validate()

    return GpuCase(f"gemm {m}^3", graph, lambda t: torch.matmul(t["a"], t["b"]))


def chain_case(shape: tuple[int, int], dt: str) -> GpuCase:
    import torch

    def graph() -> fg.Graph:
        g = fg.Graph(f"gchain6_{shape[0]}x{shape[1]}", io_data_type=dt, compute_data_type="float")
        a, b = g.tensor("a", list(shape)), g.tensor("b", list(shape))
        g.sub(g.sigmoid(g.tanh(g.relu(g.mul(g.add(a, b), b)))), a).set_output(True).set_name("y")
        return g.validate()

    def run(t: dict[str, Any]) -> Any:
        a, b = t["a"], t["b"]
        return torch.sigmoid(torch.tanh(torch.relu((a + b) * b))) - a

    return GpuCase(f"6-op chain {shape[0]}x{shape[1]}", graph, run)


def layernorm_case(shape: tuple[int, int], dt: str) -> GpuCase:
    import torch.nn.functional as F

    def graph() -> fg.Graph:
        g = fg.Graph(f"gln_{shape[0]}x{shape[1]}", io_data_type=dt, compute_data_type="float")
        x, sc, b = g.tensor("x", list(shape)), g.tensor("scale", [1, shape[1]]), g.tensor("bias", [1, shape[1]])
        g.layernorm(x, sc, b, epsilon=1e-5)[0].set_output(True).set_name("y")
        return g.validate()

    return GpuCase(
        f"layernorm {shape[0]}x{shape[1]}", graph,
        lambda t: F.layer_norm(t["x"], (shape[1],), t["scale"].reshape(-1), t["bias"].reshape(-1), 1e-5),
    )


def softmax_case(shape: tuple[int, int], dt: str) -> GpuCase:
    import torch

    def graph() -> fg.Graph:
        g = fg.Graph(f"gsoftmax_{shape[0]}x{shape[1]}", io_data_type=dt, compute_data_type="float")
        g.softmax(g.tensor("x", list(shape)), axis=-1).set_output(True).set_name("y")
        return g.validate()

    return GpuCase(f"softmax {shape[0]}x{shape[1]}", graph, lambda t: torch.softmax(t["x"], dim=-1))


def timed_blocks(fns: list[Callable[[], Any]], sync: Callable[[], None], repeats: int, block: int = 3) -> list[float]:
    for f in fns:
        f()
        sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, repeats // block)):
        for f, ts in zip(fns, times, strict=True):
            f()
            sync()
            for _ in range(block):
                t0 = time.perf_counter()
                f()
                sync()
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def run_case(case: GpuCase, repeats: int, with_compile: bool) -> dict[str, Any]:
    import iree.runtime as rt
    import torch

    from fusegraph.engines.iree import IreeEngine
    from fusegraph.engines.iree.cache import clear_memory
    from fusegraph.engines.iree.runtime import runtime_for

    h = fg.Handle("cuda")
    row: dict[str, Any] = {"case": case.name}
    g = case.graph()
    engine = IreeEngine()
    sup = engine.supports(g, h)
    if not sup:
        row["note"] = f"IREE n/a: {sup.reason[:70]}"
        return row
    t0 = time.perf_counter()
    try:
        plan = engine.build(g, h)
    except fg.FusegraphError as exc:
        row["note"] = f"IREE failed: {str(exc).splitlines()[0][:70]}"
        return row
    row["cold"] = time.perf_counter() - t0
    row["disp"] = plan.dispatch_count
    clear_memory()
    runtime_for(h).forget(plan.key)
    t0 = time.perf_counter()
    engine.build(case.graph(), h)
    row["warm"] = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    logical = {}
    for t in g.inputs():
        scale = 1.0 / math.sqrt(max(1, int(np.prod(t.shape[1:])))) if t.name == "w" else 1.0
        logical[t.name] = (rng.standard_normal(t.shape) * scale).astype(t.dtype.numpy)
    bufs = {n: fg.Buffer.from_numpy(a, h, g.tensor_by_name(n)) for n, a in logical.items()}
    tdt = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}
    tt = {}
    for n, a in logical.items():
        x = torch.from_numpy(a.astype(np.float32)).to("cuda", dtype=tdt.get(a.dtype, torch.bfloat16))
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        tt[n] = x
    args = rt.VmVariantList(len(plan.inputs))
    for s in plan.inputs:
        args.push_ref(bufs[s.name].view)
    invoke, fn, n_out = plan.loaded.context.invoke, plan.loaded.function, len(plan.outputs)

    def iree_kernel() -> None:
        invoke(fn, args, rt.VmVariantList(n_out))

    def iree_exec() -> None:
        plan.execute(bufs)

    def eager() -> None:
        case.torch_fn(tt)

    fns = [iree_kernel, iree_exec, eager]
    if with_compile:
        compiled = torch.compile(case.torch_fn)
        fns.append(lambda: compiled(tt))
    with torch.no_grad():
        ours = plan.execute(bufs)["y"].to_numpy().astype(np.float64)
        theirs = case.torch_fn(tt).float().cpu().numpy().astype(np.float64)
        if theirs.ndim == 4:  # compare in logical order
            theirs = np.ascontiguousarray(theirs)
        row["err"] = float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))
        times = timed_blocks(fns, torch.cuda.synchronize, repeats)
    row["iree"], row["exec"], row["torch"] = times[:3]
    if with_compile:
        row["tcompile"] = times[3]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true", help="add torch.compile (Inductor) timings")
    ap.add_argument("--dtype", default="half", choices=["half", "float", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run this on the GPU machine")
        return 2
    os.environ["FUSEGRAPH_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="fusegraph-gpubench-")
    dt = args.dtype
    repeats = 15 if args.quick else 45
    convs = RESNET50_CONVS[::3] if args.quick else RESNET50_CONVS
    cases = [conv_case(n, args.batch, c, k, r, s, hh, dt) for n, c, k, r, s, hh in convs]
    cases.append(conv_case("conv3x3+bias+relu 64", args.batch, 64, 64, 3, 1, 56, dt, bias_relu=True))
    cases += [gemm_case(m, dt) for m in ((1024, 4096) if args.quick else (1024, 2048, 4096, 8192))]
    cases += [chain_case((8192, 4096), dt), layernorm_case((8192, 4096), dt), softmax_case((8192, 4096), dt)]
    print(f"# IREE (cuda, sm_80 PTX) vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}; {dt}; "
          f"median of interleaved blocks; ratio = torch / IREE")
    hdr = f"{'case':30s} {'IREE ms':>9s} {'torch ms':>9s} {'x':>6s}"
    hdr += f" {'compile ms':>10s} {'xc':>6s}" if args.compile else ""
    hdr += f" {'ovh us':>7s} {'cold s':>7s} {'warm ms':>8s} {'disp':>4s} {'err':>8s}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for case in cases:
        row = run_case(case, repeats, args.compile)
        rows.append(row)
        if "note" in row:
            print(f"{row['case']:30s} {row['note']}")
            continue
        line = f"{row['case']:30s} {row['iree'] * 1e3:9.3f} {row['torch'] * 1e3:9.3f} {row['torch'] / row['iree']:6.2f}"
        if args.compile:
            line += f" {row['tcompile'] * 1e3:10.3f} {row['tcompile'] / row['iree']:6.2f}"
        line += (f" {(row['exec'] - row['iree']) * 1e6:7.1f} {row['cold']:7.2f} {row['warm'] * 1e3:8.2f}"
                 f" {row['disp']:4d} {row['err']:8.1e}")
        print(line, flush=True)
    ok = [r for r in rows if "note" not in r]
    if ok:
        ratios = [r["torch"] / r["iree"] for r in ok]
        print(f"\ngeomean torch/IREE {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x over {len(ok)} cases; "
              f"median cold compile {statistics.median(r['cold'] for r in ok):.2f} s; "
              f"median warm build {statistics.median(r['warm'] for r in ok) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

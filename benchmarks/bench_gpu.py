"""fusegraph on an NVIDIA GPU, side by side with what people call today (issue 11).

Each graph is timed in one process by fusegraph's one timing routine
(fusegraph/select/timing.py, the same as `fusegraph bench` and autotune): every contender
warmed until its calls stop getting faster, then interleaved rounds (per round and
contender: one untimed call, then ``--per-round`` calls between two device synchronizes,
the order rotating each round), the median over rounds of the time per call reported; a
first call before that keeps compilation and plan building out:

  fusegraph   the plan ``g.build(handle)`` picks (heuristics, untuned)
  tuned       the fastest of fusegraph's candidate configs (cudnn plan indices and
              heuristic modes, triton row-kernel tilings, torch eager / CUDA graph /
              compile), timed here -- what
              ``g.autotune`` chooses, without its float64 reference check (the GPU tests
              check numerics on smaller shapes)
  eager       the same computation in PyTorch eager (cudnn.benchmark on)
  compile     torch.compile of the eager function (where the case names it)
  cudnn       cuDNN's Python frontend called directly: the same cuDNN graph built with its
              heuristic (A, then FALLBACK) and run with ``graph.execute(pack, workspace)``

    python benchmarks/bench_gpu.py --json gpu.json --png gpu.png [--group issue|extra|all|backward]

f16 I/O, f32 compute/intermediates, NHWC activations unless the name says otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig

GPU = fg.Handle("cuda:0")
F16 = DT.HALF


def _g(name: str, dt: DT = F16) -> fg.Graph:
    return fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)


@dataclass
class Case:
    name: str
    group: str
    graph: fg.Graph
    eager: Callable[[dict[str, Any]], Any]
    flops: float = 0.0
    compile: bool = False  # time torch.compile (and fusegraph's torch compile config)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # fills inputs that must agree with others (a backward's saved statistics and forward
    # output, computed from its random x / q, k, v), in place, before anything is timed
    prepare: Callable[[dict[str, Any]], None] | None = None


# ---- cases ---------------------------------------------------------------------------------------
def conv_case(name: str, group: str, n: int, c: int, hw: int, k: int, r: int, stride: int = 1, compile: bool = False) -> Case:
    import torch.nn.functional as F

    g = _g(name)
    x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
    w = g.tensor("w", [k, c, r, r], fg.strides_for([k, c, r, r], "KRSC"))
    b = g.tensor("b", [1, k, 1, 1])
    pad = r // 2
    g.relu(g.bias(g.conv_fprop(x, w, padding=[pad, pad], stride=[stride, stride]), b)).set_output(True)
    ho = (hw + 2 * pad - r) // stride + 1

    def eager(t: dict[str, Any]) -> Any:
        return F.relu(F.conv2d(t["x"], t["w"], t["b"].reshape(-1), stride=stride, padding=pad))

    return Case(name, group, g, eager, 2.0 * n * k * ho * ho * c * r * r, compile=compile)


def gemm_case(name: str, group: str, m: int, k: int, n: int, dt: DT = F16, epilogue: bool = False, compile: bool = False) -> Case:
    import torch
    import torch.nn.functional as F

    g = _g(name, dt)
    a, b = g.tensor("a", [m, k]), g.tensor("b", [k, n])
    c = g.matmul(a, b)
    if epilogue:
        c = g.gelu(g.add(c, g.tensor("bias", [1, n])))
    c.set_output(True)

    def eager(t: dict[str, Any]) -> Any:
        if epilogue:
            return F.gelu(torch.addmm(t["bias"], t["a"], t["b"]))
        return torch.matmul(t["a"], t["b"])

    return Case(name, group, g, eager, 2.0 * m * n * k, compile=compile)


def norm_case(kind: str, group: str, rows: int, cols: int, gelu: bool) -> Case:
    import torch
    import torch.nn.functional as F

    name = f"{kind}{'+gelu' if gelu else ''}_{rows}x{cols}"
    g = _g(name)
    x = g.tensor("x", [rows, cols])
    s = g.tensor("scale", [1, cols])
    if kind == "layernorm":
        b = g.tensor("bias", [1, cols])
        y, _, _ = g.layernorm(x, s, b, 1e-5)
    else:
        y, _ = g.rmsnorm(x, s, 1e-5)
    if gelu:
        y = g.gelu(y)
    y.set_output(True)

    def eager(t: dict[str, Any]) -> Any:
        if kind == "layernorm":
            out = F.layer_norm(t["x"], (cols,), t["scale"].reshape(-1), t["bias"].reshape(-1), 1e-5)
        else:
            out = F.rms_norm(t["x"], (cols,), t["scale"].reshape(-1), 1e-5)
        return F.gelu(out) if gelu else out

    del torch
    return Case(name, group, g, eager, compile=True)


def softmax_case(group: str, rows: int, cols: int) -> Case:
    import torch

    g = _g(f"softmax_{rows}x{cols}")
    g.softmax(g.tensor("x", [rows, cols]), -1).set_output(True)
    return Case(g.name, group, g, lambda t: torch.softmax(t["x"], -1), compile=True)


def chain_case(group: str, rows: int, cols: int) -> Case:
    import torch

    g = _g(f"pointwise_chain8_{rows}x{cols}")
    a, b = g.tensor("a", [rows, cols]), g.tensor("b", [rows, cols])
    t1 = g.add(a, b)
    t2 = g.mul(t1, a)
    t3 = g.sigmoid(t2)
    t4 = g.mul(t3, b)
    t5 = g.sub(t4, a)
    t6 = g.tanh(t5)
    t7 = g.mul(t6, t1)
    g.relu(t7).set_output(True)

    def eager(t: dict[str, Any]) -> Any:
        x, y = t["a"], t["b"]
        s1 = x + y
        return torch.relu(torch.tanh(torch.sigmoid(s1 * x) * y - x) * s1)

    return Case(g.name, group, g, eager, compile=True)


def sdpa_case(group: str, b: int, h: int, s: int, d: int, causal: bool) -> Case:
    import torch.nn.functional as F

    g = _g(f"sdpa_{'causal' if causal else 'full'}_b{b}h{h}s{s}d{d}")
    q, k, v = (g.tensor(n, [b, h, s, d]) for n in "qkv")
    g.sdpa(q, k, v, causal=causal).set_output(True)
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return Case(g.name, group, g, lambda t: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=causal), flops)


def relu_case(group: str) -> Case:
    import torch

    g = _g("relu_64x64")
    g.relu(g.tensor("x", [64, 64])).set_output(True)
    return Case(g.name, group, g, lambda t: torch.relu(t["x"]), notes="per-call overhead")


def grad_case(kind: str, group: str, n: int, c: int, hw: int, k: int) -> Case:
    import torch

    g = _g(f"conv_{kind}_n{n}c{c}k{k}_{hw}")
    xs, ws, ys = [n, c, hw, hw], [k, c, 3, 3], [n, k, hw, hw]
    if kind == "dgrad":
        dy = g.tensor("dy", ys, fg.strides_for(ys, "NHWC"))
        w = g.tensor("w", ws, fg.strides_for(ws, "KRSC"))
        g.conv_dgrad(dy, w, padding=[1, 1]).set_dim(xs).set_stride(fg.strides_for(xs, "NHWC")).set_output(True)
    else:
        x = g.tensor("x", xs, fg.strides_for(xs, "NHWC"))
        dy = g.tensor("dy", ys, fg.strides_for(ys, "NHWC"))
        g.conv_wgrad(x, dy, padding=[1, 1]).set_dim(ws).set_stride(fg.strides_for(ws, "KRSC")).set_output(True)
    aten = torch.ops.aten
    holder: dict[str, Any] = {}

    def eager(t: dict[str, Any]) -> Any:
        if kind == "dgrad":
            if "x" not in holder:
                holder["x"] = torch.empty(xs, dtype=t["dy"].dtype, device=t["dy"].device).to(memory_format=torch.channels_last)
            return aten.convolution_backward(t["dy"], holder["x"], t["w"], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                             [True, False, False])[0]
        if "w" not in holder:
            holder["w"] = torch.empty(ws, dtype=t["x"].dtype, device=t["x"].device).to(memory_format=torch.channels_last)
        return aten.convolution_backward(t["dy"], t["x"], holder["w"], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                         [False, True, False])[1]

    return Case(g.name, group, g, eager, 2.0 * n * k * hw * hw * c * 9)


# ---- backward (issue 23): norm backward and attention backward, alone in their graphs ---------
def _autograd_eager(forward: Callable[[dict[str, Any]], tuple[Any, tuple[Any, ...]]], grad: str) -> Callable[[dict[str, Any]], Any]:
    """PyTorch eager's backward alone: ``forward`` (run once, on leaves that require
    gradients) gives (output, leaves); each call is ``torch.autograd.grad`` of that output
    with ``t[grad]`` as its gradient, the graph retained (the forward is not timed)."""
    import torch

    held: dict[str, Any] = {}

    def call(t: dict[str, Any]) -> Any:
        if "y" not in held:
            with torch.enable_grad():
                held["y"], held["leaves"] = forward(t)
        return torch.autograd.grad(held["y"], held["leaves"], t[grad], retain_graph=True)[0]

    return call


def norm_backward_case(kind: str, rows: int, cols: int, dt: DT = DT.BFLOAT16, eps: float = 1e-5) -> Case:
    """layernorm_backward / rmsnorm_backward (dx, dscale [, dbias]) vs the backward of
    F.layer_norm / F.rms_norm (cuDNN's frontend publishes RMSNorm backward 16384x4096 bf16 at
    0.106 ms on the H200, PyTorch's at 0.223 ms)."""
    import torch
    import torch.nn.functional as F

    g = _g(f"{kind}_backward_{rows}x{cols}_{dt.value}", dt)
    dy, x, s = g.tensor("dy", [rows, cols]), g.tensor("x", [rows, cols]), g.tensor("scale", [1, cols])
    if kind == "layernorm":
        mean, inv = g.tensor("mean", [rows, 1], data_type=DT.FLOAT), g.tensor("inv", [rows, 1], data_type=DT.FLOAT)
        outs: tuple[Any, ...] = g.layernorm_backward(dy, x, s, mean, inv)
    else:
        outs = g.rmsnorm_backward(dy, x, s, g.tensor("inv", [rows, 1], data_type=DT.FLOAT))[:2]
    for o in outs:
        o.set_output(True)

    def prepare(t: dict[str, Any]) -> None:
        xf = t["x"].float()
        if kind == "layernorm":
            t["mean"].copy_(xf.mean(1, keepdim=True))
            t["inv"].copy_(torch.rsqrt(xf.var(1, unbiased=False, keepdim=True) + eps))
        else:
            t["inv"].copy_(torch.rsqrt(xf.square().mean(1, keepdim=True) + eps))

    def forward(t: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        xl = t["x"].detach().requires_grad_()
        w = t["scale"].reshape(-1).detach().requires_grad_()
        if kind == "layernorm":
            b = torch.zeros_like(w).requires_grad_()
            return F.layer_norm(xl, (cols,), w, b, eps), (xl, w, b)
        return F.rms_norm(xl, (cols,), w, eps), (xl, w)

    return Case(g.name, "backward", g, _autograd_eager(forward, "dy"), prepare=prepare,
                notes="eager: torch.autograd.grad of the forward's output (backward kernels only)")


def sdpa_backward_case(b: int, hq: int, hkv: int, s: int, d: int, causal: bool, dt: DT = DT.BFLOAT16) -> Case:
    """sdpa_backward (dq, dk, dv from q, k, v, o, dO and the forward's log-sum-exp) vs the
    backward of F.scaled_dot_product_attention (PyTorch's default backend, enable_gqa)."""
    import torch
    import torch.nn.functional as F

    g = _g(f"sdpa_backward_{'causal' if causal else 'full'}_b{b}h{hq}kv{hkv}s{s}d{d}_{dt.value}", dt)
    q, k, v = g.tensor("q", [b, hq, s, d]), g.tensor("k", [b, hkv, s, d]), g.tensor("v", [b, hkv, s, d])
    o, do = g.tensor("o", [b, hq, s, d]), g.tensor("do", [b, hq, s, d])
    stats = g.tensor("stats", [b, hq, s, 1], data_type=DT.FLOAT)
    for grad in g.sdpa_backward(q, k, v, o, do, stats, causal=causal):
        grad.set_output(True)
    scale = 1.0 / math.sqrt(d)
    group = hq // hkv

    def prepare(t: dict[str, Any]) -> None:  # o and the statistics of the forward, per KV head in f32
        keep = torch.ones(s, s, dtype=torch.bool, device=t["q"].device).tril() if causal else None
        for bi in range(b):
            for h in range(hkv):
                heads = slice(h * group, (h + 1) * group)
                sc = (t["q"][bi, heads].float() @ t["k"][bi, h].float().T) * scale
                if keep is not None:
                    sc = sc.masked_fill(~keep, -math.inf)
                lse = torch.logsumexp(sc, -1, keepdim=True)
                t["stats"][bi, heads].copy_(lse)
                t["o"][bi, heads].copy_(torch.exp(sc - lse) @ t["v"][bi, h].float())
                del sc

    def forward(t: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        ql, kl, vl = (t[n].detach().requires_grad_() for n in ("q", "k", "v"))
        return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, scale=scale, enable_gqa=hq != hkv), (ql, kl, vl)

    flops = 2.5 * 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)  # backward: 2.5x the forward's matmul work
    return Case(g.name, "backward", g, _autograd_eager(forward, "do"), flops, prepare=prepare,
                notes="eager: torch.autograd.grad of the forward's output (backward kernels only)")


def cases(group: str) -> list[Case]:
    out: list[Case] = []
    if group in ("issue", "all"):
        out += [
            conv_case("conv3x3_bias_relu_n32_c64_56", "issue", 32, 64, 56, 64, 3),
            conv_case("conv3x3_bias_relu_n32_c512_7", "issue", 32, 512, 7, 512, 3),
            conv_case("conv1x1_bias_relu_n32_64to256_56", "issue", 32, 64, 56, 256, 1),
            conv_case("conv3x3_bias_relu_n256_c64_56", "issue", 256, 64, 56, 64, 3),
            gemm_case("matmul_4096", "issue", 4096, 4096, 4096),
            gemm_case("gemm_bias_gelu_8192x4096x4096", "issue", 8192, 4096, 4096, epilogue=True, compile=True),
            norm_case("layernorm", "issue", 8192, 4096, gelu=True),
            chain_case("issue", 8192, 4096),
            sdpa_case("issue", 8, 16, 2048, 128, causal=True),
            relu_case("issue"),
        ]
    if group == "backward":  # not in "all": its own summary line
        out += [
            norm_backward_case("rmsnorm", 16384, 4096),
            norm_backward_case("layernorm", 16384, 4096),
            sdpa_backward_case(1, 64, 8, 4096, 128, causal=True),
        ]
    if group in ("extra", "all"):
        for n in (32, 256):
            out += [
                conv_case(f"rn50_conv7x7s2_3to64_224_n{n}", "extra", n, 3, 224, 64, 7, stride=2),
                conv_case(f"rn50_conv1x1_256to64_56_n{n}", "extra", n, 256, 56, 64, 1),
                conv_case(f"rn50_conv3x3_128_28_n{n}", "extra", n, 128, 28, 128, 3),
                conv_case(f"rn50_conv3x3_256_14_n{n}", "extra", n, 256, 14, 256, 3),
            ]
        out += [
            gemm_case("gemm_8192_f16", "extra", 8192, 8192, 8192, F16),
            gemm_case("gemm_8192_bf16", "extra", 8192, 8192, 8192, DT.BFLOAT16),
            norm_case("layernorm", "extra", 8192, 4096, gelu=False),
            norm_case("rmsnorm", "extra", 8192, 4096, gelu=False),
            softmax_case("extra", 8192, 4096),
            sdpa_case("extra", 8, 16, 2048, 128, causal=False),
            sdpa_case("extra", 2, 16, 8192, 128, causal=True),
            sdpa_case("extra", 2, 16, 8192, 128, causal=False),
            grad_case("dgrad", "extra", 32, 64, 56, 64),
            grad_case("wgrad", "extra", 32, 64, 56, 64),
        ]
    return out


# ---- contenders ----------------------------------------------------------------------------------
def device_inputs(g: fg.Graph, rng: np.random.Generator) -> dict[str, Any]:
    from fusegraph.bench.baselines import device_inputs as make

    return make(g, rng, "cuda")


def direct_cudnn(g: fg.Graph, dev: dict[str, Any]) -> Callable[[], Any]:
    """cuDNN's frontend as a user calls it (fusegraph/bench/baselines.py, `fusegraph bench
    --compare cudnn`'s): build with its heuristic, execute a uid pack."""
    from fusegraph.bench.baselines import cudnn_direct

    return cudnn_direct(g, dev, "cuda:0")


def candidate_configs(case: Case) -> list[EngineConfig]:
    from fusegraph.engines.registry import REGISTRY

    out: list[EngineConfig] = []
    cud = REGISTRY.get("cudnn")
    if cud.supports(case.graph, GPU):
        idx = next((k.choices for k in cud.knobs(case.graph, GPU) if k.name == "plan_index"), (0,))
        out += [EngineConfig("cudnn", (("plan_index", i),)) for i in idx[:4]]
        out.append(EngineConfig("cudnn", (("heur_mode", "b"),)))
    tri = REGISTRY.get("triton")
    if tri.supports(case.graph, GPU):  # the default tiling and its neighbours
        knobs = {k.name: k for k in tri.knobs(case.graph, GPU)}
        rows, warps = knobs["rows_per_program"], knobs["num_warps"]
        seen = set()
        for r in (rows.default, rows.default * 2):
            for w in (warps.default // 2, warps.default, warps.default * 2):
                if r in rows.choices and w in warps.choices and (r, w) not in seen:
                    seen.add((r, w))
                    out.append(EngineConfig("triton", (("rows_per_program", r), ("num_warps", w))))
        if "gelu_cdf" in knobs:  # libdevice's erf (the other CDF) at the default tiling
            out.append(EngineConfig("triton", (("gelu_cdf", "erf"),)))
        if "programs_per_sm" in knobs:  # norm backward: the row pass's grid and its prefetch
            psm = knobs["programs_per_sm"]
            out += [EngineConfig("triton", (("programs_per_sm", p),)) for p in psm.choices if p != psm.default]
            out += [EngineConfig("triton", (("prefetch", n),)) for n in knobs["prefetch"].choices if n != knobs["prefetch"].default]
            out.append(EngineConfig("triton", (("num_warps", 8), ("programs_per_sm", 2))))
    out += [EngineConfig("torch"), EngineConfig("torch", (("cuda_graph", False),))]
    if case.compile:
        out.append(EngineConfig("torch", (("compile", True),)))
    return out


def time_all(fns: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Milliseconds per call of each contender, one sample per round, by the shared routine
    (each round starts at another contender: the first after a synchronize ran measurably
    slower on short kernels, and must not always be the same one)."""
    import torch

    from fusegraph.select.timing import time_candidates

    got = time_candidates(fns, sync=torch.cuda.synchronize, min_rounds=rounds, per_round=per_round)
    return {name: list(t.samples) for name, t in got.items()}


def host_us_per_call(fn: Callable[[], Any], n: int = 2000) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def run_case(case: Case, rounds: int, per_round: int, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    from fusegraph.engines.registry import REGISTRY

    g = case.graph.validate()
    dev = device_inputs(g, rng)
    if case.prepare is not None:
        case.prepare(dev)
    res: dict[str, Any] = {"name": case.name, "group": case.group, "flops": case.flops, "notes": case.notes, "results": {}}
    fns: dict[str, Callable[[], Any]] = {}
    errors: dict[str, str] = {}
    outs: dict[str, Any] = {}

    def add(name: str, make: Callable[[], Callable[[], Any]]) -> None:
        try:
            t0 = time.perf_counter()
            fn = make()
            outs[name] = fn()  # warm-up: compiles, plan building, cuDNN autotuning
            fn()
            torch.cuda.synchronize()
            res.setdefault("setup_s", {})[name] = round(time.perf_counter() - t0, 3)
            fns[name] = fn
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"

    picked: dict[str, Any] = {}

    def make_fusegraph() -> Callable[[], Any]:
        plan = g.build(GPU)
        picked["config"] = str(plan.config)
        picked["plan"] = plan
        return lambda: plan.execute(dev)

    def make_given() -> Callable[[], Any]:  # outputs preallocated, as the cuDNN frontend baseline runs
        plan = picked["plan"]
        outs0 = plan.execute(dev)
        pack = {**dev, **{k: torch.empty_like(v) for k, v in outs0.items()}}
        return lambda: plan.execute(pack)

    add("fusegraph", make_fusegraph)
    if "plan" in picked:
        add("fusegraph_given", make_given)
    for cfg in candidate_configs(case):
        def make(cfg: EngineConfig = cfg) -> Callable[[], Any]:
            plan = REGISTRY.get(cfg.engine).build(g, GPU, cfg)
            return lambda: plan.execute(dev)

        add(f"cfg:{cfg}", make)
    torch.backends.cudnn.benchmark = True
    add("eager", lambda: (lambda: case.eager(dev)))
    if case.compile:
        compiled = torch.compile(case.eager)
        add("compile", lambda: (lambda: compiled(dev)))
    add("cudnn", lambda: direct_cudnn(g, dev))
    times = time_all(fns, rounds, per_round)
    for name, ts in times.items():
        ts.sort()  # one sample per round: the time per call of its block
        res["results"][name] = {"median_ms": statistics.median(ts), "p10_ms": ts[len(ts) // 10],
                                "p90_ms": ts[(9 * len(ts)) // 10], "rounds": len(ts), "n": len(ts) * per_round}
    for name, why in errors.items():
        res["results"][name] = {"error": why}
    res["picked"] = picked.get("config")
    picked.pop("plan", None)
    cfgs = {k: v["median_ms"] for k, v in res["results"].items() if k.startswith("cfg:") and "median_ms" in v}
    if "fusegraph" in res["results"] and "median_ms" in res["results"]["fusegraph"]:
        cfgs.setdefault(f"cfg:{picked.get('config')}", res["results"]["fusegraph"]["median_ms"])
    if cfgs:
        best = min(cfgs, key=lambda k: cfgs[k])
        res["tuned"] = {"config": best[4:], "median_ms": cfgs[best]}
    base = {k: res["results"][k]["median_ms"] for k in ("eager", "compile", "cudnn") if "median_ms" in res["results"].get(k, {})}
    if base:
        fastest = min(base, key=lambda k: base[k])
        res["fastest_baseline"] = {"name": fastest, "median_ms": base[fastest]}
        fgm = res["results"].get("fusegraph", {}).get("median_ms")
        if fgm:
            res["ratio_untuned"] = base[fastest] / fgm  # >= 1: fusegraph at least as fast
        fgg = res["results"].get("fusegraph_given", {}).get("median_ms")
        if fgg:
            res["ratio_untuned_given"] = base[fastest] / fgg
        if "tuned" in res:
            res["ratio_tuned"] = base[fastest] / res["tuned"]["median_ms"]
        if "eager" in base and "tuned" in res:
            res["speedup_vs_eager"] = base["eager"] / res["tuned"]["median_ms"]
    if "fusegraph" in outs and "eager" in outs:  # the same inputs: fusegraph's answer vs eager's
        a = outs["fusegraph"]
        a = next(iter(a.values())) if isinstance(a, dict) else a
        e = outs["eager"].float()
        res["rel_err_vs_eager"] = float((a.float() - e).norm() / max(float(e.norm()), 1e-30))
    if case.flops and "tuned" in res:
        res["tflops_tuned"] = case.flops / (res["tuned"]["median_ms"] * 1e-3) / 1e12
    if case.name.startswith("relu_64x64"):
        res["host_us_per_call"] = {k: host_us_per_call(fn) for k, fn in fns.items() if k in ("fusegraph", "eager", "cudnn") or k.startswith("cfg:")}
    return res


def overhead() -> dict[str, float]:
    """Host microseconds per call on a tiny conv+bias+ReLU (kernel time ~ nothing): what each
    way of calling costs above the kernels, and the pieces of fusegraph's call (the checks,
    an output's allocation by each way torch offers, the stream, the launch entry alone), and
    the same for a 64x64 ReLU on the torch engine."""
    import ctypes

    import torch

    from fusegraph.engines.registry import REGISTRY

    case = conv_case("tiny_conv", "overhead", 1, 16, 8, 16, 3)
    g = case.graph.validate()
    dev = device_inputs(g, np.random.default_rng(1))
    cud = REGISTRY.get("cudnn")
    plan = cud.build(g, GPU)
    out_name = g.outputs()[0].name
    given = {**dev, out_name: plan.execute(dev)[out_name].clone()}
    public = cud.build(g, GPU, EngineConfig("cudnn", (("heur_mode", "b"),)))
    public.use_public_execute()  # type: ignore[attr-defined]
    a, b = plan.execute(dev)[out_name], public.execute(dev)[out_name]
    torch.cuda.synchronize()
    o = given[out_name]
    shape, strides, dt, gpu = tuple(o.shape), tuple(o.stride()), o.dtype, torch.device("cuda", 0)
    x = dev["x"]
    xs, xst = tuple(x.shape), tuple(x.stride())
    fns: dict[str, Callable[[], Any]] = {
        "eager conv+bias+relu": lambda: case.eager(dev),
        "cudnn frontend execute(dict)": direct_cudnn(g, dev),
        "fusegraph cudnn plan": lambda: plan.execute(dev),
        "fusegraph cudnn plan, outputs given": lambda: plan.execute(given),
        "fusegraph cudnn plan, public execute": lambda: public.execute(dev),
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.empty_strided": lambda: torch.empty_strided((1, 16, 8, 8), (1024, 1, 128, 16), dtype=torch.float16, device="cuda"),
        "piece: empty_strided(device=torch.device)": functools.partial(torch.empty_strided, shape, strides, dtype=dt, device=gpu),
        "piece: tensor.new_empty_strided": functools.partial(o.new_empty_strided, shape, strides),
        "piece: empty(numel).as_strided": lambda: torch.empty(o.numel(), dtype=dt, device=gpu).as_strided(shape, strides),
        "piece: empty_like": functools.partial(torch.empty_like, o),
        "piece: check one tensor": lambda: (type(x) is torch.Tensor and x.dtype is dt and x.shape == xs and x.stride() == xst
                                            and x.is_cuda and x.get_device() == 0),
        "piece: result dict of one": lambda: {out_name: o},
        "piece: ctypes pointer array": lambda: (ctypes.c_void_p * 4)(),
    }
    raw = getattr(plan, "_raw", None)
    if raw is not None:
        cudnn, _ = cud._load()  # type: ignore[attr-defined]
        stream = torch._C._cuda_getCurrentRawStream(0)
        fns["piece: cudnn.set_stream"] = lambda: cudnn.set_stream(handle=raw._handle, stream=stream)
        # the launch entry alone, on a pointer array filled once (the plan fills one per call)
        ptrs = (ctypes.c_void_p * raw._n)(*raw.template)
        for name, i in raw.slot.items():
            ptrs[i] = given[name].data_ptr()
        addr, ws = ctypes.addressof(ptrs), plan._ws_ptr  # type: ignore[attr-defined]
        fns["piece: _execute_with_raw_ptrs alone"] = lambda: raw._execute(addr, raw._n, ws, raw._backend, raw._index)
        for _ in range(4):  # the given-output call repeats its pointers: captured
            plan.execute(given)
        torch.cuda.synchronize()
        if raw.replays.graphs:
            graph = next(iter(raw.replays.graphs.values()))
            fns["piece: CUDA graph replay alone"] = graph.replay
    nog = cud.build(g, GPU, EngineConfig("cudnn", (("cuda_graph", "off"),)))
    fns["fusegraph cudnn plan, cuda_graph=off"] = functools.partial(nog.execute, dev)
    fns["fusegraph cudnn plan, cuda_graph=off, outputs given"] = functools.partial(nog.execute, given)
    for cfg in (EngineConfig("torch"), EngineConfig("torch", (("cuda_graph", False),))):
        tp = REGISTRY.get("torch").build(g, GPU, cfg)
        fns[f"fusegraph {cfg}"] = functools.partial(tp.execute, dev)
    relu = relu_case("overhead").graph.validate()
    rdev = device_inputs(relu, np.random.default_rng(2))
    rplan = REGISTRY.get("torch").build(relu, GPU)
    rname = relu.outputs()[0].name
    rgiven = {**rdev, rname: rplan.execute(rdev)[rname].clone()}
    rx = rdev["x"]
    fns["relu 64x64: eager"] = lambda: torch.relu(rx)
    fns["relu 64x64: fusegraph torch plan"] = functools.partial(rplan.execute, rdev)
    fns["relu 64x64: fusegraph torch plan, outputs given"] = functools.partial(rplan.execute, rgiven)
    fns["relu 64x64: copy_ into a given output"] = functools.partial(rgiven[rname].copy_, rx)
    sm = softmax_case("overhead", 64, 256)
    smg = sm.graph.validate()
    smdev = device_inputs(smg, np.random.default_rng(3))
    for cg in ("auto", "off"):  # a small softmax on the triton engine: its host cost per call
        tp = REGISTRY.get("triton").build(smg, GPU, EngineConfig("triton", (("cuda_graph", cg),)))
        fns[f"softmax 64x256: fusegraph triton[cuda_graph={cg}]"] = functools.partial(tp.execute, smdev)
    fns["softmax 64x256: eager"] = functools.partial(sm.eager, smdev)
    res = {k: round(host_us_per_call(fn, 3000), 2) for k, fn in fns.items()}
    res["raw_vs_public_max_abs_diff"] = float((a.float() - b.float()).abs().max())
    res["raw_launch"] = float(plan.raw_launch)  # type: ignore[attr-defined]
    res["cudnn_graphs_captured"] = float(len(raw.replays.graphs)) if raw is not None else 0.0
    return res


def gelu_erf_ab(rounds: int, per_round: int) -> dict[str, Any]:
    """layernorm+GELU 8192x4096 on the triton engine with the ``gelu_cdf`` knob at "poly"
    (GELU's polynomial CDF, one exp2: the default) against "erf" (libdevice's erf), a few
    tilings each, interleaved, with each one's error against float64 (the A/B that decides
    whether the default changes; autotuning makes the same choice per graph)."""
    import torch

    from fusegraph.engines.registry import REGISTRY

    case = norm_case("layernorm", "ab", 8192, 4096, gelu=True)
    g = case.graph.validate()
    dev = device_inputs(g, np.random.default_rng(5))
    tri = REGISTRY.get("triton")
    x, s, b = dev["x"].double(), dev["scale"].double().reshape(-1), dev["bias"].double().reshape(-1)
    ln = torch.nn.functional.layer_norm(x, (4096,), s, b, 1e-5)
    ref = 0.5 * ln * (1 + torch.special.erf(ln / math.sqrt(2)))
    fns: dict[str, Callable[[], Any]] = {}
    res: dict[str, Any] = {}
    for label, cdf in (("libdevice", "erf"), ("poly", "poly")):
        for rows, warps in ((1, 4), (1, 8), (2, 8)):
            cfg = EngineConfig("triton", (("gelu_cdf", cdf), ("num_warps", warps), ("rows_per_program", rows)))
            plan = tri.build(g, GPU, cfg)
            key = f"{label} r{rows}w{warps}"
            y = plan.execute(dev)[g.outputs()[0].name].double()
            res[f"err {key}"] = {"rel": float((y - ref).norm() / ref.norm()), "max_abs": float((y - ref).abs().max())}
            fns[key] = functools.partial(plan.execute, dev)
    fns["eager"] = functools.partial(case.eager, dev)
    times = time_all(fns, rounds, per_round)
    res["median_ms"] = {k: round(statistics.median(v), 4) for k, v in times.items()}
    return res


def cold_build(tmp: str) -> dict[str, Any]:
    """g.build(cuda:0) of a conv graph in two fresh processes sharing a cache directory, the
    first graph's time split into its parts: importing cuDNN's frontend, the handle, an
    empty cuDNN graph, the engine's verdict (which loads a stored plan), the build, the
    first launch."""
    code = textwrap.dedent("""
        import json, sys, time
        sys.path.insert(0, ".")
        t = time.perf_counter()
        import torch, fusegraph as fg
        from fusegraph import DataType as DT
        out = {"import_torch_fusegraph_ms": (time.perf_counter() - t) * 1e3}
        t = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
        out["cuda_context_ms"] = (time.perf_counter() - t) * 1e3
        def conv(k):
            g = fg.Graph(f"cold{k}", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
            x = g.tensor("x", [32, 64, 56, 56], fg.strides_for([32, 64, 56, 56], "NHWC"))
            w = g.tensor("w", [k, 64, 3, 3], fg.strides_for([k, 64, 3, 3], "KRSC"))
            g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), g.tensor("b", [1, k, 1, 1]))).set_output(True)
            return g.validate()
        from fusegraph.engines.registry import REGISTRY
        e = REGISTRY.get("cudnn")
        t = time.perf_counter(); e.available(); cudnn, _ = e._load(); out["import_cudnn_ms"] = (time.perf_counter() - t) * 1e3
        th = time.perf_counter(); h = e.cudnn_handle(0); out["cudnn_handle_ms"] = (time.perf_counter() - th) * 1e3
        t = time.perf_counter(); cudnn.pygraph(handle=h); out["empty_pygraph_ms"] = (time.perf_counter() - t) * 1e3
        gpu = fg.Handle("cuda:0")
        for k in (64, 128):  # the first graph pays cuDNN's first use in the process, the second not
            g = conv(k)
            t0 = time.perf_counter(); s = e.supports(g, gpu); t1 = time.perf_counter()
            q = g.build(gpu); t2 = time.perf_counter()
            dev = {t.name: torch.zeros(t.shape, dtype=torch.float16, device="cuda").as_strided(t.shape, t.strides) for t in g.inputs()}
            q.execute(dev); torch.cuda.synchronize(); t3 = time.perf_counter()
            out[f"k{k}"] = {"supports_ms": (t1 - t0) * 1e3, "g_build_after_ms": (t2 - t1) * 1e3, "g_build_ms": (t2 - t0) * 1e3,
                            "first_execute_ms": (t3 - t2) * 1e3, "picked": str(q.config), "loaded": getattr(q, "loaded", None),
                            "supported": bool(s)}
        print(json.dumps(out))
        """)
    import os

    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": tmp}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]})
    return {"first": runs[0], "second": runs[1]}


def chart(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "ratio_untuned" in r or "ratio_tuned" in r]
    names = [r["name"] for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ax.barh(y - 0.2, [r.get("ratio_untuned", 0) for r in rows], 0.4, label="fusegraph untuned")
    ax.barh(y + 0.2, [r.get("ratio_tuned", 0) for r in rows], 0.4, label="fusegraph tuned")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(0.95, color="r", lw=0.6, ls="--")
    ax.set_yticks(y, names, fontsize=7)
    ax.set_xlabel("fastest of {eager, torch.compile, cuDNN frontend} / fusegraph  (>1: fusegraph faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: list[dict[str, Any]], gpu: str) -> str:
    def ms(r: dict[str, Any], k: str) -> str:
        v = r["results"].get(k, {})
        return f"{v['median_ms']:.4f}" if "median_ms" in v else ("err" if "error" in v else "")

    lines = [f"GPU: {gpu}", f"{'graph':38s} {'fusegraph':>10s} {'fg_given':>9s} {'tuned':>9s} {'eager':>8s} {'compile':>8s} {'cudnn':>8s} {'x_untuned':>9s} {'x_given':>8s} {'x_tuned':>8s}  picked | tuned"]
    for r in results:
        t = r.get("tuned", {})
        lines.append(
            f"{r['name'][:38]:38s} {ms(r, 'fusegraph'):>10s} {ms(r, 'fusegraph_given'):>9s} {t.get('median_ms', float('nan')):9.4f} {ms(r, 'eager'):>8s} "
            f"{ms(r, 'compile'):>8s} {ms(r, 'cudnn'):>8s} {r.get('ratio_untuned', float('nan')):9.3f} "
            f"{r.get('ratio_untuned_given', float('nan')):8.3f} {r.get('ratio_tuned', float('nan')):8.3f}"
            f"  {r.get('picked')} | {t.get('config')}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", default="issue", choices=["issue", "extra", "all", "backward", "none"],
                    help="backward: norm and attention backward (issue 23), not part of 'all'")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per contender (one sample each)")
    ap.add_argument("--per-round", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--cold", default="", help="a directory for the cold-build check (two fresh processes)")
    ap.add_argument("--overhead", action="store_true", help="host us per call of each way of calling (tiny conv)")
    ap.add_argument("--erf-ab", action="store_true", help="layernorm+GELU with GELU's polynomial CDF vs libdevice erf")
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0)
    rng = np.random.default_rng(0)
    results = []
    if args.overhead:
        ov = overhead()
        print(json.dumps(ov, indent=1), flush=True)
    if args.erf_ab:
        ab = gelu_erf_ab(max(args.rounds, 7), args.per_round)
        print(json.dumps(ab, indent=1), flush=True)
    for case in cases(args.group):
        if args.only and not any(s in case.name for s in args.only.split(",")):
            continue
        t0 = time.perf_counter()
        try:
            r = run_case(case, args.rounds, args.per_round, rng)
        except Exception as exc:
            r = {"name": case.name, "error": f"{type(exc).__name__}: {exc}", "results": {}}
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        line = {k: v for k, v in r.items() if k not in ("results", "setup_s")}
        line["median_ms"] = {k: round(v["median_ms"], 4) for k, v in r.get("results", {}).items() if "median_ms" in v}
        print(json.dumps(line), flush=True)
        torch.cuda.empty_cache()
    doc: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "command": " ".join(sys.argv), "cases": results}
    if args.overhead:
        doc["overhead_us"] = ov
    if args.erf_ab:
        doc["gelu_erf_ab"] = ab
    try:
        from fusegraph.engines.registry import REGISTRY

        doc["versions"] = REGISTRY.get("cudnn").library_versions()  # type: ignore[attr-defined]
    except Exception:
        pass
    if args.cold:
        doc["cold_build"] = cold_build(args.cold)
        print(json.dumps(doc["cold_build"]))
    untuned = [r["ratio_untuned"] for r in results if "ratio_untuned" in r]
    tuned = [r["ratio_tuned"] for r in results if "ratio_tuned" in r]
    given = [r["ratio_untuned_given"] for r in results if "ratio_untuned_given" in r]
    if untuned:
        doc["summary"] = {
            "untuned_ge_0.95": f"{sum(x >= 0.95 for x in untuned)}/{len(untuned)}",
            "untuned_outputs_given_ge_0.95": f"{sum(x >= 0.95 for x in given)}/{len(given)}",
            "tuned_ge_1.0": f"{sum(x >= 1.0 for x in tuned)}/{len(tuned)}",
            "geomean_untuned": math.exp(sum(math.log(x) for x in untuned) / len(untuned)),
            "geomean_tuned": math.exp(sum(math.log(x) for x in tuned) / len(tuned)) if tuned else None,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.png:
        try:
            chart(results, args.png)
        except Exception as exc:
            print(f"no chart: {exc}")
    print(table(results, gpu))
    if "summary" in doc:
        print(json.dumps(doc["summary"]))


if __name__ == "__main__":
    main()

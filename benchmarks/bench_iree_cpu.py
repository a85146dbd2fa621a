"""IREE engine vs ONNX Runtime on the CPU, measured side by side in one run.

    python benchmarks/bench_iree_cpu.py            # full suite (batch 1 and 8)
    python benchmarks/bench_iree_cpu.py --quick    # batch 1 only, few repeats
    python benchmarks/bench_iree_cpu.py --flags    # compare compile flag sets (CPU default)

Per case, timed in interleaved rounds (one call of each contender per round; median after
warm-up):
  kernel   IREE: its own VM invoke with device-resident buffers (``context.invoke``);
           ORT: ``run_with_iobinding`` with pre-bound OrtValues.
  e2e      NumPy in, NumPy out: ``plan.execute(numpy pack)`` vs ``session.run``.
  ovh      ``plan.execute`` with fusegraph Buffers in and out, minus IREE's kernel time.
  x        speed ratio ORT time / IREE time (> 1: IREE faster).
Also: cold compile (empty cache, in-process), warm build (disk cache: the in-memory cache
and loaded module dropped, a fresh Graph object), and IREE's dispatch count.

Layouts: IREE gets channels-last activations (NHWC) and filters in HWCF memory order,
the layout its convolutions run in (DESIGN.md); ONNX Runtime gets NCHW activations with
weights and bias as initializers (so it can pre-pack them, its normal deployment). The
results are checked against each other (``err`` = ||iree - ort|| / ||ort||).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import fusegraph as fg
from fusegraph.engines.base import EngineConfig
from fusegraph.graph import layout

# Every distinct convolution of ResNet-50 v1.5 (torchvision), input 224x224:
# (name, C_in, C_out, kernel, stride, H_in)
RESNET50_CONVS = [
    ("stem 7x7/2", 3, 64, 7, 2, 224),
    ("l1 1x1 64-64", 64, 64, 1, 1, 56),
    ("l1 3x3 64-64", 64, 64, 3, 1, 56),
    ("l1 1x1 64-256", 64, 256, 1, 1, 56),
    ("l1 1x1 256-64", 256, 64, 1, 1, 56),
    ("l2 1x1 256-128", 256, 128, 1, 1, 56),
    ("l2 3x3/2 128", 128, 128, 3, 2, 56),
    ("l2 1x1 128-512", 128, 512, 1, 1, 28),
    ("l2 ds 1x1/2 256-512", 256, 512, 1, 2, 56),
    ("l2 1x1 512-128", 512, 128, 1, 1, 28),
    ("l2 3x3 128", 128, 128, 3, 1, 28),
    ("l3 1x1 512-256", 512, 256, 1, 1, 28),
    ("l3 3x3/2 256", 256, 256, 3, 2, 28),
    ("l3 1x1 256-1024", 256, 1024, 1, 1, 14),
    ("l3 ds 1x1/2 512-1024", 512, 1024, 1, 2, 28),
    ("l3 1x1 1024-256", 1024, 256, 1, 1, 14),
    ("l3 3x3 256", 256, 256, 3, 1, 14),
    ("l4 1x1 1024-512", 1024, 512, 1, 1, 14),
    ("l4 3x3/2 512", 512, 512, 3, 2, 14),
    ("l4 1x1 512-2048", 512, 2048, 1, 1, 7),
    ("l4 ds 1x1/2 1024-2048", 1024, 2048, 1, 2, 14),
    ("l4 1x1 2048-512", 2048, 512, 1, 1, 7),
    ("l4 3x3 512", 512, 512, 3, 1, 7),
]
HWCF = (2, 3, 1, 0)  # memory order of a (K, C, R, S) filter stored as R, S, C, K
OPSET = 17


@dataclass
class Case:
    name: str
    group: str
    graph: Callable[[], fg.Graph]
    onnx: Callable[[], tuple[onnx.ModelProto, dict[str, np.ndarray]]]  # model + initializer values
    # graph input name -> how to make the ORT feed from the logical array (None: not fed)
    feeds: dict[str, str | None] = field(default_factory=dict)


# ---- graphs and equivalent ONNX models ----------------------------------------------------------
def conv_case(name: str, n: int, c: int, k: int, r: int, s: int, h: int, *, bias_relu: bool = False) -> Case:
    """(n, c, h, h) input, k filters of r x r, stride s, same padding."""
    pad = (r - 1) // 2
    xdims, wdims = [n, c, h, h], [k, c, r, r]

    def graph() -> fg.Graph:
        g = fg.Graph(f"conv_{name}_n{n}".replace(" ", "_").replace("/", "s"), io_data_type="float")
        x = g.tensor("x", xdims, fg.strides_for(xdims, "NHWC"))
        w = g.tensor("w", wdims, layout.packed_strides(wdims, HWCF))
        y = g.conv_fprop(x, w, padding=[pad, pad], stride=[s, s])
        if bias_relu:
            b = g.tensor("b", [1, k, 1, 1], fg.strides_for([1, k, 1, 1], "NHWC"))
            y = g.relu(g.bias(y, b))
        y.set_output(True).set_name("y")
        return g.validate()

    def model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        ho = (h + 2 * pad - r) // s + 1
        inputs = ["x", "w", "b"] if bias_relu else ["x", "w"]
        nodes = [helper.make_node("Conv", inputs, ["c" if bias_relu else "y"], kernel_shape=[r, r], pads=[pad] * 4, strides=[s, s])]
        if bias_relu:
            nodes.append(helper.make_node("Relu", ["c"], ["y"]))
        g = helper.make_graph(
            nodes, "m",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, xdims)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, k, ho, ho])],
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]), {}

    feeds: dict[str, str | None] = {"x": "x", "w": "init", "b": "init_bias"}
    return Case(f"{name} n{n}", "resnet50" if not bias_relu else "fused", graph, model, feeds)


def gemm_case(m: int) -> Case:
    def graph() -> fg.Graph:
        g = fg.Graph(f"gemm{m}", io_data_type="float")
        g.matmul(g.tensor("a", [m, m]), g.tensor("b", [m, m])).set_output(True).set_name("y")
        return g.validate()

    def model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        g = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["y"])], "m",
            [helper.make_tensor_value_info(v, TensorProto.FLOAT, [m, m]) for v in ("a", "b")],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, m])],
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]), {}

    return Case(f"gemm {m}^3", "gemm", graph, model, {"a": "a", "b": "b"})


def layernorm_case(n: int = 512, d: int = 768) -> Case:
    def graph() -> fg.Graph:
        g = fg.Graph(f"layernorm{n}x{d}", io_data_type="float")
        x, sc, b = g.tensor("x", [n, d]), g.tensor("scale", [1, d]), g.tensor("bias", [1, d])
        y = g.layernorm(x, sc, b, epsilon=1e-5)[0]
        y.set_output(True).set_name("y")
        return g.validate()

    def model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        g = helper.make_graph(
            [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=1, epsilon=1e-5)], "m",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, d])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, d])],
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]), {}

    return Case(f"layernorm {n}x{d}", "fused", graph, model, {"x": "x", "scale": "init_flat", "bias": "init_flat"})


CHAIN_OPS = [("add", "Add"), ("mul", "Mul"), ("relu", "Relu"), ("tanh", "Tanh"), ("sigmoid", "Sigmoid"), ("sub", "Sub")]


def chain_case(shape: tuple[int, int] = (1024, 1024)) -> Case:
    def graph() -> fg.Graph:
        g = fg.Graph(f"chain6_{shape[0]}x{shape[1]}", io_data_type="float")
        a, b = g.tensor("a", list(shape)), g.tensor("b", list(shape))
        y = g.add(a, b)
        y = g.mul(y, b)
        y = g.relu(y)
        y = g.tanh(y)
        y = g.sigmoid(y)
        y = g.sub(y, a)
        y.set_output(True).set_name("y")
        return g.validate()

    def model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        nodes = [
            helper.make_node("Add", ["a", "b"], ["t1"]),
            helper.make_node("Mul", ["t1", "b"], ["t2"]),
            helper.make_node("Relu", ["t2"], ["t3"]),
            helper.make_node("Tanh", ["t3"], ["t4"]),
            helper.make_node("Sigmoid", ["t4"], ["t5"]),
            helper.make_node("Sub", ["t5", "a"], ["y"]),
        ]
        g = helper.make_graph(
            nodes, "m",
            [helper.make_tensor_value_info(v, TensorProto.FLOAT, list(shape)) for v in ("a", "b")],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]), {}

    return Case(f"6-op chain {shape[0]}x{shape[1]}", "fused", graph, model, {"a": "a", "b": "b"})


def build_cases(batches: list[int], gemms: list[int]) -> list[Case]:
    cases = [conv_case(name, n, c, k, r, s, h) for n in batches for name, c, k, r, s, h in RESNET50_CONVS]
    cases.append(conv_case("conv3x3+bias+relu 64", 1, 64, 64, 3, 1, 56, bias_relu=True))
    cases += [gemm_case(m) for m in gemms]
    cases += [layernorm_case(), chain_case()]
    return cases


# ---- running one case ---------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    group: str
    note: str = ""
    iree_kernel: float = math.nan
    ort_kernel: float = math.nan
    iree_e2e: float = math.nan
    ort_e2e: float = math.nan
    iree_exec_buf: float = math.nan
    iree_kernel_best: float = math.nan
    ort_kernel_best: float = math.nan
    cold_compile: float = math.nan
    warm_build: float = math.nan
    dispatches: int = -1
    err: float = math.nan

    @property
    def kx(self) -> float:
        return self.ort_kernel / self.iree_kernel

    @property
    def kx_best(self) -> float:
        return self.ort_kernel_best / self.iree_kernel_best

    @property
    def ex(self) -> float:
        return self.ort_e2e / self.iree_e2e

    @property
    def overhead_us(self) -> float:
        return (self.iree_exec_buf - self.iree_kernel) * 1e6


def _median_interleaved(
    fns: list[Callable[[], Any]], repeats: int, warmup: int, budget_s: float, block: int = 3
) -> list[float]:
    """Rounds of short blocks, one block per contender: the first call of each block is
    untimed (it absorbs the hand-over, e.g. the other library's worker threads still
    spinning on 2 cores), the next ``block`` calls are timed. Medians over all rounds."""
    for _ in range(warmup):
        for f in fns:
            f()
    times: list[list[float]] = [[] for _ in fns]
    t_end = time.perf_counter() + budget_s
    for i in range(max(1, repeats // block)):
        for f, ts in zip(fns, times, strict=True):
            f()
            for _ in range(block):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    _LAST_MINS[:] = [min(ts) for ts in times]
    return [statistics.median(ts) for ts in times]


_LAST_MINS: list[float] = []


def run_case(case: Case, rng: np.random.Generator, repeats: int, warmup: int, knobs: tuple[tuple[str, Any], ...], budget_s: float) -> Result:
    from fusegraph.engines.iree import IreeEngine
    from fusegraph.engines.iree.cache import clear_memory
    from fusegraph.engines.iree.runtime import runtime_for

    res = Result(case.name, case.group)
    h = fg.Handle("cpu")
    engine = IreeEngine()
    g = case.graph()
    config = EngineConfig("iree", knobs)
    sup = engine.supports(g, h)
    if not sup:
        res.note = f"IREE n/a: {sup.reason[:60]}"
        return res
    t0 = time.perf_counter()
    try:
        plan = engine.build(g, h, config)
    except fg.FusegraphError as exc:
        res.note = f"IREE failed: {str(exc).splitlines()[0][:60]}"
        return res
    res.cold_compile = time.perf_counter() - t0 if plan.entry.source == "compiled" else math.nan
    res.dispatches = plan.dispatch_count
    # warm build: disk cache only (memory cache and the loaded module dropped, fresh Graph)
    clear_memory()
    runtime_for(h).forget(plan.key)
    g2 = case.graph()
    t0 = time.perf_counter()
    plan2 = engine.build(g2, h, config)
    res.warm_build = time.perf_counter() - t0
    assert plan2.entry.source == "disk", plan2.entry.source

    logical = {}
    for t in g.inputs():
        scale = 1.0 / math.sqrt(max(1, int(np.prod(t.shape[1:])))) if t.name == "w" else 1.0
        logical[t.name] = (rng.standard_normal(t.shape) * scale).astype(np.float32)
    pack = {t.name: layout.from_physical(layout.to_physical(logical[t.name], t.shape, t.strides), t.shape, t.strides) for t in g.inputs()}
    bufs = {n: fg.Buffer.from_numpy(a, h, g.tensor_by_name(n)) for n, a in pack.items()}

    # ORT session: weights/bias as initializers, NCHW activations
    model, _ = case.onnx()
    model.ir_version = min(model.ir_version, 9)  # the onnx package may be newer than ORT
    feeds = {}
    for name, how in case.feeds.items():
        if name not in logical:
            continue
        if how == "init":
            model.graph.initializer.append(numpy_helper.from_array(logical[name], name))
        elif how == "init_bias" or how == "init_flat":
            model.graph.initializer.append(numpy_helper.from_array(logical[name].reshape(-1), name))
        else:
            feeds[name] = np.ascontiguousarray(logical[name])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ort_out = sess.run(None, feeds)[0]
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(np.empty_like(ort_out)))

    iree_out = plan.execute(pack)["y"]
    res.err = float(np.linalg.norm(iree_out.astype(np.float64) - ort_out) / np.linalg.norm(ort_out))

    import iree.runtime as rt

    loaded = plan.loaded
    args = rt.VmVariantList(len(plan.inputs))
    for s in plan.inputs:
        args.push_ref(bufs[s.name].view)
    n_out = len(plan.outputs)
    ctx_invoke, fn = loaded.context.invoke, loaded.function

    def iree_kernel() -> None:
        ctx_invoke(fn, args, rt.VmVariantList(n_out))

    buf_pack = dict(bufs)

    def iree_exec_buf() -> None:
        plan.execute(buf_pack)

    def iree_e2e() -> None:
        plan.execute(pack)

    def ort_kernel() -> None:
        sess.run_with_iobinding(binding)

    def ort_e2e() -> None:
        sess.run(None, feeds)

    (res.iree_kernel, res.ort_kernel, res.iree_exec_buf, res.iree_e2e, res.ort_e2e) = _median_interleaved(
        [iree_kernel, ort_kernel, iree_exec_buf, iree_e2e, ort_e2e], repeats, warmup, budget_s
    )
    res.iree_kernel_best, res.ort_kernel_best = _LAST_MINS[0], _LAST_MINS[1]
    return res


# ---- reporting ------------------------------------------------------------------------------------
def _ms(v: float) -> str:
    return "   -   " if math.isnan(v) else f"{v * 1e3:7.3f}"


def print_table(results: list[Result]) -> None:
    head = (
        f"{'case':30s} {'IREE k ms':>9s} {'ORT k ms':>9s} {'k x':>5s} {'best x':>6s} {'IREE e2e':>9s} {'ORT e2e':>9s} "
        f"{'e2e x':>5s} {'ovh us':>6s} {'cold s':>6s} {'warm ms':>7s} {'disp':>4s} {'err':>7s}"
    )
    print(head)
    print("-" * len(head))
    group = None
    for r in results:
        if r.group != group:
            group = r.group
        if r.note:
            print(f"{r.name:30s} {r.note}")
            continue
        print(
            f"{r.name:30s} {_ms(r.iree_kernel):>9s} {_ms(r.ort_kernel):>9s} {r.kx:5.2f} {r.kx_best:6.2f} {_ms(r.iree_e2e):>9s} "
            f"{_ms(r.ort_e2e):>9s} {r.ex:5.2f} {r.overhead_us:6.1f} {r.cold_compile:6.2f} "
            f"{r.warm_build * 1e3:7.2f} {r.dispatches:4d} {r.err:7.1e}"
        )


def print_summary(results: list[Result]) -> None:
    ok = [r for r in results if not r.note]
    b1 = [r for r in ok if r.group == "resnet50" and r.name.endswith(" n1")]
    fused = [r for r in ok if r.group == "fused"]
    colds = [r.cold_compile for r in ok if not math.isnan(r.cold_compile)]
    print()
    print("targets (reported, not asserted):")
    if b1:
        worst = min(b1, key=lambda r: r.kx)
        print(
            f"  ResNet-50 convs, batch 1: kernel speed vs ORT min {worst.kx:.2f}x ({worst.name}), "
            f"geomean {_geomean([r.kx for r in b1]):.2f}x; {sum(r.kx >= 0.9 for r in b1)}/{len(b1)} at >= 0.9x "
            f"(best-of-runs: geomean {_geomean([r.kx_best for r in b1]):.2f}x, {sum(r.kx_best >= 0.9 for r in b1)}/{len(b1)} at >= 0.9x) "
            f"(e2e: min {min(r.ex for r in b1):.2f}x, {sum(r.ex >= 0.9 for r in b1)}/{len(b1)} at >= 0.9x)"
        )
    b8 = [r for r in ok if r.group == "resnet50" and r.name.endswith(" n8")]
    if b8:
        print(f"  ResNet-50 convs, batch 8: kernel geomean {_geomean([r.kx for r in b8]):.2f}x, min {min(r.kx for r in b8):.2f}x")
    for r in fused:
        print(f"  {r.name}: kernel {r.kx:.2f}x, e2e {r.ex:.2f}x vs ORT (target >= 1.2x on fused chains), {r.dispatches} dispatch(es)")
    if colds:
        print(f"  cold compile: median {statistics.median(colds):.3f} s, max {max(colds):.3f} s (target median <= 0.5 s)")
    warm = [r.warm_build for r in ok]
    if warm:
        print(f"  warm build from disk cache: median {statistics.median(warm) * 1e3:.2f} ms, max {max(warm) * 1e3:.2f} ms (target <= 10 ms)")
    ovh = [r.overhead_us for r in ok]
    if ovh:
        print(f"  execute(Buffers) minus invoke, per case: median {statistics.median(ovh):.1f} us (kernel-time noise; see the overhead study below)")


def overhead_study(repeats: int = 3000) -> None:
    """Per-call cost of ``execute`` over IREE's own invoke, on a graph whose kernel is tiny
    (so that the difference is not lost in kernel-time noise)."""
    import iree.runtime as rt

    from fusegraph.engines.iree import IreeEngine

    h = fg.Handle("cpu")
    g = fg.Graph("overhead", io_data_type="float")
    a, b = g.tensor("a", [16, 16]), g.tensor("b", [16, 16])
    g.relu(g.add(a, b)).set_output(True).set_name("y")
    g.validate()
    plan = IreeEngine().build(g, h)
    rng = np.random.default_rng(1)
    A, B = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))
    bA, bB = fg.Buffer.from_numpy(A, h), fg.Buffer.from_numpy(B, h)
    args = rt.VmVariantList(2)
    args.push_ref(bA.view)
    args.push_ref(bB.view)
    invoke, fn = plan.loaded.context.invoke, plan.loaded.function
    pack_buf, pack_np = {a: bA, b: bB}, {"a": A, "b": B}

    def kernel() -> None:
        invoke(fn, args, rt.VmVariantList(1))

    fns = [kernel, lambda: plan.execute(pack_buf), lambda: plan.run_buffers([bA, bB]), lambda: plan.execute(pack_np)]
    med = _median_interleaved(fns, repeats, 50, budget_s=20.0, block=20)
    # fusegraph's own per-call work: the same execute with IREE's invoke replaced by a stub
    canned = rt.VmVariantList(1)
    invoke(fn, args, canned)
    real = plan._invoke
    plan._invoke = lambda _f, _a, r: r.push_ref(canned.get_as_object(0, rt.HalBufferView))
    try:
        (stub,) = _median_interleaved([lambda: plan.execute(pack_buf)], repeats, 50, budget_s=10.0, block=20)
    finally:
        plan._invoke = real
    print("\nper-call overhead on a 16x16 add+relu graph (median of interleaved calls):")
    print(f"  IREE invoke (kernel) {med[0] * 1e6:7.1f} us")
    print(f"  execute(Buffers)     {med[1] * 1e6:7.1f} us  -> overhead {(med[1] - med[0]) * 1e6:5.1f} us (target <= 50 us)")
    print(f"  run_buffers          {med[2] * 1e6:7.1f} us  -> overhead {(med[2] - med[0]) * 1e6:5.1f} us")
    print(f"  execute(NumPy)       {med[3] * 1e6:7.1f} us  -> overhead {(med[3] - med[0]) * 1e6:5.1f} us")
    print(f"  execute(Buffers) with IREE's invoke stubbed out: {stub * 1e6:5.1f} us (fusegraph's own work)")


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


FLAG_SETS: dict[str, tuple[tuple[str, Any], ...]] = {
    "O2": (("opt_level", "O2"), ("data_tiling", False)),
    "O2+dt": (("opt_level", "O2"), ("data_tiling", True)),
    "O2+dt+uk:mmt4d": (("opt_level", "O2"), ("data_tiling", True), ("ukernels", "mmt4d")),
    "O2+dt+uk:all": (("opt_level", "O2"), ("data_tiling", True), ("ukernels", "all")),
    "O3+dt": (("opt_level", "O3"), ("data_tiling", True)),
    "O2+uk:none": (("opt_level", "O2"), ("data_tiling", False), ("ukernels", "none")),
    "O1+dt": (("opt_level", "O1"), ("data_tiling", True)),
}


def flag_study(rng: np.random.Generator, repeats: int, warmup: int) -> None:
    from tqdm import tqdm

    picks = ["stem 7x7/2", "l1 3x3 64-64", "l1 1x1 64-256", "l2 3x3/2 128", "l3 1x1 1024-256", "l3 3x3 256", "l4 3x3 512", "l4 1x1 512-2048"]
    cases = [conv_case(n, 1, c, k, r, s, h) for n, c, k, r, s, h in RESNET50_CONVS if n in picks]
    cases += [conv_case("conv3x3+bias+relu 64", 1, 64, 64, 3, 1, 56, bias_relu=True), gemm_case(256), gemm_case(1024), layernorm_case(), chain_case()]
    table: dict[str, dict[str, Result]] = {}
    for fs, knobs in tqdm(FLAG_SETS.items(), desc="flag sets", file=sys.stderr):
        table[fs] = {c.name: run_case(c, rng, repeats, warmup, knobs, budget_s=2.0) for c in cases}
    names = [c.name for c in cases]
    print(f"{'case':28s} " + " ".join(f"{fs:>14s}" for fs in FLAG_SETS) + "   (IREE kernel ms median/best; ORT kernel ms median)")
    for n in names:
        row = []
        for fs in FLAG_SETS:
            r = table[fs][n]
            row.append(f"{'n/a':>14s}" if r.note else f"{r.iree_kernel * 1e3:7.3f}/{r.iree_kernel_best * 1e3:6.3f}")
        ort_k = statistics.median([table[fs][n].ort_kernel for fs in FLAG_SETS if not table[fs][n].note] or [math.nan])
        print(f"{n:28s} " + " ".join(row) + f"   ORT {ort_k * 1e3:.3f}")
    print(f"{'geomean speed vs ORT':28s} " + " ".join(
        f"{_geomean([r.kx for r in table[fs].values() if not r.note]):14.2f}" for fs in FLAG_SETS))
    print(f"{'geomean best-of vs ORT':28s} " + " ".join(
        f"{_geomean([r.kx_best for r in table[fs].values() if not r.note]):14.2f}" for fs in FLAG_SETS))
    print(f"{'median cold compile s':28s} " + " ".join(
        f"{statistics.median([r.cold_compile for r in table[fs].values() if not r.note]):14.2f}" for fs in FLAG_SETS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1 only, few repeats")
    ap.add_argument("--flags", action="store_true", help="compare flag sets instead of the full suite")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cache-dir", default=None, help="compile cache (default: a fresh temp dir, so compiles are cold)")
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--overhead", action="store_true", help="only the per-call overhead study")
    args = ap.parse_args()
    os.environ["FUSEGRAPH_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="fusegraph-bench-")
    os.environ.pop("FUSEGRAPH_CACHE", None)
    rng = np.random.default_rng(0)
    repeats = args.repeats or (15 if args.quick else 40)
    warmup = 3
    print(f"# fusegraph {fg.__version__}, IREE engine vs ONNX Runtime {ort.__version__} on CPU ({os.cpu_count()} cores); "
          f"median of <= {repeats} timed calls in interleaved blocks after {warmup} warm-up; "
          f"load average at start {os.getloadavg()[0]:.1f}")
    if args.flags:
        flag_study(rng, repeats, warmup)
        return 0
    if args.overhead:
        overhead_study()
        return 0
    from fusegraph.engines.iree.flags import DEFAULTS

    print(f"# IREE CPU default flags: {DEFAULTS['cpu']}")
    from tqdm import tqdm

    cases = build_cases([1] if args.quick else [1, 8], [256, 512, 1024, 2048])
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    results = []
    for case in tqdm(cases, desc="cases", file=sys.stderr):
        results.append(run_case(case, rng, repeats, warmup, (), budget_s=3.0 if args.quick else 6.0))
    print_table(results)
    print_summary(results)
    overhead_study(1000 if args.quick else 3000)
    print(f"# load average at end {os.getloadavg()[0]:.1f} (the machine is shared: medians move with it; 'best x' is the ratio of best-of-run times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The IREE engine on an NVIDIA GPU (CUDA, sm_80 PTX run on the H200): every op class
against the float64 reference, device-resident Buffers, DLPack from PyTorch, and an
artifact compiled for CUDA. Run on the GPU machine: ``pytest -m gpu tests/test_iree_gpu.py``.

An op class the emitter cannot lower yet is skipped with the emitter's own reason (a
missing observation, not a pass). The per-case bodies live in ``check_case`` so that they
can be dry-run on the CPU (``python tests/test_iree_gpu.py --cpu``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType, PoolingMode, ReductionMode
from fusegraph.graph import layout
from fusegraph.reference.executor import run_reference

pytestmark = pytest.mark.gpu

F32, F16, BF16 = DataType.FLOAT, DataType.HALF, DataType.BFLOAT16
# ||out - ref|| / ||ref|| bounds (project tolerances; norms 1e-4 in f32). The reference is
# float64 rounded once to the output type; f16/bf16 graphs compute in f32.
TOL = {
    "default": {F32: 1e-5, F16: 1e-2, BF16: 2e-2},
    "norm": {F32: 1e-4, F16: 1e-2, BF16: 2e-2},
}


def _dt(name: str) -> DataType:
    return {"f32": F32, "f16": F16, "bf16": BF16}[name]


# ---- graph builders: one per op class -----------------------------------------------------------
def g_pointwise(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_pointwise", io_data_type=dt, compute_data_type=F32)
    d = [4, 32, 16, 16]
    a, b = g.tensor("a", d, fg.strides_for(d, lay)), g.tensor("b", [1, 32, 1, 1], fg.strides_for([1, 32, 1, 1], lay))
    y = g.sigmoid(g.tanh(g.mul(g.relu(g.add(a, b)), b)))
    g.gelu(y).set_output(True).set_name("y")
    return g.validate()


def g_matmul(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_matmul", io_data_type=dt, compute_data_type=F32)
    a, b = g.tensor("a", [2, 96, 64]), g.tensor("b", [2, 64, 80])
    g.matmul(a, b).set_output(True).set_name("y")
    return g.validate()


def g_conv(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_conv_bias_relu", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [2, 16, 14, 14], fg.strides_for([2, 16, 14, 14], lay))
    w = g.tensor("w", [32, 16, 3, 3], fg.strides_for([32, 16, 3, 3], "KRSC" if lay == "NHWC" else "KCRS"))
    b = g.tensor("b", [1, 32, 1, 1], fg.strides_for([1, 32, 1, 1], lay))
    g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1], stride=[2, 2]), b)).set_output(True).set_name("y")
    return g.validate()


def g_conv_dgrad(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_conv_dgrad", io_data_type=dt, compute_data_type=F32)
    dy = g.tensor("dy", [2, 8, 7, 7], fg.strides_for([2, 8, 7, 7], lay))
    w = g.tensor("w", [8, 4, 3, 3], fg.strides_for([8, 4, 3, 3], "KRSC" if lay == "NHWC" else "KCRS"))
    dx = g.conv_dgrad(dy, w, padding=[1, 1], stride=[2, 2])
    dx.set_dim([2, 4, 14, 14]).set_stride(fg.strides_for([2, 4, 14, 14], lay)).set_output(True).set_name("y")
    return g.validate()


def g_conv_wgrad(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_conv_wgrad", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [2, 4, 14, 14], fg.strides_for([2, 4, 14, 14], lay))
    dy = g.tensor("dy", [2, 8, 14, 14], fg.strides_for([2, 8, 14, 14], lay))
    dw = g.conv_wgrad(x, dy, padding=[1, 1])
    dw.set_dim([8, 4, 3, 3]).set_output(True).set_name("y")
    return g.validate()


def g_reduction(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_reduction", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [4, 32, 8, 8], fg.strides_for([4, 32, 8, 8], lay))
    g.reduction(x, ReductionMode.SUM, axes=[2, 3]).set_output(True).set_name("y")
    return g.validate()


def g_batchnorm(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_batchnorm_inference", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [4, 16, 8, 8], fg.strides_for([4, 16, 8, 8], lay))
    p = [g.tensor(n, [1, 16, 1, 1], fg.strides_for([1, 16, 1, 1], lay)) for n in ("scale", "bias", "mean", "var")]
    g.batchnorm_inference(x, *p, epsilon=1e-5).set_output(True).set_name("y")
    return g.validate()


def g_layernorm(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_layernorm", io_data_type=dt, compute_data_type=F32)
    x, s, b = g.tensor("x", [64, 256]), g.tensor("s", [1, 256]), g.tensor("b", [1, 256])
    g.layernorm(x, s, b, epsilon=1e-5)[0].set_output(True).set_name("y")
    return g.validate()


def g_rmsnorm(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_rmsnorm", io_data_type=dt, compute_data_type=F32)
    x, s = g.tensor("x", [64, 256]), g.tensor("s", [1, 256])
    g.rmsnorm(x, s, epsilon=1e-5)[0].set_output(True).set_name("y")
    return g.validate()


def g_pooling(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_pooling", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [2, 16, 12, 12], fg.strides_for([2, 16, 12, 12], lay))
    g.pooling(x, PoolingMode.MAX, window=[3, 3], stride=[2, 2], padding=[1, 1]).set_output(True).set_name("y")
    return g.validate()


def g_softmax(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_softmax", io_data_type=dt, compute_data_type=F32)
    g.softmax(g.tensor("x", [32, 512]), axis=-1).set_output(True).set_name("y")
    return g.validate()


def g_sdpa(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_sdpa", io_data_type=dt, compute_data_type=F32)
    q, k, v = (g.tensor(n, [2, 4, 64, 32]) for n in ("q", "k", "v"))
    g.sdpa(q, k, v, causal=True).set_output(True).set_name("y")
    return g.validate()


def g_data_movement(dt: DataType, lay: str) -> fg.Graph:
    g = fg.Graph("gpu_data_movement", io_data_type=dt)
    a, b = g.tensor("a", [4, 6, 8]), g.tensor("b", [4, 6, 8])
    c = g.concatenate([g.transpose(a, [0, 2, 1]), g.transpose(b, [0, 2, 1])], axis=2)
    s = g.slice(c, starts=[1], ends=[7], axes=[1])
    g.reshape(s, [4, 72]).set_output(True).set_name("y")
    return g.validate()


CASES: dict[str, tuple[Callable[[DataType, str], fg.Graph], str]] = {
    "pointwise": (g_pointwise, "default"),
    "matmul": (g_matmul, "default"),
    "conv_fprop+bias+relu": (g_conv, "default"),
    "conv_dgrad": (g_conv_dgrad, "default"),
    "conv_wgrad": (g_conv_wgrad, "default"),
    "reduction": (g_reduction, "default"),
    "batchnorm_inference": (g_batchnorm, "norm"),
    "layernorm": (g_layernorm, "norm"),
    "rmsnorm": (g_rmsnorm, "norm"),
    "pooling": (g_pooling, "default"),
    "softmax": (g_softmax, "norm"),
    "sdpa": (g_sdpa, "norm"),
    "data_movement": (g_data_movement, "default"),
}


def random_pack(g: fg.Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    pack = {}
    for t in g.inputs():
        vals = rng.standard_normal(t.shape)
        if t.name == "var":
            vals = np.abs(vals) + 0.5
        phys = layout.to_physical(vals.astype(t.dtype.numpy), t.shape, t.strides)
        view = layout.from_physical(phys, t.shape, t.strides)
        pack[t.name] = np.broadcast_to(view, t.shape) if view.shape != t.shape else view
    return pack


def check_case(handle: fg.Handle, case: str, dt: DataType, lay: str, rng: np.random.Generator) -> None:
    """Builds the case's graph on ``handle``, runs it with NumPy and with Buffers, and
    compares both against the reference."""
    from fusegraph.engines.iree import IreeEngine

    build, tol_kind = CASES[case]
    g = build(dt, lay)
    engine = IreeEngine()
    sup = engine.supports(g, handle)
    if not sup:
        pytest.skip(f"IREE engine cannot run {case} on {handle.device}: {sup.reason}")
    plan = engine.build(g, handle)
    pack = random_pack(g, rng)
    ref = run_reference(g, pack)["y"]
    tol = TOL[tol_kind][dt]
    out = plan.execute(pack)["y"]
    _assert_close(out, ref, tol, f"{case} {dt.name} {lay} (numpy)")
    bufs = {n: fg.Buffer.from_numpy(a, handle, g.tensor_by_name(n)) for n, a in pack.items()}
    bout = plan.execute(bufs)["y"]
    assert isinstance(bout, fg.Buffer) and bout.device == str(handle.device)
    _assert_close(bout.to_numpy(), ref, tol, f"{case} {dt.name} {lay} (Buffers)")


def _assert_close(out: Any, ref: np.ndarray, tol: float, what: str) -> None:
    o, r = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, what
    assert not np.isnan(o).any(), f"{what}: NaN"
    rel = np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)
    assert rel <= tol, f"{what}: relative error {rel:.3g} > {tol} (max abs {np.max(np.abs(o - r)):.3g})"


# ---- tests (GPU) -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda() -> fg.Handle:
    return fg.Handle("cuda")


@pytest.fixture(autouse=True)
def _cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    if "FUSEGRAPH_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "iree-gpu-cache"))


@pytest.mark.parametrize("lay", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_class_on_cuda(case: str, dt: str, lay: str, cuda: fg.Handle, rng: np.random.Generator) -> None:
    if lay == "NHWC" and case in ("matmul", "layernorm", "rmsnorm", "softmax", "sdpa", "data_movement"):
        pytest.skip("no channels in this op class: the NHWC variant is the NCHW one")
    check_case(cuda, case, _dt(dt), lay, rng)


def test_engine_supports_cuda_and_targets_sm80(cuda: fg.Handle) -> None:
    from fusegraph.engines.iree import IreeEngine

    g = g_pointwise(F32, "NCHW")
    assert IreeEngine().supports(g, cuda)
    plan = IreeEngine().build(g, cuda)
    assert "--iree-cuda-target=sm_80" in plan.describe()["flags"]
    assert plan.dispatch_count == 1, plan.statistics  # the pointwise chain fuses on the GPU too


def test_buffers_stay_on_the_gpu(cuda: fg.Handle, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    from fusegraph.engines.iree import IreeEngine
    from fusegraph.engines.iree.runtime import runtime_for

    g = g_pointwise(F32, "NCHW")
    plan = IreeEngine().build(g, cuda)
    pack = random_pack(g, rng)
    bufs = {n: fg.Buffer.from_numpy(a, cuda, g.tensor_by_name(n)) for n, a in pack.items()}
    rt = runtime_for(cuda)

    def fail(*_a: Any, **_k: Any) -> None:
        raise AssertionError("host round trip")

    with monkeypatch.context() as m:
        m.setattr(rt, "upload", fail)
        m.setattr(rt, "download", fail)
        y = plan.execute(bufs)["y"]
        y2 = plan.execute({"a": y, "b": bufs["b"]})["y"]
    ref = run_reference(g, pack)["y"]
    ref2 = run_reference(g, {"a": ref.astype(np.float32), "b": pack["b"]})["y"]
    _assert_close(y2.to_numpy(), ref2, 1e-5, "chained on device")


def test_dlpack_from_torch_cuda(cuda: fg.Handle, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch", reason="the GPU machine's PyTorch provides CUDA tensors for DLPack")
    from fusegraph.engines.iree import IreeEngine

    g = g_matmul(F32, "NCHW")
    plan = IreeEngine().build(g, cuda)
    pack = random_pack(g, rng)
    ta, tb = (torch.from_numpy(np.ascontiguousarray(pack[n])).cuda() for n in ("a", "b"))
    torch.cuda.synchronize()
    out = plan.execute({"a": fg.Buffer.from_dlpack(ta, cuda), "b": fg.Buffer.from_dlpack(tb, cuda)})["y"]
    _assert_close(out.to_numpy(), run_reference(g, pack)["y"], 1e-5, "DLPack torch CUDA")


def test_cuda_artifact_compiled_then_loaded(cuda: fg.Handle, rng: np.random.Generator) -> None:
    from fusegraph.engines.iree import compile_to_artifact, load_artifact

    g = g_conv(F16, "NHWC")
    data = compile_to_artifact(g, "cuda")
    plan = load_artifact(data, cuda)
    pack = random_pack(g, rng)
    _assert_close(plan.execute(pack)["y"], run_reference(g, pack)["y"], 1e-2, "artifact")


if __name__ == "__main__":  # dry run of the case bodies on the CPU (no pytest runner)
    if "--cpu" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        h = fg.Handle("cpu")
        for c in CASES:
            for d in ("f32", "f16", "bf16"):
                for lay_ in ("NCHW", "NHWC"):
                    try:
                        check_case(h, c, _dt(d), lay_, np.random.default_rng(0))
                        print(f"ok    {c} {d} {lay_}")
                    except BaseException as exc:  # report and continue
                        print(f"FAIL  {c} {d} {lay_}: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")

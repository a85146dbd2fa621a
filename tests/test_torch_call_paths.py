"""The torch plan's call paths: the compiled function (Inductor without Dynamo), the lean
call for torch tensors, the CUDA-graph rule and native f16/bf16 pointwise kernels on a
GPU -- each checked against the float64 reference on fresh random data."""

from __future__ import annotations

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.select.autotune import compare, random_inputs, tolerance

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines import torch as torch_engine  # noqa: E402
from fusegraph.engines.torch.context import _Ctx  # noqa: E402
from fusegraph.engines.torch.cuda_graph import worth_capturing  # noqa: E402

CPU = fg.Handle("cpu")
ENGINE = torch_engine.TorchEngine()
COMPILED = EngineConfig("torch", (("compile", True),))


def _chain(dt: DT = DT.FLOAT, x_layout: str = "row_major", broadcast_b: bool = False) -> fg.Graph:
    g = fg.Graph("chain", io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    dims = [2, 3, 4, 5]
    x = g.tensor("x", dims, fg.strides_for(dims, "NHWC" if x_layout == "NHWC" else "row_major"))
    b = g.tensor("b", dims, [0, 1, 0, 0]) if broadcast_b else g.tensor("b", [1, 3, 1, 1])
    y = g.relu(g.mul(g.tanh(g.add(x, b)), g.scalar(1.5)))
    y.set_output(True).set_name("y")
    return g.validate()


def _check(g: fg.Graph, out: dict[str, object], pack: dict[str, np.ndarray]) -> None:
    ref = g.execute(pack, engine="reference")
    host = {k: (v.detach().float().cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    err, why = compare(g, host, ref)
    assert not why and err <= tolerance(g), f"rel err {err:.2e} > {tolerance(g):.0e} {why}"


def _compile_support() -> None:
    if not ENGINE.compile_support(CPU):
        pytest.skip(f"torch.compile unavailable here: {ENGINE.compile_support(CPU).reason}")


@pytest.mark.slow
@pytest.mark.parametrize("x_layout", ["row_major", "NHWC"])
def test_compiled_plan_matches_the_reference_in_any_input_layout(rng: np.random.Generator, x_layout: str) -> None:
    """The compiled function is specialized to the declared strides; NumPy arrays and torch
    tensors in other strides are laid out first, tensors in the declared ones go through
    the lean call; every way gives the reference's numbers."""
    _compile_support()
    g = _chain(x_layout=x_layout)
    plan = ENGINE.build(g, CPU, COMPILED)
    assert plan._positional is not None  # type: ignore[attr-defined]
    pack = random_inputs(g, rng)
    _check(g, plan.execute(pack), pack)
    xt = torch.from_numpy(np.ascontiguousarray(pack["x"]))  # row-major whatever was declared
    bt = torch.from_numpy(np.ascontiguousarray(pack["b"]))
    _check(g, plan.execute({"x": xt, "b": bt}), pack)
    declared = torch.empty_strided(xt.shape, g.inputs()[0].strides, dtype=xt.dtype).copy_(xt)
    lean = plan._run_lean({"x": declared, "b": bt})  # type: ignore[attr-defined]
    assert lean is not None and isinstance(lean["y"], torch.Tensor)
    _check(g, lean, pack)


@pytest.mark.slow
def test_compiled_plan_takes_a_declared_broadcast_input(rng: np.random.Generator) -> None:
    """An input declared as a broadcast view (stride 0) is compiled densely: a dense tensor
    holding the same values and an expanded view both give the reference's numbers."""
    _compile_support()
    g = _chain(broadcast_b=True)
    plan = ENGINE.build(g, CPU, COMPILED)
    pack = random_inputs(g, rng)
    _check(g, plan.execute(pack), pack)
    row = torch.from_numpy(np.ascontiguousarray(pack["b"][:1, :, :1, :1]))
    expanded = row.expand(*pack["b"].shape)
    _check(g, plan.execute({"x": torch.from_numpy(np.ascontiguousarray(pack["x"])), "b": expanded}), pack)


def test_lean_call_returns_tensors_and_leaves_irregular_packs_to_the_general_path(rng: np.random.Generator) -> None:
    g = _chain()
    plan = ENGINE.build(g, CPU)
    pack = random_inputs(g, rng)
    tens = {k: torch.from_numpy(v) for k, v in pack.items()}
    out = plan._run_lean(tens)  # type: ignore[attr-defined]
    assert out is not None and isinstance(out["y"], torch.Tensor)
    _check(g, out, pack)
    assert plan._run_lean(pack) is None  # type: ignore[attr-defined]  # NumPy: the general path
    assert plan._run_lean({**tens, "y": torch.empty(2, 3, 4, 5)}) is None  # type: ignore[attr-defined]  # outputs given
    grad = {**tens, "x": tens["x"].clone().requires_grad_()}
    assert plan._run_lean(grad) is None  # type: ignore[attr-defined]
    with pytest.raises(fg.errors.VariantPackError, match="requires_grad"):  # would come back detached
        plan.execute(grad)
    with torch.no_grad():  # no gradients recorded: runs
        _check(g, plan.execute(grad), pack)
    with pytest.raises(fg.errors.VariantPackError, match="'x'"):
        plan.execute({**tens, "x": tens["x"].double()})  # the general path names the tensor


def test_cuda_graph_rule_captures_launch_bound_plans_only() -> None:
    small = _chain()  # 4 nodes over tiny tensors
    assert worth_capturing(small, small.inputs())
    one = fg.Graph("one", io_data_type=DT.HALF)
    one.relu(one.tensor("x", [64, 64])).set_output(True)
    one.validate()
    assert not worth_capturing(one, one.inputs())  # one kernel: the copies cost more than the launch
    big = fg.Graph("big", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT)
    a, b = big.tensor("a", [8192, 4096]), big.tensor("b", [8192, 4096])
    big.relu(big.tanh(big.mul(big.add(a, b), a))).set_output(True)
    big.validate()
    assert not worth_capturing(big, big.inputs())  # 64 MiB operands: the copies dominate


def test_native_narrow_pointwise_is_chosen_only_where_the_rounding_is_the_same() -> None:
    g = fg.Graph("n", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    x = g.tensor("x", [8, 8])
    inner = g.tanh(g.add(x, x))  # a FLOAT intermediate: stays in f32
    out = g.relu(g.tanh_backward(inner, x))  # several kernels in torch: stays in f32
    out.set_output(True)
    last = g.relu(g.tensor("z", [8, 8]))  # f16 in, f16 out, one kernel: native
    last.set_output(True)
    g.validate()
    gpu = _Ctx(g, fg.Handle("cuda:0"), EngineConfig("torch"))
    by_out = {id(n): n.outputs["y"] for n in g.nodes}
    native = {by_out[i].name for i in gpu.native}
    assert native == {last.name}, native
    assert not _Ctx(g, CPU, EngineConfig("torch")).native  # the CPU keeps f32 compute


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16])
def test_gpu_native_pointwise_and_lean_call_match_the_reference(rng: np.random.Generator, dt: DT) -> None:
    g = fg.Graph("n", io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    x, z = g.tensor("x", [64, 64]), g.tensor("z", [64, 64])
    g.gelu(g.add(x, z)).set_output(True).set_name("y")
    g.validate()
    plan = ENGINE.build(g, fg.Handle("cuda:0"))
    pack = random_inputs(g, rng)
    dev = {k: torch.from_numpy(v.astype(np.float32)).to("cuda", dtype=torch_engine.torch_dtype(dt)) for k, v in pack.items()}
    out = plan._run_lean(dev)  # type: ignore[attr-defined]
    assert out is not None and out["y"].device.type == "cuda" and not plan.describe()["cuda_graph"]
    _check(g, out, pack)
    _check(g, {"y": plan.execute(pack)["y"]}, pack)


@pytest.mark.gpu
def test_gpu_compiled_plan_matches_the_reference(rng: np.random.Generator) -> None:
    g = _chain(DT.HALF, x_layout="NHWC")
    plan = ENGINE.build(g, fg.Handle("cuda:0"), COMPILED)
    pack = random_inputs(g, rng)
    dev = {
        k: torch.empty_strided(v.shape, t.strides, dtype=torch.float16, device="cuda").copy_(torch.from_numpy(v))
        for (k, v), t in zip(pack.items(), g.inputs(), strict=True)
    }
    out = plan._run_lean(dev)  # type: ignore[attr-defined]
    assert out is not None
    _check(g, out, pack)
    _check(g, plan.execute(pack), pack)

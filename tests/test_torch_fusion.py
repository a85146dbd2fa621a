"""The torch engine's oneDNN fused convolutions (CPU): which chains fuse, and that every
fused form -- with filters prepacked through ``bind_constants`` or passed dense -- matches
the float64 reference on random data."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.errors import VariantPackError
from fusegraph.onnx.importer import filter_strides
from fusegraph.select.autotune import random_inputs

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines import torch as torch_engine  # noqa: E402
from fusegraph.engines.torch import fusion as torch_fusion  # noqa: E402
from fusegraph.engines.torch import steps as torch_steps  # noqa: E402

pytestmark = pytest.mark.skipif(not torch_steps.available(), reason="this torch build has no oneDNN (mkldnn) ops")

CPU = fg.Handle("cpu")
ENGINE = torch_engine.TorchEngine()


def _eager(g: fg.Graph) -> torch_engine.TorchPlan:
    """The eager plan (these steps), not the oneDNN Graph one that bound weights would get."""
    knobs = (("onednn_graph", False),) if "onednn_graph" in {k.name for k in ENGINE.knobs(g, CPU)} else ()
    plan = ENGINE.build(g, CPU, EngineConfig("torch", knobs))
    assert isinstance(plan, torch_engine.TorchPlan)
    return plan
TOL = 2e-5  # f32 conv sums of up to ~150 products, against float64

Epilogue = Callable[[fg.Graph, fg.TensorAttr], fg.TensorAttr]
EPILOGUES: dict[str, tuple[Epilogue, str]] = {
    "relu": (lambda g, y: g.relu(y), "conv+bias+relu"),
    "leaky_relu": (lambda g, y: g.leaky_relu(y, 0.2), "conv+bias+leaky_relu"),
    "clip": (lambda g, y: g.relu(y, lower_clip=-0.5, upper_clip=0.75), "conv+bias+hardtanh"),
    "sigmoid": (lambda g, y: g.sigmoid(y), "conv+bias+sigmoid"),
    "tanh": (lambda g, y: g.tanh(y), "conv+bias+tanh"),
    "gelu": (lambda g, y: g.gelu(y), "conv+bias+gelu"),
    "gelu_tanh": (lambda g, y: g.gelu_approx_tanh(y), "conv+bias+gelu"),
    "swish": (lambda g, y: g.swish(y), "conv+bias+swish"),
    "none": (lambda g, y: y, "conv+bias"),
}

CONVS: dict[str, dict[str, object]] = {
    "3x3": {"x": [1, 8, 9, 9], "w": [16, 8, 3, 3], "padding": [1, 1]},
    "1x1_stride2": {"x": [2, 16, 8, 8], "w": [8, 16, 1, 1], "stride": [2, 2]},
    "dilated_groups": {"x": [1, 8, 11, 11], "w": [8, 4, 3, 3], "padding": [2, 2], "dilation": [2, 2]},
    "asym_pad": {"x": [1, 4, 8, 8], "w": [6, 4, 3, 2], "pre_padding": [0, 1], "post_padding": [2, 0], "stride": [2, 1]},
}


def _graph(conv: str, layout: str, epilogue: str, *, residual: bool = False, post_relu: bool = False) -> fg.Graph:
    c = CONVS[conv]
    g = fg.Graph("fused", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    xd, wd = list(c["x"]), list(c["w"])  # type: ignore[call-overload]
    x = g.tensor("x", xd, fg.strides_for(xd, layout))
    w = g.tensor("w", wd, fg.strides_for(wd, "KRSC" if layout == "NHWC" else "NCHW"))
    b = g.tensor("b", [1, wd[0], 1, 1])
    y = g.conv_fprop(x, w, **{k: v for k, v in c.items() if k not in ("x", "w")})  # type: ignore[arg-type]
    y = g.bias(y, b)
    y = EPILOGUES[epilogue][0](g, y)
    if residual:
        r = g.tensor("r", list(y.shape), fg.strides_for(list(y.shape), layout))
        y = g.add(y, r)
        if post_relu:
            y = g.relu(y)
    y.set_output(True).set_name("y")
    return g.validate()


def _check(g: fg.Graph, rng: np.random.Generator, *, bind: bool, expect: list[str]) -> torch_engine.TorchPlan:
    pack = random_inputs(g, rng)
    plan = _eager(g)
    assert isinstance(plan, torch_engine.TorchPlan)
    assert sorted(fc.describe() for fc in plan.fusions.values()) == sorted(expect)
    if bind:
        plan.bind_constants({k: v for k, v in pack.items() if k.startswith("w")})
        assert plan.describe()["prepacked_filters"] == len(expect)
    ref32 = g.execute(pack, engine="reference")["y"]
    ref = ref32.astype(np.float64)
    for _ in range(2):  # the second call reuses the packed filter
        got = plan.execute(pack)["y"]
        assert got.strides == ref32.strides, "the declared output layout"
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)  # a ReLU may zero it all: then exact
        assert err < TOL, f"rel err {err:.2e}, max abs {np.abs(got - ref).max():.2e}"
    return plan


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("bind", [True, False], ids=["prepacked", "dense"])
def test_conv_bias_activation(epilogue: str, bind: bool, rng: np.random.Generator) -> None:
    _check(_graph("3x3", "NHWC", epilogue), rng, bind=bind, expect=[EPILOGUES[epilogue][1]])


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("post_relu", [True, False])
def test_conv_bias_residual(conv: str, layout: str, post_relu: bool, rng: np.random.Generator) -> None:
    g = _graph(conv, layout, "none", residual=True, post_relu=post_relu)
    _check(g, rng, bind=True, expect=["conv+bias+add+relu" if post_relu else "conv+bias+add"])


def test_activation_then_residual_fuses_only_the_activation(rng: np.random.Generator) -> None:
    """oneDNN's binary post-op comes before the activation, so relu-then-add keeps the add apart."""
    _check(_graph("3x3", "NHWC", "relu", residual=True), rng, bind=True, expect=["conv+bias+relu"])


def test_exposed_intermediate_is_not_swallowed(rng: np.random.Generator) -> None:
    g = fg.Graph("exposed", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 4, 6, 6], fg.strides_for([1, 4, 6, 6], "NHWC"))
    w = g.tensor("w", [4, 4, 3, 3])
    b = g.tensor("b", [1, 4, 1, 1])
    pre = g.bias(g.conv_fprop(x, w, padding=[1, 1]), b).set_output(True).set_name("pre")
    g.relu(pre).set_output(True).set_name("y")
    plan = _check(g.validate(), rng, bind=True, expect=["conv+bias"])
    pack = random_inputs(g, rng)
    got, ref = plan.execute(pack), g.execute(pack, engine="reference")
    assert np.allclose(got["pre"], ref["pre"], rtol=1e-4, atol=1e-5)


def test_shared_branch_is_claimed_once(rng: np.random.Generator) -> None:
    """Two convs meeting in one add (a ResNet block with a projection shortcut): the add
    joins one of the two chains, never both."""
    g = fg.Graph("block", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 8, 7, 7], fg.strides_for([1, 8, 7, 7], "NHWC"))
    w1, w2 = g.tensor("w", [16, 8, 3, 3]), g.tensor("w2", [16, 8, 1, 1])
    b1, b2 = g.tensor("b", [1, 16, 1, 1]), g.tensor("b2", [1, 16, 1, 1])
    main = g.bias(g.conv_fprop(x, w1, padding=[1, 1]), b1)
    short = g.bias(g.conv_fprop(x, w2), b2)
    g.relu(g.add(main, short)).set_output(True).set_name("y")
    _check(g.validate(), rng, bind=True, expect=["conv+bias+add+relu", "conv+bias"])


def test_other_weight_object_runs_with_that_value(rng: np.random.Generator) -> None:
    """A pack holding a different filter than the bound one must use it, not the packed copy."""
    g = _graph("3x3", "NHWC", "relu")
    pack = random_inputs(g, rng)
    plan = _eager(g)
    plan.bind_constants({"w": pack["w"]})
    w2 = np.empty_like(pack["w"])  # same layout, other values
    w2[...] = pack["w"] * np.float32(-1.5)
    other = {**pack, "w": w2}
    got = plan.execute(other)["y"]
    ref = g.execute(other, engine="reference")["y"]
    assert np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30) < TOL  # all-zero ReLU: exact


def test_knob_off_runs_node_by_node(rng: np.random.Generator) -> None:
    g = _graph("3x3", "NHWC", "relu")
    assert "onednn" in {k.name for k in ENGINE.knobs(g, CPU)}
    plan = ENGINE.build(g, CPU, EngineConfig("torch", (("onednn", False),)))
    assert isinstance(plan, torch_engine.TorchPlan) and not plan.fusions
    pack = random_inputs(g, rng)
    ref = g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(plan.execute(pack)["y"] - ref) / max(np.linalg.norm(ref), 1e-30) < TOL  # all-zero ReLU: exact


def test_f16_and_3d_convs_are_not_fused() -> None:
    g = fg.Graph("half", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT)
    x, w, b = g.tensor("x", [1, 4, 6, 6]), g.tensor("w", [4, 4, 3, 3]), g.tensor("b", [1, 4, 1, 1])
    g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), b)).set_output(True)
    assert torch_fusion.plan_fusions(g.validate()) == {}
    g3 = fg.Graph("3d", io_data_type=DT.FLOAT)
    x3, w3, b3 = g3.tensor("x", [1, 4, 4, 4, 4]), g3.tensor("w", [4, 4, 3, 3, 3]), g3.tensor("b", [1, 4, 1, 1, 1])
    g3.relu(g3.bias(g3.conv_fprop(x3, w3, padding=[1, 1, 1]), b3)).set_output(True)
    assert torch_fusion.plan_fusions(g3.validate()) == {}
    assert "onednn" not in {k.name for k in ENGINE.knobs(g3, CPU)}


def test_lone_conv_and_shared_output_are_prepacked(rng: np.random.Generator) -> None:
    """A conv whose output is read twice keeps its epilogue apart but is still one prepacked
    oneDNN call; so is a conv that is the graph's output."""
    g = fg.Graph("lone", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 6, 7, 7], fg.strides_for([1, 6, 7, 7], "NHWC"))
    w, w2 = g.tensor("w", [6, 6, 3, 3]), g.tensor("w2", [5, 6, 1, 1])
    c = g.conv_fprop(x, w, padding=[1, 1])
    g.add(g.relu(c), g.sigmoid(c)).set_output(True).set_name("y")
    g.conv_fprop(x, w2).set_output(True).set_name("z")
    plan = _check(g.validate(), rng, bind=True, expect=["conv", "conv"])
    pack = random_inputs(g, rng)
    plan.bind_constants({"w": pack["w"], "w2": pack["w2"]})
    got, ref = plan.execute(pack), g.execute(pack, engine="reference")
    err = np.linalg.norm(got["z"] - ref["z"]) / np.linalg.norm(ref["z"])
    assert err < TOL


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("scale_first", [True, False])
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.DOUBLE])
def test_scale_shift(relu: bool, scale_first: bool, dt: DT, rng: np.random.Generator) -> None:
    """The BatchNorm-after-concat form (DenseNet): mul by a per-channel scale, add a shift."""
    g = fg.Graph("ss", io_data_type=dt, intermediate_data_type=dt, compute_data_type=dt)
    x = g.tensor("x", [2, 6, 5, 4], fg.strides_for([2, 6, 5, 4], "NHWC"))
    s, b = g.tensor("s", [1, 6, 1, 1]), g.tensor("b", [6, 1, 1])
    y = g.add(g.mul(s, x) if scale_first else g.mul(x, s), b)
    if relu:
        y = g.relu(y)
    y.set_output(True).set_name("y")
    g.validate()
    plan = _eager(g)
    assert isinstance(plan, torch_engine.TorchPlan)
    assert [st.describe() for st in plan.fusions.values()] == ["scale+shift+relu" if relu else "scale+shift"]
    pack = random_inputs(g, rng)
    got, ref = plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]
    assert got.strides == ref.strides and np.isfinite(got).all()
    # with the ReLU a draw can make every output 0 (values in [-1, 1): every shift below -|scale|,
    # as input seed 213841890 drew): then the answer must be exactly 0, not 0/0
    den = float(np.linalg.norm(ref))
    err = float(np.linalg.norm(got - ref)) / den if den else float(np.abs(got - ref).max())
    assert err < (1e-6 if dt == DT.FLOAT else 1e-14)


def test_scale_shift_needs_private_intermediate_and_one_type(rng: np.random.Generator) -> None:
    g = fg.Graph("ss2", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x, s, b = g.tensor("x", [1, 3, 4, 4]), g.tensor("s", [1, 3, 1, 1]), g.tensor("b", [1, 3, 1, 1])
    m = g.mul(x, s).set_output(True).set_name("m")  # exposed: the add stays apart
    g.add(m, b).set_output(True).set_name("y")
    assert torch_fusion.plan_scale_shifts(g.validate()) == {}
    h = fg.Graph("ss3", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT)
    x, s, b = h.tensor("x", [1, 3, 4, 4]), h.tensor("s", [1, 3, 1, 1]), h.tensor("b", [1, 3, 1, 1])
    h.add(h.mul(x, s), b).set_output(True)
    assert torch_fusion.plan_scale_shifts(h.validate()) == {}  # f16 computed in f32: left to the node path


@pytest.mark.parametrize("epilogue", ["relu", "gelu", "none"])
@pytest.mark.parametrize("b_layout", ["column_major", "row_major"])
@pytest.mark.parametrize("bias_shape", ["n", "1n", None])
def test_linear(epilogue: str, b_layout: str, bias_shape: str | None, rng: np.random.Generator) -> None:
    """GEMM + bias + activation as one oneDNN linear; B column-major is read in place, a
    row-major B is copied per call -- both exact to f32."""
    m, k, n = 3, 40, 24
    g = fg.Graph("lin", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    a = g.tensor("a", [m, k])
    b = g.tensor("w", [k, n], (1, k) if b_layout == "column_major" else (n, 1))
    y = g.matmul(a, b)
    if bias_shape is not None:
        y = g.add(y, g.tensor("b", [n] if bias_shape == "n" else [1, n]))
    y = EPILOGUES[epilogue][0](g, y)
    y.set_output(True).set_name("y")
    g.validate()
    want = "+".join(["linear", *(["bias"] if bias_shape else []), *([] if epilogue == "none" else [epilogue])])
    plan = _eager(g)
    assert isinstance(plan, torch_engine.TorchPlan)
    assert [st.describe() for st in plan.fusions.values()] == [want]
    pack = random_inputs(g, rng)
    got, ref = plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30) < TOL  # all-zero ReLU: exact


def test_batched_matmul_stays_unfused() -> None:
    g = fg.Graph("bmm", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    g.relu(g.matmul(g.tensor("a", [2, 3, 4]), g.tensor("w", [4, 5]))).set_output(True)
    assert torch_fusion.plan_linears(g.validate()) == {}


@pytest.mark.parametrize(("c", "groups"), [(12, 3), (16, 4), (10, 2)])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_channel_shuffle(c: int, groups: int, layout: str, rng: np.random.Generator) -> None:
    g = fg.Graph("shuffle", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [2, c, 3, 5], fg.strides_for([2, c, 3, 5], layout))
    t5 = g.transpose(g.reshape(x, [2, groups, c // groups, 3, 5]), [0, 2, 1, 3, 4])
    y = g.reshape(t5, [2, c, 3, 5])
    y.set_stride(list(fg.strides_for([2, c, 3, 5], layout)))
    g.relu(y).set_output(True).set_name("y")
    g.validate()
    plan = _eager(g)
    assert isinstance(plan, torch_engine.TorchPlan)
    assert [st.describe() for st in plan.fusions.values()] == [f"channel_shuffle(g={groups})"]
    pack = random_inputs(g, rng)
    got, ref = plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]
    assert np.array_equal(got, ref)  # a permutation, then ReLU: exact


def test_other_permutations_are_not_shuffles() -> None:
    g = fg.Graph("notshuffle", io_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 12, 3, 5])
    t5 = g.transpose(g.reshape(x, [1, 3, 4, 3, 5]), [0, 1, 2, 4, 3])
    g.reshape(t5, [1, 12, 3, 5]).set_output(True)
    assert torch_fusion.plan_channel_shuffles(g.validate()) == {}


def test_filter_in_any_declared_layout(rng: np.random.Generator) -> None:
    """An HWCF-strided filter (IREE's packing) is dense in neither torch format: the step
    makes it so rather than hand oneDNN memory it would misread."""
    g = fg.Graph("hwcf", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 6, 7, 7], fg.strides_for([1, 6, 7, 7], "NHWC"))
    w = g.tensor("w", [5, 6, 3, 3], filter_strides([5, 6, 3, 3], "HWCF"))
    g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), g.tensor("b", [1, 5, 1, 1]))).set_output(True).set_name("y")
    g.validate()
    plan = _eager(g)
    assert [st.describe() for st in plan.fusions.values()] == ["conv+bias+relu"]
    pack = random_inputs(g, rng)
    got, ref = plan.execute(pack)["y"], g.execute(pack, engine="reference")["y"]
    assert np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30) < TOL  # all-zero ReLU: exact


def test_bound_constant_of_the_wrong_shape_is_refused_by_name(rng: np.random.Generator) -> None:
    g = _graph("3x3", "NHWC", "relu")
    plan = _eager(g)
    with pytest.raises(VariantPackError, match="bound constant") as err:
        plan.bind_constants({"w": np.zeros((3, 3), np.float32)})
    assert err.value.tensor == "w"


def test_binding_a_name_the_graph_does_not_read_is_refused(rng: np.random.Generator) -> None:
    g = fg.Graph("b", io_data_type=DT.FLOAT)
    g.relu(g.tensor("x", [2, 3])).set_output(True).set_name("y")
    plan = _eager(g.validate())
    with pytest.raises(VariantPackError, match=r"'nope'.*not an input"):
        plan.bind_constants({"nope": rng.standard_normal((2, 3)).astype(np.float32)})

"""fusegraph.onnx.weights.randomize_weights: the fills become random initializers of the
right scale per role, the model stays valid and runs, the input model is left alone."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusegraph.onnx.weights import expose_logits, randomize_weights

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _fill(name: str, shape: list[int], dtype: int = TensorProto.FLOAT) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    """A light-model style weight: ConstantOfShape(shape initializer) filled with 0.02."""
    value = numpy_helper.from_array(np.array([0.02], helper.tensor_dtype_to_np_dtype(dtype)), "value")
    node = helper.make_node("ConstantOfShape", [name + "__SHAPE"], [name], value=value)
    return node, numpy_helper.from_array(np.array(shape, np.int64), name + "__SHAPE")


def _small_cnn(ir_version: int = 3, opset: int = 9) -> onnx.ModelProto:
    """Conv(64x32x3x3) -> BN -> Relu -> Reshape -> Gemm(transB, 10x(64*6*6)) -> Softmax, all
    weights ConstantOfShape fills; the Gemm's matrix is stored 4-D and reshaped (as in
    light_inception_v1), so its role is only visible past the Reshape."""
    fills = [
        _fill("w", [64, 32, 3, 3]), _fill("b", [64]),
        _fill("scale", [64]), _fill("shift", [64]), _fill("mean", [64]), _fill("var", [64]),
        _fill("fc_w4", [1, 1, 10, 64 * 6 * 6]), _fill("fc_b", [10]),
    ]
    nodes = [n for n, _ in fills] + [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Reshape", ["r", "flat"], ["f"]),
        helper.make_node("Reshape", ["fc_w4", "fc_shape"], ["fc_w"]),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["prob"]),
    ]
    inits = [t for _, t in fills] + [
        numpy_helper.from_array(np.array([1, 64 * 6 * 6], np.int64), "flat"),
        numpy_helper.from_array(np.array([10, 64 * 6 * 6], np.int64), "fc_shape"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8])
    inputs = [x]
    if ir_version < 4:  # initializers must be listed as inputs
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "small_cnn", inputs, [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 10])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.checker.check_model(model)
    return model


def _inits(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _run(m: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, feed))


def test_fills_become_initializers_of_the_right_scale(rng: np.random.Generator) -> None:
    model = _small_cnn()
    before = model.SerializeToString()
    out = randomize_weights(model, rng)
    assert model.SerializeToString() == before, "the input model was modified"
    onnx.checker.check_model(out, full_check=True)
    assert not [n for n in out.graph.node if n.op_type == "ConstantOfShape"]
    w = _inits(out)
    assert not [k for k in w if k.endswith("__SHAPE")], "unread shape initializers were kept"
    assert w["w"].shape == (64, 32, 3, 3) and w["w"].dtype == np.float32
    # He: std sqrt(2 / fan_in); 18432 and 23040 samples put the estimate within ~1%.
    assert abs(w["w"].std() / math.sqrt(2 / (32 * 9)) - 1) < 0.05
    assert abs(w["fc_w4"].std() / math.sqrt(2 / (64 * 36)) - 1) < 0.05, "Gemm role not seen past the Reshape"
    for k in ("scale", "var"):
        assert w[k].min() >= 0.5 and w[k].max() <= 1.5, k
    for k in ("b", "shift", "mean", "fc_b"):
        assert w[k].min() < 0 < w[k].max() and w[k].std() < 0.3, k
    assert len({float(v) for v in w["w"].ravel()}) > 1000, "weights are not random"
    # IR 3: every initializer is also a graph input.
    assert set(w) <= {i.name for i in out.graph.input}


def test_logits_exposed_and_outputs_not_constant(rng: np.random.Generator) -> None:
    out = randomize_weights(_small_cnn(), rng)
    assert [o.name for o in out.graph.output] == ["prob", "logits"]
    assert list(out.graph.output[1].type.tensor_type.shape.dim)[1].dim_value == 10
    x = rng.standard_normal((1, 32, 8, 8), dtype=np.float32)
    prob, logits = _run(out, {"x": x})
    assert logits.shape == (1, 10) and np.isfinite(logits).all()
    assert logits.std() > 0.1, f"logits nearly constant: {logits}"
    np.testing.assert_allclose(prob, np.exp(logits) / np.exp(logits).sum(), rtol=1e-5)
    # As shipped (all 0.02) the same model gives equal logits: the point of randomizing.
    shipped = _run(_small_cnn(), {"x": x})[0]
    assert np.ptp(shipped) < 1e-6

    plain = randomize_weights(_small_cnn(), rng, expose_logits=False)
    assert [o.name for o in plain.graph.output] == ["prob"]


def test_logits_not_duplicated_when_already_an_output(rng: np.random.Generator) -> None:
    model = _small_cnn()
    model.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10]))
    out = randomize_weights(model, rng)
    assert [o.name for o in out.graph.output] == ["prob", "logits"]


def test_same_seed_same_weights() -> None:
    a = _inits(randomize_weights(_small_cnn(), np.random.default_rng(7)))
    b = _inits(randomize_weights(_small_cnn(), np.random.default_rng(7)))
    c = _inits(randomize_weights(_small_cnn(), np.random.default_rng(8)))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["w"], c["w"])


def test_ir4_no_new_inputs_and_fill_dtype_kept(rng: np.random.Generator) -> None:
    model = _small_cnn(ir_version=7, opset=13)
    # One float16 fill feeding a Cast: its values stay float16.
    node, shape = _fill("h", [4], TensorProto.FLOAT16)
    model.graph.node.insert(0, node)
    model.graph.initializer.append(shape)
    model.graph.node.append(helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("h32", TensorProto.FLOAT, [4]))
    onnx.checker.check_model(model)
    out = randomize_weights(model, rng)
    onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == ["x"]
    assert _inits(out)["h"].dtype == np.float16
    res = _run(out, {"x": rng.standard_normal((1, 32, 8, 8), dtype=np.float32)})
    assert np.ptp(res[1]) > 0


def _plain_model() -> onnx.ModelProto:
    """Real-looking weights as initializers (no fills), plus an int64 shape and a float
    constant that is not a weight (a Mul by 2)."""
    inits = [
        numpy_helper.from_array(np.full((8, 3, 3, 3), 0.5, np.float32), "w"),
        numpy_helper.from_array(np.full((8,), 0.5, np.float32), "b"),
        numpy_helper.from_array(np.array([1, 8 * 4 * 4], np.int64), "flat"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.full((8 * 16, 5), 0.5, np.float32), "m"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3]),
        helper.make_node("Mul", ["c", "two"], ["c2"]),
        helper.make_node("Reshape", ["c2", "flat"], ["f"]),
        helper.make_node("MatMul", ["f", "m"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "plain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("initializers", [None, True, False])
def test_plain_initializers(initializers: bool | None, rng: np.random.Generator) -> None:
    model = _plain_model()
    before = _inits(model)
    out = randomize_weights(model, rng, initializers=initializers)
    onnx.checker.check_model(out, full_check=True)
    after = _inits(out)
    assert list(after) == list(before), "initializers added, dropped or reordered"
    for k in ("flat", "two"):  # not weights
        np.testing.assert_array_equal(after[k], before[k])
    changed = {k for k in before if not np.array_equal(after[k], before[k])}
    # None: the model has no fills, so its weight initializers are randomized.
    assert changed == (set() if initializers is False else {"w", "b", "m"})
    if changed:
        assert abs(after["m"].std() / math.sqrt(2 / 128) - 1) < 0.2  # MatMul fan_in = K = 128
        y = _run(out, {"x": rng.standard_normal((1, 3, 6, 6), dtype=np.float32)})[0]
        assert np.ptp(y) > 0


def test_light_squeezenet(rng: np.random.Generator) -> None:
    """A real light model: no fill left, valid, ORT gives non-uniform probabilities."""
    model = onnx.load(str(LIGHT / "light_squeezenet.onnx"))
    fills = {n.output[0] for n in model.graph.node if n.op_type == "ConstantOfShape"}
    shipped = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    out = randomize_weights(model, rng)
    onnx.checker.check_model(out)
    assert not [n for n in out.graph.node if n.op_type == "ConstantOfShape"]
    w = _inits(out)
    assert fills <= set(w)
    # The model has fills, so the real float vectors it ships are kept (initializers=None).
    assert all(np.array_equal(w[k], v) for k, v in shipped.items())
    soft = next(n for n in out.graph.node if n.op_type == "Softmax")
    assert out.graph.output[-1].name == soft.input[0]
    x = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
    prob, logits = _run(out, {_data_input(out): x})
    assert np.isfinite(logits).all() and logits.std() > 0.1
    assert np.ptp(prob) > 1e-3, "probabilities still uniform"
    prob0 = _run(model, {_data_input(model): x})[0]
    assert np.ptp(prob0) < 1e-6, "as shipped the light model should give uniform probabilities"


def _data_input(m: onnx.ModelProto) -> str:
    inits = {t.name for t in m.graph.initializer}
    (name,) = [i.name for i in m.graph.input if i.name not in inits]
    return name


def test_expose_logits_copies_and_adds_the_softmax_input() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["z"]), helper.make_node("Softmax", ["z"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    out = expose_logits(m)
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert [o.name for o in m.graph.output] == ["y"]  # the input model is left alone
    assert [o.name for o in expose_logits(out).graph.output] == ["y", "z"]  # not twice

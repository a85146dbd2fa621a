"""Initializers read as read-only views of the model's bytes instead of copies (issue 24
item 6): every initializer the walk of the bytes finds equals ``numpy_helper.to_array``'s
value (dtype, shape, bytes) across the ONNX types, the ones it must leave alone (typed
fields such as float_data, sub-byte and string types, external data, a ModelProto) are left
to ``to_array``, bytes it cannot walk give no views and no error, and a session over a file
uses them and agrees with ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx import specialize as specialize_mod
from fusegraph.onnx.load import initializer_views, load_model_with_views

pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]


def _zoo(rng: np.random.Generator) -> list[onnx.TensorProto]:
    """Initializers of every kind the walk meets: raw data of many types and shapes
    (scalars, empty, odd byte counts that leave later tensors unaligned), typed fields,
    sub-byte and string types."""
    def raw(arr: np.ndarray, name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(arr, name)

    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    out = [
        raw(rng.integers(0, 255, (7,), dtype=np.uint8), "u8_odd"),  # 7 bytes: what follows is unaligned
        raw(f32, "f32"),
        raw(rng.standard_normal((2, 3, 4)).astype(np.float16), "f16"),
        raw(rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16), "bf16"),
        raw(rng.integers(-2**40, 2**40, (6,), dtype=np.int64), "i64"),
        raw(rng.integers(-2**20, 2**20, (2, 2), dtype=np.int32), "i32"),
        raw(rng.integers(-100, 100, (5,), dtype=np.int8), "i8"),
        raw(rng.random((3, 3)) > 0.5, "bool"),
        raw(rng.standard_normal((2,)), "f64"),
        raw((rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64), "c64"),
        raw(np.array(3.5, np.float32), "scalar"),
        raw(np.zeros((0, 4), np.float32), "empty"),
        raw(rng.standard_normal(4).astype(ml_dtypes.float8_e4m3fn), "f8"),
        helper.make_tensor("typed_f32", TensorProto.FLOAT, [2, 2], rng.standard_normal(4).tolist()),
        helper.make_tensor("typed_i64", TensorProto.INT64, [3], [1, -2, 3]),
        helper.make_tensor("int4", TensorProto.INT4, [5], [1, -2, 3, -4, 5]),
        helper.make_tensor("strings", TensorProto.STRING, [2], [b"a", b"bc"]),
    ]
    return out


def _model_with(inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    g = helper.make_graph(nodes, "zoo", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_views_equal_to_array(rng: np.random.Generator) -> None:
    model = _model_with(_zoo(rng))
    data = model.SerializeToString()
    parsed = onnx.load_from_string(data)
    views = initializer_views(data, parsed)
    raw_kinds = {"u8_odd", "f32", "f16", "bf16", "i64", "i32", "i8", "bool", "f64", "c64", "scalar", "empty", "f8"}
    assert set(views) == raw_kinds  # typed fields, INT4 and strings go through to_array
    for t in parsed.graph.initializer:
        if t.name in views:
            v = views[t.name]
            _same(v, numpy_helper.to_array(t))
            assert not v.flags.writeable  # read-only: a writer must copy
            assert v.base is not None  # a view of the bytes, not a copy


def test_load_model_with_views_by_path_bytes_and_proto(tmp_path: Path, rng: np.random.Generator) -> None:
    model = _model_with(_zoo(rng))
    path = tmp_path / "zoo.onnx"
    onnx.save(model, str(path))
    for source in (str(path), path.read_bytes()):
        m, views = load_model_with_views(source)
        assert len(views) == 13
        for t in m.graph.initializer:
            if t.name in views:
                _same(views[t.name], numpy_helper.to_array(t))
    _, views = load_model_with_views(model)
    assert views == {}  # no bytes at hand: nothing serialized for it


def test_external_data_is_left_to_to_array(tmp_path: Path, rng: np.random.Generator) -> None:
    model = _model_with([numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "big"),
                         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "small")])
    want = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
              size_threshold=1024)
    m, views = load_model_with_views(str(path))
    assert views == {}  # the model took its external data: its bytes are not all of it
    for t in m.graph.initializer:
        _same(numpy_helper.to_array(t), want[t.name])


def test_bytes_that_do_not_walk_give_no_views(rng: np.random.Generator) -> None:
    model = _model_with(_zoo(rng)[:4])
    data = model.SerializeToString()
    parsed = onnx.load_from_string(data)
    assert initializer_views(data[: len(data) // 2], parsed) == {}  # truncated
    other = _model_with(list(reversed(_zoo(rng)[:4])))
    assert initializer_views(other.SerializeToString(), parsed) == {}  # another order: names disagree
    assert initializer_views(b"\xff" * 40, parsed) == {}


def test_session_over_a_file_uses_views_and_agrees(tmp_path: Path, rng: np.random.Generator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    d = 16
    inits = [numpy_helper.from_array(np.array([1], np.uint8), "pad"),  # unaligns what follows
             numpy_helper.from_array((rng.standard_normal((d, d)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((1, d)).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, d])], inits)
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    copied: list[str] = []
    real = specialize_mod.numpy_helper.to_array

    def spy(t: onnx.TensorProto, *args: object) -> np.ndarray:
        copied.append(t.name)
        return real(t, *args)

    monkeypatch.setattr(specialize_mod.numpy_helper, "to_array", spy)
    x = rng.standard_normal((4, d)).astype(np.float32)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for opts in ({"engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off"},
                 {"engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off", "regions": "on"}):
        copied.clear()
        sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
        assert not {"w", "b", "pad"} & set(copied), copied
        (got,) = sess.run(None, {"x": x})
        err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert np.isfinite(got).all() and err < 1e-5, err

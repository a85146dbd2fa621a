"""A model file checked before, parsed without its weights' bytes (fusegraph/onnx/lean_model.py,
issue 24 item 6): the lean model with the views put back is the whole parse, each view equals
``numpy_helper.to_array`` of the whole parse across the ONNX types, bytes the walk does not
expect give the whole parse, and a session over such a file (a second open, a second input
shape, a file rewritten in place) gives ONNX Runtime's answers and the same partition."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_warm_setup_views import _model_with, _same, _zoo

import fusegraph.onnx as fgo
from fusegraph.onnx import load as load_mod
from fusegraph.onnx.lean_model import LEAN_MIN_BYTES, lean_parse, stripped
from fusegraph.onnx.load import initializer_views, load_model_with_views

pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]


def _big_zoo(rng: np.random.Generator) -> list[onnx.TensorProto]:
    """The small zoo and initializers of at least LEAN_MIN_BYTES in several raw types, the
    odd-sized ones leaving what follows unaligned."""
    import ml_dtypes

    n = LEAN_MIN_BYTES
    big = [numpy_helper.from_array(a, name) for a, name in (
        (rng.standard_normal((n // 4 + 3,)).astype(np.float32), "big_f32"),
        (rng.integers(0, 255, (n + 1,), dtype=np.uint8), "big_u8_odd"),
        (rng.standard_normal((n // 2, 3)).astype(np.float16), "big_f16"),
        (rng.standard_normal((n // 2,)).astype(ml_dtypes.bfloat16), "big_bf16"),
        (rng.integers(-2**40, 2**40, (n // 8,), dtype=np.int64), "big_i64"),
        (rng.random((n,)) > 0.5, "big_bool"),
    )]
    typed = helper.make_tensor("big_typed", TensorProto.FLOAT, [n // 4], rng.standard_normal(n // 4).tolist())
    return [*_zoo(rng)[:7], *big, typed, *_zoo(rng)[7:]]


def test_lean_views_equal_the_whole_parse(rng: np.random.Generator) -> None:
    model = _model_with(_big_zoo(rng))
    data = model.SerializeToString()
    whole = onnx.load_from_string(data)
    found = lean_parse(data)
    assert found is not None
    lean, views = found
    assert stripped(lean) and not stripped(whole)
    assert set(views) == set(initializer_views(data, whole))  # the same initializers viewed
    left_out = {t.name for t in lean.graph.initializer if t.name in views and not t.HasField("raw_data")}
    assert left_out == {"big_f32", "big_u8_odd", "big_f16", "big_bf16", "big_i64", "big_bool"}
    for t in whole.graph.initializer:
        if t.name in views:
            _same(views[t.name], numpy_helper.to_array(t))
            assert not views[t.name].flags.writeable
    assert len(lean.SerializeToString()) < len(data) // 4
    # the views put back: the whole parse, field for field
    for t in lean.graph.initializer:
        if t.name in left_out:
            t.raw_data = views[t.name].tobytes()
    assert lean == whole


def test_bytes_the_walk_does_not_expect_are_parsed_whole(rng: np.random.Generator) -> None:
    data = _model_with(_big_zoo(rng)).SerializeToString()
    assert lean_parse(data[: len(data) // 2]) is None  # truncated
    assert lean_parse(b"\xff" * 40) is None
    assert lean_parse(data + data) is None  # a repeated graph field: protobuf would merge the two
    tensor = numpy_helper.from_array(rng.standard_normal(LEAN_MIN_BYTES).astype(np.float32), "w")
    tensor.float_data.extend([1.0])  # raw and typed data at once: its value is not its raw bytes alone
    assert lean_parse(_model_with([tensor]).SerializeToString()) is None
    assert lean_parse(_model_with(_zoo(rng)[:4]).SerializeToString()) is None  # nothing big to leave out
    # most of the bytes in a Constant node: a lean parse would copy them twice to save little
    big = numpy_helper.from_array(rng.standard_normal(4 * LEAN_MIN_BYTES).astype(np.float32), "c")
    model = _model_with([numpy_helper.from_array(rng.standard_normal(LEAN_MIN_BYTES).astype(np.float32), "w")])
    model.graph.node.append(helper.make_node("Constant", [], ["c"], value=big))
    assert lean_parse(model.SerializeToString()) is None
    # the other way round: lean, the Constant node as it was
    model = _model_with([numpy_helper.from_array(rng.standard_normal(8 * LEAN_MIN_BYTES).astype(np.float32), "w")])
    model.graph.node.append(helper.make_node("Constant", [], ["c"], value=big))
    found = lean_parse(model.SerializeToString())
    assert found is not None and stripped(found[0])
    assert found[0].graph.node == model.graph.node
    _same(found[1]["w"], numpy_helper.to_array(model.graph.initializer[0]))


def _mlp(rng: np.random.Generator, d: int = 64, batch: int | str = 4, opset: int = 17) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array([1], np.uint8), "pad"),
             numpy_helper.from_array((rng.standard_normal((d, d)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((1, d)).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _untimed(sess: fgo.InferenceSession) -> list[str]:
    """The partition report without its first line (the model's path) and compile times."""
    return [re.sub(r"\[compile [0-9.]+s\]", "", line) for line in str(sess.partition_report()).splitlines()[1:]]


def _agree(sess: fgo.InferenceSession, path: Path, x: np.ndarray) -> None:
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = sess.run(None, {"x": x})
    assert np.isfinite(got).all()
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-5, err


@pytest.mark.parametrize("regions", ["off", "on"])
def test_a_second_session_opens_the_file_lean_and_agrees(tmp_path: Path, rng: np.random.Generator,
                                                         regions: str) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(rng, batch="n"), str(path))
    opts = {"engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off", "regions": regions}
    first = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
    assert not stripped(first._model)  # checked now: parsed whole
    second = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
    assert stripped(second._model)
    for batch in (4, 3, 4):  # a second input shape: a second plan, from the views the session kept
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        _agree(second, path, x)
        _agree(first, path, x)
        assert _untimed(second) == _untimed(first)


def test_a_file_rewritten_in_place_is_checked_and_parsed_whole_again(tmp_path: Path,
                                                                    rng: np.random.Generator) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(rng), str(path))
    load_model_with_views(path)
    assert stripped(load_model_with_views(path)[0])
    onnx.save(_mlp(rng), str(path))  # other weights
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    model, views = load_model_with_views(path)
    assert not stripped(model)
    whole = onnx.load(str(path))
    for t in whole.graph.initializer:
        _same(views[t.name], numpy_helper.to_array(t))
    opts = {"engine": "torch", "floor": "off", "floor_mode": "inline", "runners": "off"}
    sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
    _agree(sess, path, rng.standard_normal((4, 64)).astype(np.float32))


def test_only_what_the_session_can_open_again_as_a_file_is_lean(tmp_path: Path, rng: np.random.Generator) -> None:
    # opset 7 (the whole model on ONNX Runtime is opened from the proto) and older (upgraded)
    for opset in (7, 6):
        path = tmp_path / f"mlp{opset}.onnx"
        onnx.save(_mlp(rng, opset=opset), str(path))
        load_model_with_views(path)
        assert not stripped(load_model_with_views(path)[0]), opset
    # bytes, a ModelProto and load_model (no views to stand for the weights) are never lean
    path = tmp_path / "mlp.onnx"
    model = _mlp(rng)
    onnx.save(model, str(path))
    load_model_with_views(path)
    assert not stripped(load_model_with_views(path.read_bytes())[0])
    assert not stripped(load_model_with_views(model)[0])
    assert not stripped(load_mod.load_model(path))
    assert stripped(load_model_with_views(path)[0])


def test_a_first_session_on_onnx_runtime_explains_itself_from_a_lean_model(tmp_path: Path,
                                                                          rng: np.random.Generator) -> None:
    """``floor_mode=background``: the model runs on ONNX Runtime while a child evaluates it,
    and the partition report plans it without building (``_new_plan(direct=...)``): from the
    views a lean model left, in a second session."""
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(rng), str(path))
    opts = {"floor_mode": "background", "runners": "off"}
    x = rng.standard_normal((4, 64)).astype(np.float32)
    reports = []
    for k in range(2):
        sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
        assert sess._direct is not None  # on ONNX Runtime while the child evaluates
        _agree(sess, path, x)
        reports.append(_untimed(sess))
        assert stripped(sess._model) == (k == 1)  # the first parse checks the file: whole
        sess.wait_for_evaluation(120)
        _agree(sess, path, x)
    # planned from the views (the verdict the child recorded meanwhile may differ)
    assert all("/3 non-constant nodes on fusegraph" in r[0] for r in reports), reports


@pytest.mark.gpu
def test_on_cuda_a_lean_model_copies_its_views_to_the_device_and_agrees(tmp_path: Path,
                                                                       rng: np.random.Generator) -> None:
    """On cuda:0 with the defaults (the region path, its deferred choice): the second open is
    lean, its weights reach the device from the views, and two input shapes agree with ONNX
    Runtime (TF32 may be on: 1e-3)."""
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(rng, batch="n"), str(path))
    opts = [(fgo.PROVIDER, {"device": "cuda"})]
    fgo.InferenceSession(str(path), providers=opts).run(None, {"x": rng.standard_normal((4, 64)).astype(np.float32)})
    sess = fgo.InferenceSession(str(path), providers=opts)
    assert stripped(sess._model)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (4, 2):
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        (want,) = ref.run(None, {"x": x})
        (got,) = sess.run(None, {"x": x})
        assert np.isfinite(got).all()
        err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-3, err
    sess.wait_for_evaluation(120)

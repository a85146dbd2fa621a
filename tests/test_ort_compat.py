"""Code written for ``onnxruntime.InferenceSession`` drives ``fusegraph.onnx.InferenceSession``
unchanged, side by side with ONNX Runtime: providers (an unknown one warned and dropped),
metadata, inputs/outputs, list feeds, IO binding (NumPy arrays, OrtValues, torch tensors by
pointer) and the errors an ``except`` written for ONNX Runtime catches."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

import fusegraph as fg
import fusegraph.onnx as fgo


def _model(rng: np.random.Generator) -> bytes:
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
            helper.make_node("Sigmoid", ["c"], ["z"]),
        ],
        "compat_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 5, 5])],
        [numpy_helper.from_array(w, "w")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                          producer_name="compat-test", doc_string="a model for the compat test")
    m.domain, m.model_version = "ai.test", 7
    helper.set_model_props(m, {"author": "G", "license": "none"})
    return bytes(m.SerializeToString())


def _drive(session_cls: Any, model: bytes, providers: list[Any], x: np.ndarray) -> dict[str, Any]:
    """Written for onnxruntime.InferenceSession; knows nothing of fusegraph."""
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sess = session_cls(model, providers=[*providers, "NoSuchExecutionProvider", "CPUExecutionProvider"])
    out["warned"] = any("NoSuchExecutionProvider" in str(w.message) for w in said)
    out["providers_tail"] = sess.get_providers()[-1]
    out["no_such"] = "NoSuchExecutionProvider" in sess.get_providers()
    out["cpu_options"] = sess.get_provider_options()["CPUExecutionProvider"]
    meta = sess.get_modelmeta()
    out["meta"] = (meta.producer_name, meta.graph_name, meta.domain, meta.description, meta.version,
                   dict(meta.custom_metadata_map))
    out["inputs"] = [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]
    out["outputs"] = [(o.name, o.type, list(o.shape)) for o in sess.get_outputs()]
    out["run"] = sess.run(None, {"x": x})
    out["run_z"] = sess.run(["z"], {"x": x})[0]
    out["list_feed"] = sess.run(["y"], {"x": x.astype(np.float64).tolist()})[0]  # float64 list -> float32
    # IO binding: NumPy input, one output into preallocated memory, one allocated by the run
    y_buf = np.empty((1, 4, 5, 5), np.float32)
    b = sess.io_binding()
    b.bind_cpu_input("x", x)
    b.bind_output("y", "cpu", 0, np.float32, list(y_buf.shape), y_buf.ctypes.data)
    b.bind_output("z")
    sess.run_with_iobinding(b)
    outs = b.copy_outputs_to_cpu()
    out["bound_y_buf"] = y_buf.copy()
    out["bound_copied"] = [np.array(o, copy=True) for o in outs]
    out["bound_ortvalues"] = [np.array(v.numpy(), copy=True) for v in b.get_outputs()]  # may view y_buf
    # IO binding with OrtValues and a raw pointer input (as torch users bind data_ptr())
    xv = ort.OrtValue.ortvalue_from_numpy(x)
    zv = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 4, 5, 5), np.float32))
    b2 = sess.io_binding()
    b2.bind_input("x", "cpu", 0, np.float32, list(x.shape), xv.data_ptr())
    b2.bind_ortvalue_output("z", zv)
    sess.run_with_iobinding(b2)
    out["ortvalue_out"] = np.array(zv.numpy(), copy=True)
    # errors, caught as code written for ONNX Runtime catches them
    caught = []
    for feed, names in (({"x": x.astype(np.float64)}, None), ({"x": x[:, :2]}, None), ({"x": x}, ["nope"])):
        try:
            sess.run(names, feed)
        except InvalidArgument:
            caught.append("InvalidArgument")
    try:
        sess.run(None, {})
    except ValueError:
        caught.append("ValueError")
    out["caught"] = caught
    return out


def _close(got: Any, want: Any, what: str) -> None:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape, what
    assert not np.isnan(g).any(), what
    rel = np.linalg.norm(g - w) / np.linalg.norm(w)
    assert rel <= 1e-5 and np.abs(g - w).max() <= 1e-4, f"{what}: relative {rel:.2e}"


def test_side_by_side_with_onnxruntime(rng: np.random.Generator) -> None:
    model = _model(rng)
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    want = _drive(ort.InferenceSession, model, [], x)
    got = _drive(fgo.InferenceSession, model, [(fgo.PROVIDER, {"engine": "reference"})], x)
    for key in ("warned", "providers_tail", "no_such", "cpu_options", "meta", "inputs", "outputs", "caught"):
        assert got[key] == want[key], key
    assert want["caught"] == ["InvalidArgument"] * 3 + ["ValueError"]
    for key in ("run", "bound_copied", "bound_ortvalues"):
        for g, w in zip(got[key], want[key], strict=True):
            _close(g, w, key)
    for key in ("run_z", "list_feed", "bound_y_buf", "ortvalue_out"):
        assert np.abs(want[key]).max() > 0, key  # the check could fail: real data was written
        _close(got[key], want[key], key)


def test_typed_errors_stay_typed(rng: np.random.Generator) -> None:
    sess = fgo.InferenceSession(_model(rng), providers=[(fgo.PROVIDER, {"engine": "reference"})])
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    with pytest.raises(fg.VariantPackError, match="dtype float64"):
        sess.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(fg.VariantPackError, match="missing"):
        sess.run(None, {})
    b = sess.io_binding()
    with pytest.raises(fg.VariantPackError, match="host memory"):
        b.bind_input("x", "cuda", 0, np.float32, [1, 3, 5, 5], 1234)


def test_torch_tensors_through_io_binding(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch", reason="torch is optional; the torch-tensor binding needs it")
    model = _model(rng)
    x = torch.from_numpy(rng.standard_normal((1, 3, 5, 5)).astype(np.float32))
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["y"], {"x": x.numpy()})[0]
    sess = fgo.InferenceSession(model, providers=[(fgo.PROVIDER, {"engine": "reference"})])
    y = torch.empty((1, 4, 5, 5), dtype=torch.float32)
    b = sess.io_binding()
    b.bind_input("x", "cpu", 0, np.float32, tuple(x.shape), x.data_ptr())
    b.bind_output("y", "cpu", 0, np.float32, tuple(y.shape), y.data_ptr())
    sess.run_with_iobinding(b)
    _close(y.numpy(), want, "pointer-bound torch output")
    b2 = sess.io_binding()
    b2.bind_cpu_input("x", x)  # a torch tensor, viewed through DLPack
    b2.bind_output("y")
    sess.run_with_iobinding(b2)
    _close(b2.copy_outputs_to_cpu()[0], want, "DLPack-bound torch input")
    assert onnx.__version__  # onnx is imported for the model above

"""A warm GPU session parses its model file from a read-only memory map (load.load_model_mapped,
model_file.FileMap): only a file checked before and unchanged since is mapped, the views view
the map, the parsed model holds copies, and releasing the map says whether the file changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusegraph.onnx import load
from fusegraph.onnx.load import load_model_mapped

pytestmark = pytest.mark.usefixtures("own_cache")


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16, 16])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _saved(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, onnx.ModelProto]:
    model = _model(rng)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return path, model


def test_only_a_file_checked_before_is_mapped(tmp_path: Path, rng: np.random.Generator) -> None:
    path, model = _saved(tmp_path, rng)
    first, _, fm = load_model_mapped(path)
    assert fm is None, "a file never checked was mapped"
    second, views, fm = load_model_mapped(str(path))
    assert fm is not None
    assert second.SerializeToString() == first.SerializeToString() == model.SerializeToString()
    for init in model.graph.initializer:
        want = numpy_helper.to_array(init)
        assert not views[init.name].flags.writeable
        np.testing.assert_array_equal(views[init.name], want)
    assert fm.release() and not fm.closed  # the views still view the map: it stays until they go
    np.testing.assert_array_equal(views["w"], numpy_helper.to_array(model.graph.initializer[0]))
    del views
    assert fm.release() and fm.closed


def test_the_parsed_model_outlives_the_map(tmp_path: Path, rng: np.random.Generator) -> None:
    path, model = _saved(tmp_path, rng)
    load_model_mapped(path)
    parsed, views, fm = load_model_mapped(path)
    assert fm is not None
    del views
    assert fm.release() and fm.closed
    for got, want in zip(parsed.graph.initializer, model.graph.initializer, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(got), numpy_helper.to_array(want))


def test_a_file_touched_while_mapped_is_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    path, _ = _saved(tmp_path, rng)
    load_model_mapped(path)
    _, views, fm = load_model_mapped(path)
    assert fm is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place, as a save would
    del views
    assert not fm.release()


def test_bytes_a_proto_and_an_old_opset_are_not_mapped(tmp_path: Path, rng: np.random.Generator) -> None:
    _, model = _saved(tmp_path, rng)
    assert load_model_mapped(model)[2] is None
    assert load_model_mapped(model.SerializeToString())[2] is None
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    for init in model.graph.initializer:  # IR version 3: an initializer is a graph input too
        graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    old_path = tmp_path / "old.onnx"
    onnx.save(old, str(old_path))
    load_model_mapped(old_path)
    upgraded, views, fm = load_model_mapped(old_path)  # checked before, but converted: nothing views the file
    assert fm is None and views == {} and load.default_opset(upgraded) >= load.MIN_OPSET


@pytest.mark.gpu
def test_a_warm_gpu_session_releases_the_map_in_its_open(tmp_path: Path, rng: np.random.Generator,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No view of the map outlives a GPU session's open (the weights are on the device), and
    the session's output agrees with ONNX Runtime's."""
    import fusegraph.onnx as fgo
    from fusegraph.onnx import session as session_mod

    path, _ = _saved(tmp_path, rng)
    maps: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = load_model_mapped(*args, **kwargs)
        maps.append(out[2])
        return out

    monkeypatch.setattr(session_mod, "load_model_mapped", spy)
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    opts = [{"device": "cuda:0"}, {}]
    for _ in range(2):  # the first open checks and records the file, the second maps it
        s = fgo.InferenceSession(str(path), providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                 provider_options=opts)
        got = s.run(None, {"x": x})[0]
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert rel < 1e-5, rel
        s.wait_for_evaluation(120)
        del s
    assert maps[0] is None and maps[-1] is not None
    assert maps[-1].closed, "a view of the mapped file outlived the GPU session's open"

"""A warm session's setup skips ``onnx.checker`` for a model file this fusegraph and ONNX
version already checked (issue 24 item 6): the record in the cache directory is keyed by the
file's resolved path, size and mtime, so a file changed since is checked again, a model given
as bytes or a ModelProto is always checked, a refused model is refused every time, and with
the cache off nothing is skipped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx import load as load_mod
from fusegraph.onnx.model import ModelError, load_model

pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]


def _model(rng: np.random.Generator, nodes: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w")
    nodes = nodes or [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class _Spy:
    """Counts ``onnx.checker.check_model`` calls, and lets each run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = onnx.checker.check_model

        def spy(model: Any, *args: Any, **kwargs: Any) -> None:
            self.calls += 1
            real(model, *args, **kwargs)

        monkeypatch.setattr(onnx.checker, "check_model", spy)


def test_second_load_of_a_file_skips_the_checker(tmp_path: Path, rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), str(path))
    spy = _Spy(monkeypatch)
    first = load_model(path)
    assert spy.calls == 1
    second = load_model(str(path))
    assert spy.calls == 1, "the unchanged file was checked again"
    assert second.SerializeToString() == first.SerializeToString()
    assert (tmp_path / load_mod.CHECKED_FILE).is_file()  # own_cache: the test's directory


def test_a_changed_file_is_checked_again(tmp_path: Path, rng: np.random.Generator,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), str(path))
    spy = _Spy(monkeypatch)
    load_model(path)
    # the same size, a new mtime: a rewritten file of the same shape
    onnx.save(_model(rng), str(path))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    load_model(path)
    assert spy.calls == 2
    # a malformed model written over it: refused, and refused again (nothing recorded)
    bad = _model(rng, [helper.make_node("Add", ["x", "ghost"], ["y"])])
    onnx.save(bad, str(path))
    for _ in range(2):
        with pytest.raises(ModelError, match="the ONNX checker rejects the model"):
            load_model(path)
    assert spy.calls == 4


def test_bytes_and_protos_are_always_checked(tmp_path: Path, rng: np.random.Generator,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(rng)
    spy = _Spy(monkeypatch)
    for source in (m.SerializeToString(), m, m.SerializeToString(), m):
        load_model(source)
    assert spy.calls == 4


def test_cache_off_or_elsewhere(tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), str(path))
    spy = _Spy(monkeypatch)
    other = tmp_path / "other-cache"
    load_model(path, cache_dir=other)
    load_model(path, cache_dir=other)
    assert spy.calls == 1 and (other / load_mod.CHECKED_FILE).is_file()
    load_model(path)  # the default directory has no record yet
    assert spy.calls == 2
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")
    load_model(path)
    load_model(path)
    assert spy.calls == 4


def test_unwritable_cache_still_loads(tmp_path: Path, rng: np.random.Generator,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), str(path))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    spy = _Spy(monkeypatch)
    for _ in range(2):
        load_model(path, cache_dir=blocker)
    assert spy.calls == 2


def test_sessions_opened_twice_check_once_and_agree(tmp_path: Path, rng: np.random.Generator,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), str(path))
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    spy = _Spy(monkeypatch)
    opts = {"floor_mode": "inline", "floor": "off", "runners": "off"}
    for _ in range(2):
        sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[opts, {}])
        (got,) = sess.run(None, {"x": x})
        err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert np.isfinite(got).all() and err < 1e-5, err
    assert spy.calls == 1

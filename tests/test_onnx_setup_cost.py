"""What the cuts to a session's setup (issue 24 item 6) must not change: a model read from a
file or bytes is checked by ``onnx.checker`` on the bytes as read (no re-serialization) and
refused with the same ModelError as the parsed model; a model that took external data, or
whose bytes the checker's parser refuses, is checked as a ModelProto; text formats still
load; the region path's weights, left in the model's order by the importer and laid out
while copied to the device, give ONNX Runtime's outputs, a session opened twice included;
a plan with no ONNX Runtime unit makes no ``ort.SessionOptions``, and a plan with one still
tells ONNX Runtime not to spin. No timing is asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx import plan as plan_mod
from fusegraph.onnx.importer import Importer
from fusegraph.onnx.model import ModelError, load_model, specialize

pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]
REGIONS: dict[str, Any] = {"device": "cpu", "regions": "on", "engine": "torch", "floor_mode": "inline",
                           "runners": "off"}


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], x: list[int], y: list[int]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", [_vi("x", x)], [_vi("y", y)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _w(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


def _malformed() -> onnx.ModelProto:
    """Passes the loader's own hostile-model checks; the ONNX checker refuses it (a node
    reads a value nothing defines)."""
    return _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="add")], [], [2, 3], [2, 3])


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got64.shape == want64.shape and np.isfinite(got64).all()
    return float(np.linalg.norm(got64 - want64) / np.linalg.norm(want64))


class _Spy:
    """Records what ``onnx.checker.check_model`` is handed, and lets it run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: list[str] = []
        real = onnx.checker.check_model

        def spy(model: Any, *args: Any, **kwargs: Any) -> None:
            self.kinds.append(type(model).__name__)
            real(model, *args, **kwargs)

        monkeypatch.setattr(onnx.checker, "check_model", spy)


# ---- the checker ---------------------------------------------------------------------------------
def test_malformed_model_refused_alike_by_path_bytes_and_proto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _malformed()
    path = tmp_path / "bad.onnx"
    onnx.save(m, str(path))
    spy = _Spy(monkeypatch)
    said = []
    for source in (str(path), path.read_bytes(), m):
        with pytest.raises(ModelError, match="the ONNX checker rejects the model") as info:
            load_model(source)
        said.append(str(info.value))
    assert said[0] == said[1] == said[2], said
    assert "ghost" in said[0]
    # a path and bytes: the checker read the bytes as they were read; a ModelProto: itself
    assert spy.kinds == ["bytes", "bytes", "ModelProto"]
    with pytest.raises(ModelError, match="the ONNX checker rejects the model"):  # the session too
        fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[{"floor_mode": "inline"}, {}])


def test_checker_parse_refusal_falls_back_to_the_parsed_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the checker's parser refuses the bytes (a ValueError, as for malformed bytes),
    the parsed ModelProto is checked: never skipped, as the over-2-GB ValueError is."""
    path = tmp_path / "bad.onnx"
    onnx.save(_malformed(), str(path))
    real = onnx.checker.check_model
    kinds: list[str] = []

    def picky(model: Any, *args: Any, **kwargs: Any) -> None:
        kinds.append(type(model).__name__)
        if isinstance(model, bytes):
            raise ValueError("Unable to parse proto from the given bytes")
        real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", picky)
    with pytest.raises(ModelError, match=r"the ONNX checker rejects the model.*ghost"):
        load_model(str(path))
    assert kinds == ["bytes", "ModelProto"]


def test_external_data_is_checked_as_the_completed_model(tmp_path: Path, rng: np.random.Generator,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With external data read in, the bytes on disk are not the whole model: the checker is
    handed the ModelProto (and the session still agrees with ONNX Runtime)."""
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_w(rng, "w", (64, 48))], [4, 64], [4, 48])
    path = tmp_path / "ext.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
              size_threshold=0)
    spy = _Spy(monkeypatch)
    loaded = load_model(str(path))
    assert spy.kinds == ["ModelProto"]
    assert loaded.graph.initializer[0].data_location == TensorProto.DEFAULT
    x = rng.standard_normal((4, 64)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[REGIONS, {}]).run(None, {"x": x})[0]
    assert _rel(got, want) < 1e-5


def test_text_format_still_loads_by_its_extension(tmp_path: Path, rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [], [3, 5], [3, 5])
    path = tmp_path / "m.textproto"
    onnx.save(m, str(path), format="textproto")
    spy = _Spy(monkeypatch)
    loaded = load_model(str(path))
    assert spy.kinds == ["ModelProto"]
    assert [n.op_type for n in loaded.graph.node] == ["Relu"]
    bad = tmp_path / "bad.textproto"
    onnx.save(_malformed(), str(bad), format="textproto")
    with pytest.raises(ModelError, match="the ONNX checker rejects the model"):
        load_model(str(bad))


# ---- the region path's weights -----------------------------------------------------------------
def _mixed(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv (a filter the torch engine wants KRSC), Gemm with transB, MatMul whose B the
    torch engine wants column-major, a bias, and a MatMul over a constant that folds to a
    view with a negative stride (Slice with step -1)."""
    inits = [_w(rng, "wc", (6, 3, 3, 3)), _w(rng, "wg", (16, 96)), _w(rng, "bg", (16,)),
             _w(rng, "wm", (16, 24)), _w(rng, "wr", (24, 10)),
             numpy_helper.from_array(np.array([-1], np.int64), "start"),
             numpy_helper.from_array(np.array([-(2**62)], np.int64), "end"),
             numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array([-1], np.int64), "step"),
             numpy_helper.from_array(np.array([2, 96], np.int64), "shape")]
    nodes = [
        helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["g"], name="gemm", transB=1),
        helper.make_node("MatMul", ["g", "wm"], ["m"], name="mm"),
        helper.make_node("Slice", ["wr", "start", "end", "axes", "step"], ["wrr"], name="rev"),
        helper.make_node("MatMul", ["m", "wrr"], ["y"], name="mm_rev"),
    ]
    return _model(nodes, inits, [2, 3, 4, 4], [2, 10])


def test_region_path_twice_agrees_with_onnxruntime(tmp_path: Path, rng: np.random.Generator) -> None:
    """The importer leaves the region path's weights as the model holds them and the upload
    lays them out (filters, column-major matrices, a reversed constant); a second session in
    the same process (verdicts cached) gives the same outputs as the first and as ONNX
    Runtime, on fresh inputs each time."""
    path = tmp_path / "mixed.onnx"
    onnx.save(_mixed(rng), str(path))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(2):
        sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[REGIONS, {}])
        report = sess.partition_report()
        assert report.subgraphs and report.subgraphs[0].regions, str(report)
        x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        assert _rel(got, ref.run(None, {"x": x})[0]) < 1e-5
        assert _rel(sess.run(None, {"x": x})[0], got) == 0.0


@pytest.mark.gpu
def test_region_path_on_the_gpu_lays_weights_out_there(tmp_path: Path, rng: np.random.Generator) -> None:
    """On a GPU the weights go up in the model's order and are laid out on the device (filters
    KRSC, column-major matrices, a reversed constant): twice in one process, against ONNX
    Runtime on fresh inputs."""
    path = tmp_path / "mixed.onnx"
    onnx.save(_mixed(rng), str(path))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(2):
        sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[{**REGIONS, "device": "cuda:0"}, {}])
        x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
        assert _rel(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]) < 1e-5


def test_unpacked_importer_keeps_the_model_order_without_copying(rng: np.random.Generator) -> None:
    """pack=False (the region path): every weight in its logical row-major order with the
    packed importer's values; the conv filter and the MatMul's B are the model's own arrays
    (no copy), where packing lays them out anew (KRSC, column-major)."""
    og = specialize(load_model(_mixed(rng)), {"x": (2, 3, 4, 4)})
    imps = {}
    for pack in (False, True):
        imp = Importer(og, f"u{pack}", channels_last=True, filter_layout="KRSC", pack=pack)
        for n in og.nodes:
            imp.lower(n)
        imps[pack] = imp
    loose, packed = imps[False].weights, imps[True].weights
    assert loose.keys() == packed.keys() and len(loose) >= 5
    for name, arr in loose.items():
        t = imps[False].g.tensor_by_name(name)
        assert arr.flags.c_contiguous and arr.shape == t.shape
        np.testing.assert_array_equal(arr, packed[name])
    for const in ("wc", "wm"):
        src = og.constants[const]
        assert any(np.shares_memory(src, a) for a in loose.values()), const
        assert not any(np.shares_memory(src, a) for a in packed.values()), const


# ---- ONNX Runtime's session options ------------------------------------------------------------
def _count_session_options(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made = [0]
    real = ort.SessionOptions

    def counting() -> ort.SessionOptions:
        made[0] += 1
        return real()

    monkeypatch.setattr(plan_mod.ort, "SessionOptions", counting)
    return made


def test_no_session_options_without_an_onnxruntime_unit(tmp_path: Path, rng: np.random.Generator,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mm.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_w(rng, "w", (32, 8))],
                     [4, 32], [4, 8]), str(path))
    made = _count_session_options(monkeypatch)
    sess = fgo.InferenceSession(str(path), providers=PROVIDERS, provider_options=[REGIONS, {}])
    x = rng.standard_normal((4, 32)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _rel(sess.run(None, {"x": x})[0], want) < 1e-5
    assert [s.kind for s in sess.partition_report().subgraphs] == ["fusegraph"]
    assert made == [0]


def test_onnxruntime_units_still_do_not_spin(tmp_path: Path, rng: np.random.Generator,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan with fusegraph units and an ONNX Runtime unit (Softmax excluded) opens the
    latter with intra-op spinning off, as before the options were made lazily."""
    path = tmp_path / "mix.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                      helper.make_node("Softmax", ["h"], ["s"], name="sm", axis=-1),
                      helper.make_node("MatMul", ["s", "w2"], ["y"], name="mm2")],
                     [_w(rng, "w", (32, 8)), _w(rng, "w2", (8, 8))], [4, 32], [4, 8]), str(path))
    made = _count_session_options(monkeypatch)
    sess = fgo.InferenceSession(str(path), providers=PROVIDERS,
                                provider_options=[{**REGIONS, "op_types_to_exclude": "Softmax"}, {}])
    x = rng.standard_normal((4, 32)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _rel(sess.run(None, {"x": x})[0], want) < 1e-5
    plan = sess._last
    assert plan is not None
    assert sorted(s.kind for s in plan.report().subgraphs) == ["fusegraph", "fusegraph", "onnxruntime"]
    assert made == [1]
    assert plan.sub_session_options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


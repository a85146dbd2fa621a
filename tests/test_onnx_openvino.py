"""Whole-model runners (fusegraph/onnx/openvino_runner.py, floor.choose_runner, direct.py): the
whole model on OpenVINO's CPU plugin or on ONNX Runtime without spinning, measured against the
incumbent (the caller's ONNX Runtime session or fusegraph's plan) and kept only where clearly
faster and in agreement. Numerics against ONNX Runtime on fresh random data; timings injected
(a fake timer replaces ``floor.time_pair``), never asserted."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_floor import _chain, fake_timer  # noqa: F401  (fixture)

import fusegraph.onnx as fgo
import fusegraph.onnx.session as session_module
from fusegraph.onnx import background, direct, floor, openvino_runner
from fusegraph.onnx.openvino_runner import OpenVinoRunner, OpenVinoUnavailable
from fusegraph.onnx.options import ProviderOptions
from fusegraph.onnx.session import session_handle
from fusegraph.select.device_id import device_id

HAVE_OV = importlib.util.find_spec("openvino") is not None
needs_ov = pytest.mark.skipif(not HAVE_OV, reason="openvino is not installed (the openvino extra)")


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and not np.isnan(g).any()
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: Sequence[tuple[str, np.ndarray]] = (), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _conv_net(rng: np.random.Generator) -> onnx.ModelProto:
    """conv -> bias -> relu -> global pool -> flatten -> gemm, plus the input's shape as an int64 output."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["q"]),
        helper.make_node("Gemm", ["q", "fc", "fb"], ["y"], transB=1),
        helper.make_node("Shape", ["x"], ["s"]),
    ]
    inits = [("w", rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3),
             ("b", rng.standard_normal(8).astype(np.float32)),
             ("fc", rng.standard_normal((5, 8)).astype(np.float32)),
             ("fb", rng.standard_normal(5).astype(np.float32))]
    return _model(nodes, [helper.make_tensor_value_info("x", f, [2, 3, 12, 12])],
                  [helper.make_tensor_value_info("y", f, [2, 5]), helper.make_tensor_value_info("s", TensorProto.INT64, [4])],
                  inits)


def _attention(rng: np.random.Generator) -> onnx.ModelProto:
    """softmax(x Wq (x Wk)^T / 4) x Wv, then a layer norm: transformer-block numerics."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["a"], axis=-1),
        helper.make_node("MatMul", ["a", "v"], ["o"]),
        helper.make_node("LayerNormalization", ["o", "g", "be"], ["y"], axis=-1, epsilon=1e-5),
    ]
    inits = [(n, rng.standard_normal((16, 16)).astype(np.float32) * 0.25) for n in ("wq", "wk", "wv")]
    inits += [("scale", np.array(0.25, np.float32)), ("g", rng.standard_normal(16).astype(np.float32)),
              ("be", rng.standard_normal(16).astype(np.float32))]
    return _model(nodes, [helper.make_tensor_value_info("x", f, [2, 10, 16])],
                  [helper.make_tensor_value_info("y", f, [2, 10, 16])], inits)


# ---- the runner ------------------------------------------------------------------------------------
@needs_ov
@pytest.mark.parametrize("build", [_conv_net, _attention])
def test_openvino_runner_agrees_with_onnxruntime(build: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    model = build(rng)
    data = model.SerializeToString()
    ref = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    runner = OpenVinoRunner(data, cache_dir=tmp_path / "ov")
    names = [o.name for o in model.graph.output]
    for _ in range(2):  # fresh data each call: the runner's buffers are reused, its outputs must not be
        x = rng.standard_normal(shape).astype(np.float32)
        got, want = runner.run(names, {"x": x}), ref.run(names, {"x": x})
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            if w.dtype.kind == "f":
                assert _rel(g, w) <= 1e-5, _rel(g, w)
            else:
                np.testing.assert_array_equal(g, w)
    first = runner.run(names[:1], {"x": x})[0]
    runner.run(names[:1], {"x": rng.standard_normal(shape).astype(np.float32)})
    assert _rel(first, want[0]) <= 1e-5, "an earlier call's output changed under the next call"


@needs_ov
def test_openvino_runner_takes_the_sessions_static_shapes(rng: np.random.Generator) -> None:
    f = TensorProto.FLOAT
    w = rng.standard_normal((6, 4)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [helper.make_tensor_value_info("x", f, ["n", 6])],
                   [helper.make_tensor_value_info("y", f, ["n", 4])], [("w", w)])
    with pytest.raises(OpenVinoUnavailable, match="dynamic"):
        OpenVinoRunner(model.SerializeToString())
    runner = OpenVinoRunner(model.SerializeToString(), {"x": (3, 6)})
    x = rng.standard_normal((3, 6)).astype(np.float32)
    assert _rel(runner.run(["y"], {"x": x})[0], x @ w) <= 1e-5


@needs_ov
def test_openvino_refusal_is_a_typed_reason() -> None:
    f = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("Mystery", ["x"], ["y"], domain="example.custom")], "m",
                          [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)])
    with pytest.raises(OpenVinoUnavailable, match="OpenVINO cannot compile the model") as info:
        OpenVinoRunner(m.SerializeToString())
    assert "Mystery" in str(info.value) and "Exception from" not in str(info.value)


def test_unavailable_without_openvino(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator, tmp_path: Path,
                                      fake_timer: Any) -> None:  # noqa: F811
    real = importlib.util.find_spec
    monkeypatch.setattr(openvino_runner.importlib.util, "find_spec",
                        lambda name, *a: None if name == "openvino" else real(name, *a))
    assert "not installed" in (openvino_runner.unavailable() or "")
    with pytest.raises(OpenVinoUnavailable, match="not installed"):
        OpenVinoRunner(b"")
    # The session goes on without it; the report says why OpenVINO was not timed.
    timer = fake_timer([(2.0, 1.0), (2.0, 1.0)])  # both claimed units lose: the whole model on ORT
    model = _chain(rng)
    sess = _session(model, tmp_path, runners="openvino")
    assert timer.calls == 2 and sess._direct is None
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["onnxruntime"]
    assert len(rep.runners) == 1 and "OpenVINO: refused -- openvino is not installed" in rep.runners[0]
    _agrees(sess, model, rng)


# ---- the choice ----------------------------------------------------------------------------------
class FakeRunner:
    def __init__(self, name: str, fn: Any) -> None:
        self.name = name
        self.fn = fn
        self.calls = 0

    def run(self, wanted: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any = None) -> list[Any]:
        self.calls += 1
        return [self.fn(feed["x"])]


def test_choose_runner_keeps_only_a_clear_win_and_says_why_of_each(fake_timer: Any) -> None:  # noqa: F811
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    want = [np.tanh(x)]

    def broken() -> FakeRunner:
        raise OpenVinoUnavailable("OpenVINO cannot compile the model: No conversion rule found for Mystery")

    candidates = {
        "openvino": lambda: FakeRunner("openvino", np.tanh),
        "ort-nospin": lambda: FakeRunner("ort-nospin", np.tanh),
    }
    timer = fake_timer([(0.99, 1.0), (0.8, 1.0)])  # openvino: within the margin; no-spin: clear
    runner, v = floor.choose_runner(lambda: None, "ONNX Runtime", candidates, {"x": x}, ["y"], want, 1.0)
    assert timer.calls == 2 and isinstance(runner, FakeRunner) and runner.name == "ort-nospin"
    assert v.runner == "ort-nospin" and (v.fusegraph_ms, v.ort_ms) == (0.8, 1.0) and not v.keep
    assert "0.99x: not faster" in v.candidates[0] and "0.80x: faster" in v.candidates[1]
    assert "ONNX Runtime without spinning 0.800 ms vs ONNX Runtime 1.000 ms" in v.describe()

    timer = fake_timer([(1.0, 1.0)])  # a tie goes to the incumbent
    runner, v = floor.choose_runner(lambda: None, "fusegraph's plan", {"openvino": candidates["openvino"]},
                                    {"x": x}, ["y"], want, 1.0)
    assert runner is None and not v.runner and "vs fusegraph's plan 1.000 ms" in v.candidates[0]

    off = {"openvino": broken, "ort-nospin": lambda: FakeRunner("ort-nospin", lambda a: np.tanh(a) * (1 + 1e-3))}
    timer = fake_timer([])
    runner, v = floor.choose_runner(lambda: None, "ONNX Runtime", off, {"x": x}, ["y"], want, 1.0)
    assert runner is None and timer.calls == 0, "refused candidates are never timed"
    assert "OpenVINO: refused -- OpenVINO cannot compile the model: No conversion rule found for Mystery" in v.candidates[0]
    assert "refused -- disagrees with ONNX Runtime (rel err 1.0e-03" in v.candidates[1]
    wrong_type = {"openvino": lambda: FakeRunner("openvino", lambda a: np.tanh(a).astype(np.float64))}
    _, v = floor.choose_runner(lambda: None, "ONNX Runtime", wrong_type, {"x": x}, ["y"], want, 1.0)
    assert "output y is float64[3, 4], ONNX Runtime's float32[3, 4]" in v.candidates[0]


def test_verdicts_round_trip_with_their_runner() -> None:
    v = floor.Verdict(False, 0.5, 1.0, "measured", "", "openvino", ("OpenVINO 0.500 ms vs ...",), "fusegraph's plan")
    back = floor.Verdict.from_json(v.to_json())
    assert back is not None and (back.runner, back.candidates, back.against, back.source) == (
        "openvino", v.candidates, "fusegraph's plan", "cached")
    assert "on OpenVINO -- OpenVINO 0.500 ms vs fusegraph's plan 1.000 ms (cached)" in back.describe()
    assert floor.Verdict.from_json({**v.to_json(), "runner": "tvm"}) is None, "an unknown runner is measured again"
    assert floor.Verdict.from_json({"keep": True}) == floor.Verdict(True, source="cached")  # older entries


# ---- in a session ----------------------------------------------------------------------------------
def _session(model: onnx.ModelProto, cache: Path, **opts: Any) -> fgo.InferenceSession:
    o = {"engine": "reference", "torch_mlir_tier": "off", "op_types_to_exclude": "Neg", "floor": "on",
         "floor_mode": "inline", "cache_dir": str(cache), **opts}
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, o), "CPUExecutionProvider"])


def _agrees(sess: fgo.InferenceSession, model: onnx.ModelProto, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,), (want,) = sess.run(None, {"x": x}), ref.run(None, {"x": x})
    assert _rel(got, want) <= 1e-5, _rel(got, want)


def test_a_faster_runner_runs_the_session_and_later_sessions_from_the_cache(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any  # noqa: F811
) -> None:
    model = _chain(rng)
    timer = fake_timer([(2.0, 1.0), (2.0, 1.0), (0.6, 1.0)])  # units lose; the whole model: no-spin wins
    sess = _session(model, tmp_path, runners="ort-nospin")
    assert timer.calls == 3
    assert sess._direct is not None and isinstance(sess._direct.runner, direct.OrtRunner)
    assert sess._direct.runner.name == "ort-nospin" and sess._last is None, "the plan is dropped"
    rep = sess.partition_report()
    assert [(s.kind, s.fusegraph_ms, s.ort_ms) for s in rep.subgraphs] == [("ort-nospin", 0.6, 1.0)]
    assert "whole model floor: on ONNX Runtime without spinning -- ONNX Runtime without spinning 0.600 ms" in rep.floor
    assert "whole-model runners" in str(rep) and "0.60x: faster" in rep.runners[0]
    assert "the whole model on ONNX Runtime without spinning" in rep.summary()
    _agrees(sess, model, rng)

    fake_timer([])  # a later session decides from the cached verdicts: nothing timed
    again = _session(model, tmp_path, runners="ort-nospin")
    assert again._direct is not None and again._direct.runner.name == "ort-nospin"
    assert "(cached)" in again.partition_report().floor
    _agrees(again, model, rng)


def test_runners_off_or_a_pinned_engine_measure_none(rng: np.random.Generator, tmp_path: Path,
                                                     fake_timer: Any) -> None:  # noqa: F811
    timer = fake_timer([(2.0, 1.0), (2.0, 1.0)])
    sess = _session(_chain(rng), tmp_path / "a", runners="off")
    assert timer.calls == 2 and sess._direct is None and not sess.partition_report().runners
    sess = _session(_chain(rng), tmp_path / "b", runners="ort-nospin", floor="auto")  # floor off: engine pinned
    assert timer.calls == 2 and sess._direct is None and not sess.partition_report().runners


def test_a_runner_that_fails_to_start_later_leaves_the_plan(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    model = _chain(rng)
    fake_timer([(2.0, 1.0), (2.0, 1.0), (0.6, 1.0)])
    _session(model, tmp_path, runners="ort-nospin")

    def fails(*args: Any) -> Any:
        raise RuntimeError("no such runtime here")

    monkeypatch.setattr(session_module, "make_runner", fails)
    fake_timer([])
    sess = _session(model, tmp_path, runners="ort-nospin")
    assert sess._direct is None and sess._last is not None
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["onnxruntime"]
    _agrees(sess, model, rng)


@needs_ov
def test_openvino_in_a_session_agrees(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:  # noqa: F811
    model = _chain(rng)
    fake_timer([(2.0, 1.0), (2.0, 1.0), (0.5, 1.0)])
    sess = _session(model, tmp_path, runners="openvino")
    assert sess._direct is not None and isinstance(sess._direct.runner, OpenVinoRunner)
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["openvino"] and "on OpenVINO" in rep.floor
    _agrees(sess, model, rng)
    assert list((tmp_path / openvino_runner.CACHE_SUBDIR).iterdir()), "OpenVINO's compiled model is cached"


def _finished(tmp_path: Path, won: floor.Verdict) -> Any:
    class Finished:
        log_path = tmp_path / "fake.log"

        def done(self) -> bool:
            return True

        def wait(self, timeout: float | None = None) -> bool:
            return True

        def verdict(self) -> floor.Verdict:
            return won

        def describe(self) -> str:
            return "finished"

    return Finished()


@needs_ov
def test_background_verdict_for_openvino_switches_the_running_session(
    rng: np.random.Generator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _chain(rng)
    won = floor.Verdict(False, 0.5, 1.0, "cached", "", "openvino", ("OpenVINO 0.500 ms vs ONNX Runtime 1.000 ms",))
    monkeypatch.setattr(background, "launch", lambda *a: _finished(tmp_path, won))
    sess = _session(model, tmp_path, floor_mode="background", runners="openvino")
    assert sess._direct is not None and isinstance(sess._direct.runner, direct.OrtRunner)  # meanwhile
    assert sess.wait_for_evaluation(timeout=120)
    assert sess._direct is not None and isinstance(sess._direct.runner, OpenVinoRunner)
    assert [s.kind for s in sess.partition_report().subgraphs] == ["openvino"]
    _agrees(sess, model, rng)


def test_background_child_records_a_runner_and_warm_sessions_open_it_without_parsing(
    rng: np.random.Generator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real child (python -m fusegraph.onnx.evaluate) measures the whole-model runners too;
    its verdict (whichever way its timing came out) is recorded with every runner's line, and
    a later session follows it without parsing the model where it names ONNX Runtime."""
    model = _chain(rng)
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    sess = _session(model, tmp_path, floor_mode="background", runners="ort-nospin")  # bytes
    assert sess.wait_for_evaluation(timeout=300), "the background evaluation did not finish in 300 s"
    verdict = sess._direct.verdict if sess._direct is not None else None
    assert verdict is not None and len(verdict.candidates) == 1, verdict
    assert "ONNX Runtime without spinning" in verdict.candidates[0] and "vs ONNX Runtime" in verdict.candidates[0]
    _agrees(sess, model, rng)
    # A recorded verdict naming ORT without spinning: the warm session opens it directly.
    won = floor.Verdict(False, 0.6, 1.0, "measured", "", "ort-nospin", ("ONNX Runtime without spinning 0.600 ms ...",))
    source = background.source_of(str(path))
    assert source is not None
    opts = ProviderOptions.parse({"engine": "reference", "torch_mlir_tier": "off", "op_types_to_exclude": "Neg",
                                  "floor": "on", "floor_mode": "background", "runners": "ort-nospin",
                                  "cache_dir": str(tmp_path)})
    cache = floor.cache_for(opts, device_id(session_handle(opts)))
    cache.record(source.content, won)
    cache.flush()
    warm = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, opts.as_strings()), "CPUExecutionProvider"])
    assert warm._direct is not None and warm._direct.evaluation is None and warm._model_value is None
    assert isinstance(warm._direct.runner, direct.OrtRunner) and warm._direct.runner.name == "ort-nospin"
    _agrees(warm, model, rng)
    rep = warm.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["ort-nospin"] and "(cached)" in rep.floor
    # The child never sees the caller's session options: where the caller gave some, they stand.
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    mine = fgo.InferenceSession(str(path), sess_options=so,
                                providers=[(fgo.PROVIDER, opts.as_strings()), "CPUExecutionProvider"])
    assert mine._direct is not None and mine._direct.runner.name == "onnxruntime"
    assert mine._direct.verdict is not None and "session options stand" in mine._direct.verdict.why
    assert [s.kind for s in mine.partition_report().subgraphs] == ["onnxruntime"]
    _agrees(mine, model, rng)


@pytest.mark.parametrize(("raw", "want"), [("auto", "auto"), ("", "auto"), ("on", "auto"), ("off", "off"), ("0", "off"),
                                           ("openvino", "openvino"), (" ort-nospin , openvino", "ort-nospin,openvino"),
                                           (["openvino"], "openvino"), ([], "off")])
def test_runners_option(raw: Any, want: str) -> None:
    opts = ProviderOptions.parse({"runners": raw})
    assert opts.runners == want
    assert ProviderOptions.parse(opts.as_strings()).runners == want


def test_runners_option_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"runners.*tvm"):
        ProviderOptions.parse({"runners": "openvino,tvm"})


def test_runner_choice_enters_the_verdict_key() -> None:
    dev = "cpu-test"
    a = floor.cache_for(ProviderOptions.parse({"runners": "off"}), dev).settings
    b = floor.cache_for(ProviderOptions.parse({"runners": "openvino"}), dev).settings
    assert a != b and openvino_runner.version() in a

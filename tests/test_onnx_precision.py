"""The ``precision`` provider option (fusegraph/onnx/precision.py, issue 24 item 4): option
parsing; fp16 / bf16 on the region path on the CPU (the torch engine) against ONNX Runtime's
float32 results on fresh random inputs (fp16 <= 1e-2, bf16 <= 2e-2 relative; outputs in the
model's declared float32); the report's accuracy line and per-region precision; regions
kept float32 with the reason (an unscaled softmax, values observed beyond fp16's range, a
constant beyond it); tf32 on the CPU (no effect, said so); verdicts keyed per precision;
one GPU-marked test on cuda:0."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.dtypes import DataType
from fusegraph.errors import OptionError
from fusegraph.onnx import precision
from fusegraph.onnx.options import ProviderOptions
from fusegraph.onnx.report import RegionEntry

pytest.importorskip("torch", reason="the region path passes torch tensors (fusegraph[torch])")
pytestmark = pytest.mark.usefixtures("own_cache")

from test_onnx_regions import MODELS, _fake_floor, _rows  # noqa: E402  (torch needed first)

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]
BASE: dict[str, Any] = {"device": "cpu", "regions": "on", "engine": "torch", "floor_mode": "inline", "runners": "off",
                        "floor": "off"}
TOL = {"fp16": 1e-2, "bf16": 2e-2, "tf32": 1e-5, "fp32": 1e-5}  # ||got - ort|| / ||ort||


def _session(model: onnx.ModelProto, **opts: Any) -> fgo.InferenceSession:
    return fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[{**BASE, **opts}, {}])


def _versus_ort(sess: fgo.InferenceSession, model: onnx.ModelProto, shape: tuple[int, ...],
                rng: np.random.Generator, rel: float, scale: float = 1.0) -> float:
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    worst = 0.0
    for _ in range(2):  # the second run is a warm one
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        want = ref.run(None, {"x": x})[0]
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == want.shape
        assert np.isfinite(got).all()
        err = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
        assert err <= rel, f"relative error {err:.2e} > {rel} (max abs {np.abs(got - want).max():.2e})"
        worst = max(worst, err)
    return worst


def _model(name: str, nodes: list[onnx.NodeProto], x: list[int], y: list[int],
           inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # the GPU machine's ORT reads <= 13


def _w(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def unscaled_softmax(rng: np.random.Generator) -> onnx.ModelProto:
    """MatMul -> Softmax (no scale: not attention) -> MatMul."""
    inits = [_w(rng, "w1", (32, 16), 0.3), _w(rng, "w2", (16, 8), 0.3)]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="logits"),
             helper.make_node("Softmax", ["h"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "w2"], ["y"], name="out")]
    return _model("unscaled_softmax", nodes, [8, 32], [8, 8], inits)


def large_values(rng: np.random.Generator) -> onnx.ModelProto:
    """Gemm with weights ~1e4 (outputs beyond fp16's headroom) -> Relu -> Gemm scaling back."""
    inits = [_w(rng, "w1", (32, 16), 1e4), _w(rng, "b1", (16,), 1.0), _w(rng, "w2", (16, 8), 1e-4)]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="big"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="small")]
    return _model("large_values", nodes, [8, 32], [8, 8], inits)


def large_constant() -> onnx.ModelProto:
    """x * 1e5 * 1e-5: the first constant is beyond fp16's range."""
    inits = [numpy_helper.from_array(np.array(1e5, np.float32), "big"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "small")]
    nodes = [helper.make_node("Mul", ["x", "big"], ["h"], name="up"),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("Mul", ["t", "small"], ["y"], name="down")]
    return _model("large_constant", nodes, [4, 8], [4, 8], inits)


# ---- options --------------------------------------------------------------------------------------
def test_the_option_parses_its_values_and_refuses_the_rest() -> None:
    assert ProviderOptions.parse({}).precision == "fp32"
    for raw, want in (("fp16", "fp16"), ("half", "fp16"), ("float16", "fp16"), ("BF16", "bf16"),
                      ("bfloat16", "bf16"), ("tf32", "tf32"), ("float32", "fp32"), ("", "fp32")):
        assert ProviderOptions.parse({"precision": raw}).precision == want, raw
    assert ProviderOptions.parse({"precision": "bf16"}).as_strings()["precision"] == "bf16"
    with pytest.raises(OptionError, match=r"precision='fp8'.*expected one of \['fp32', 'fp16', 'bf16', 'tf32'\]"):
        ProviderOptions.parse({"precision": "fp8"})  # a fusegraph error, and a ValueError
    with pytest.raises(ValueError, match=r"precision=.fp16. needs the region path .* regions=off"):
        ProviderOptions.parse({"precision": "fp16", "regions": "off"})
    assert ProviderOptions.parse({"precision": "fp32", "regions": "off"}).regions == "off"


def test_reduced_precision_turns_the_region_path_on_where_regions_is_auto() -> None:
    from fusegraph.onnx import region_choice
    from fusegraph.runtime.handle import Handle

    cpu = Handle("cpu")
    assert not region_choice.wanted(ProviderOptions.parse({}), cpu)
    assert region_choice.wanted(ProviderOptions.parse({"precision": "bf16"}), cpu)
    assert not region_choice.wanted(ProviderOptions.parse({"precision": "tf32"}), cpu)  # float32 storage


# ---- fp16 / bf16 against ONNX Runtime's float32 ------------------------------------------------------
@pytest.mark.parametrize("prec", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_reduced_precision_agrees_with_float32_onnx_runtime(name: str, prec: str, rng: np.random.Generator) -> None:
    make, shape = MODELS[name]
    model = make(rng)
    sess = _session(model, precision=prec)
    err = _versus_ort(sess, model, shape, rng, TOL[prec])
    report = sess.partition_report()
    rows = _rows(report)
    assert all(r.why.endswith(f"[{prec}]") for r in rows), str(report)
    floor = report.subgraphs[0].floor
    m = re.search(rf"precision {prec}: (\d+)/(\d+) regions in {prec}; against the float32 path on the unit's "
                  r"sample inputs: relative error (\S+) \(max abs (\S+), max abs / max \|fp32\| (\S+)\)", floor)
    assert m is not None, floor
    assert m.group(1) == m.group(2) == str(len(rows))
    stated = float(m.group(3))
    assert 0 < stated <= TOL[prec], floor  # measured (a reduced type is never exact) and within its tolerance
    assert err > 1e-7  # the regions really ran in the reduced type (float32 agrees to ~1e-7)


def test_regions_auto_on_the_cpu_runs_reduced_precision(rng: np.random.Generator) -> None:
    make, shape = MODELS["gemm_gelu"]
    model = make(rng)
    sess = _session(model, precision="bf16", regions="auto")
    _versus_ort(sess, model, shape, rng, TOL["bf16"])
    assert "precision bf16: 2/2 regions in bf16" in sess.partition_report().subgraphs[0].floor


# ---- refusals: kept float32 with the reason ------------------------------------------------------------
def _kept(rows: list[RegionEntry]) -> list[RegionEntry]:
    return [r for r in rows if "[kept float32:" in r.why]


def test_an_unscaled_softmax_keeps_float32_in_fp16_not_in_bf16(rng: np.random.Generator) -> None:
    model = unscaled_softmax(rng)
    sess = _session(model, precision="fp16")
    _versus_ort(sess, model, (8, 32), rng, TOL["fp16"])
    report = sess.partition_report()
    kept = _kept(_rows(report))
    assert len(kept) == 1 and "softmax" in kept[0].nodes, str(report)
    assert "softmax: its input comes from matmul 'logits' without a scale; fp16 logits may overflow" in kept[0].why, \
        kept[0].why
    assert re.search(r"precision fp16: \d+/\d+ regions in fp16, 1 kept float32", report.subgraphs[0].floor)
    bf = _session(model, precision="bf16")
    _versus_ort(bf, model, (8, 32), rng, TOL["bf16"])
    assert _kept(_rows(bf.partition_report())) == []


def test_values_observed_beyond_fp16s_range_keep_float32(rng: np.random.Generator) -> None:
    model = large_values(rng)
    sess = _session(model, precision="fp16")
    _versus_ort(sess, model, (8, 32), rng, TOL["fp16"])
    rows = _rows(sess.partition_report())
    kept = _kept(rows)
    assert kept and all("were observed at" in r.why and "headroom" in r.why for r in kept), [r.why for r in rows]
    assert any("big" in r.nodes for r in kept)


def test_a_constant_beyond_fp16s_range_keeps_float32(rng: np.random.Generator) -> None:
    model = large_constant()
    sess = _session(model, precision="fp16")
    _versus_ort(sess, model, (4, 8), rng, TOL["fp16"], scale=1e-3)
    rows = _rows(sess.partition_report())
    kept = _kept(rows)
    assert kept and any("the constant 100000 is beyond fp16's range" in r.why for r in kept), [r.why for r in rows]


def test_refusal_rules_directly() -> None:
    """precision.refusal on a converted graph's pieces: range, non-finite, bf16's range."""
    from fusegraph.graph.graph import Graph

    g = Graph("t")
    x = g.tensor("in0", (4, 8), data_type="float")
    g.exp(x).set_name("out0").set_output(True)
    g.validate()
    p16, pb16 = precision.Precision("fp16"), precision.Precision("bf16")
    assert precision.refusal(g, ("a",), ("b",), {"a": 1.0, "b": 1.0}, p16) == ""
    assert "observed at 'a'" in precision.refusal(g, ("a",), ("b",), {"a": 3e4, "b": 1.0}, p16)
    assert precision.refusal(g, ("a",), ("b",), {"a": 3e4, "b": 1.0}, pb16) == ""
    assert "non-finite" in precision.refusal(g, ("a",), ("b",), {"a": float("inf")}, pb16)
    assert precision.refusal(g, ("a",), ("b",), {"a": 3e4}, precision.Precision("tf32")) == ""
    h = precision.convert(g, DataType.HALF)
    assert {t.dtype for t in h.tensors} == {DataType.HALF}
    assert precision.refusal(h, ("a",), ("b",), {"a": 3e4}, p16) == ""  # nothing float32 left to convert


def test_a_region_neither_side_runs_in_fp16_keeps_float32(monkeypatch: pytest.MonkeyPatch,
                                                          rng: np.random.Generator) -> None:
    from fusegraph.errors import UnsupportedError
    from fusegraph.onnx import plan_regions, region_choice

    def half(graph: Any) -> bool:
        return any(t.dtype == DataType.HALF for t in graph.tensors)

    real_chooser, real_eager = region_choice.chooser_for, plan_regions.RegionUnit._eager

    def chooser_for(plan: Any) -> Any:
        c = real_chooser(plan)
        builder = c.builder
        assert builder is not None

        def build(region: Any) -> Any:
            if region.pattern == "cudnn.matmul.bias" and half(region.graph):
                raise UnsupportedError("no half GEMM in this test")
            return builder(region)

        c.builder = build
        return c

    def eager(self: Any, graph: Any, **kwargs: Any) -> Any:
        if half(graph) and any(n.kind.value == "matmul" for n in graph.nodes) and len(graph.nodes) <= 2:
            raise RuntimeError("no half GEMM op by op in this test")
        return real_eager(self, graph, **kwargs)

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    monkeypatch.setattr(plan_regions.RegionUnit, "_eager", eager)
    make, shape = MODELS["gemm_gelu"]
    model = make(rng)
    sess = _session(model, precision="fp16")
    _versus_ort(sess, model, shape, rng, TOL["fp16"])
    rows = _rows(sess.partition_report())
    assert rows[0].why.endswith("[fp16]"), rows[0].why
    assert "[kept float32: runs neither on fusegraph nor op by op in the reduced type (no half GEMM op by op" \
        in rows[1].why and rows[1].where == "torch.eager", rows[1].why


# ---- tf32 ---------------------------------------------------------------------------------------------
def test_tf32_on_the_cpu_is_float32_and_says_so(rng: np.random.Generator) -> None:
    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, precision="tf32")
    _versus_ort(sess, model, shape, rng, TOL["tf32"])
    floor = sess.partition_report().subgraphs[0].floor
    assert "precision tf32:" in floor and "no effect on the CPU" in floor, floor
    m = re.search(r"against the float32 path on the unit's sample inputs: relative error (\S+)", floor)
    assert m is not None and float(m.group(1)) <= 1e-5, floor  # float32 on the CPU: agrees to rounding


# ---- verdicts keyed per precision ---------------------------------------------------------------------
def test_each_precision_is_measured_apart(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)  # fusegraph wins every region
    make, shape = MODELS["gemm_gelu"]
    model = make(rng)
    counts = []
    for prec in ("fp32", "fp16", "fp16", "tf32"):
        measured.clear()
        sess = _session(model, precision=prec, floor="on")
        counts.append(len(measured))
        _versus_ort(sess, model, shape, rng, TOL[prec])  # a reduced region's trial run passes its own tolerance
        assert all(r.where == "fusegraph:torch" for r in _rows(sess.partition_report()))
    assert counts == [2, 2, 0, 2], counts  # fp16 read back the second time; never another precision's verdict


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["fp16", "bf16", "tf32"])
def test_reduced_precision_on_cuda(prec: str, rng: np.random.Generator) -> None:
    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, precision=prec, device="cuda:0", engine="")
    tol = {"fp16": 1e-2, "bf16": 2e-2, "tf32": 1e-2}[prec]
    _versus_ort(sess, model, shape, rng, tol)
    assert f"precision {prec}" in sess.partition_report().subgraphs[0].floor


@pytest.mark.gpu
def test_tf32_runs_the_incumbents_steps_at_tf32_on_cuda(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """The regions left to the incumbent run as the floor measured them: op by op on PyTorch
    with TF32 allowed (the torch engine pins its own TF32 flags, so the knob must say so;
    before, ViT-B/16's GEMMs ran strict float32 in a tf32 session). The float32 reference the
    accuracy is stated against stays strict."""
    from fusegraph.engines.registry import REGISTRY

    engine = REGISTRY.get("torch")
    built: list[tuple[tuple[str, Any], ...]] = []
    real_build = type(engine).build

    def spy(self: Any, graph: Any, handle: Any, config: Any = None, *args: Any, **kwargs: Any) -> Any:
        if config is not None:
            built.append(tuple(config.knobs))
        return real_build(self, graph, handle, config, *args, **kwargs)

    monkeypatch.setattr(type(engine), "build", spy)
    _fake_floor(monkeypatch, lambda region: 0.0, 1.0, [])  # every region to the incumbent
    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, precision="tf32", device="cuda:0", engine="", floor="on")  # the floor decides
    _versus_ort(sess, model, shape, rng, 1e-2)
    eager = [dict(k) for k in built if dict(k).get("compile") is False and dict(k).get("cuda_graph") is False]
    assert any(k.get("tf32") is True for k in eager), built
    assert any(k.get("tf32") is False for k in eager), built  # the strict float32 reference

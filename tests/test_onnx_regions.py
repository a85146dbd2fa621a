"""The ONNX provider running claimed units region by region (fusegraph/onnx/plan_regions.py,
issue 24 items 1 and 3), on the CPU behind ``regions=on`` with the GPU's incumbent (the
same nodes op by op on PyTorch): outputs against ONNX Runtime on fresh random inputs, the
partition report's region rows (pattern names, engines, verdicts with both medians or the
refusal), an incumbent made faster keeping its regions (a virtual clock: no wall-clock
asserts), verdicts read back by a second session without measuring, the floor off claiming
every region; one GPU-marked test on cuda:0."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_fakes import Clock, virtual_call
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.errors import UnsupportedError
from fusegraph.onnx import plan_regions, region_choice, region_pieces, region_values
from fusegraph.onnx.report import PartitionReport, RegionEntry
from fusegraph.regions.choose import Chooser
from fusegraph.regions.incumbent import CallableIncumbent
from fusegraph.regions.split import Region
from fusegraph.select import timing

pytest.importorskip("torch", reason="the region path passes torch tensors (fusegraph[torch])")
pytestmark = pytest.mark.usefixtures("own_cache")  # each test its own verdict table

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]
# the torch engine pinned (no IREE compiles here), the floor inline, no whole-model runners
BASE: dict[str, Any] = {"device": "cpu", "regions": "on", "engine": "torch", "floor_mode": "inline", "runners": "off"}


# ---- models ---------------------------------------------------------------------------------------
def _const(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, np.float32), name)


def _model(name: str, nodes: list[onnx.NodeProto], x: list[int], y: list[int],
           inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def conv_blocks(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv -> Add(bias) -> Relu, then two Conv(bias) -> Relu blocks of one shape, then
    GlobalAveragePool -> Flatten."""
    inits = [_const(rng, "w0", (8, 3, 3, 3)), _const(rng, "b0", (1, 8, 1, 1))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c0", "b0"], ["a0"], name="bias0"),
             helper.make_node("Relu", ["a0"], ["r0"], name="relu0")]
    for i in (1, 2):
        inits += [_const(rng, f"w{i}", (8, 8, 3, 3)), _const(rng, f"b{i}", (8,))]
        nodes += [helper.make_node("Conv", [f"r{i - 1}", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}",
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
    nodes += [helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="gap"),
              helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    return _model("conv_blocks", nodes, [2, 3, 12, 12], [2, 8], inits)


def gemm_gelu(rng: np.random.Generator) -> onnx.ModelProto:
    """Gemm -> GELU (its Erf form, as exported) -> Gemm."""
    inits = [_const(rng, "w1", (32, 64)), _const(rng, "b1", (64,)), _const(rng, "w2", (64, 16)),
             _const(rng, "b2", (16,)), _scalar("sqrt2", float(np.sqrt(2))), _scalar("one", 1.0), _scalar("half", 0.5)]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Div", ["h", "sqrt2"], ["hd"], name="gelu_div"),
             helper.make_node("Erf", ["hd"], ["he"], name="gelu_erf"),
             helper.make_node("Add", ["he", "one"], ["ha"], name="gelu_add"),
             helper.make_node("Mul", ["h", "ha"], ["hm"], name="gelu_mul"),
             helper.make_node("Mul", ["hm", "half"], ["g"], name="gelu_half"),
             helper.make_node("Gemm", ["g", "w2", "b2"], ["y"], name="fc2")]
    return _model("gemm_gelu", nodes, [8, 32], [8, 16], inits)


def norm_attention(rng: np.random.Generator, s: int = 16, d: int = 32) -> onnx.ModelProto:
    """LayerNormalization -> Q, K, V MatMuls -> MatMul(Q, K^T) * scale -> Softmax -> MatMul(., V)
    -> residual Add."""
    inits = [_const(rng, "gamma", (d,), 1.0), _const(rng, "beta", (d,)), _const(rng, "wq", (d, d)),
             _const(rng, "wk", (d, d)), _const(rng, "wv", (d, d)), _scalar("scale", 1 / float(np.sqrt(d)))]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["n", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["n", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale_mul"),
             helper.make_node("Softmax", ["ss"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"], name="pv"),
             helper.make_node("Add", ["o", "x"], ["y"], name="residual")]
    return _model("norm_attention", nodes, [2, s, d], [2, s, d], inits)


MODELS: dict[str, tuple[Callable[[np.random.Generator], onnx.ModelProto], tuple[int, ...]]] = {
    "conv_blocks": (conv_blocks, (2, 3, 12, 12)),
    "gemm_gelu": (gemm_gelu, (8, 32)),
    "norm_attention": (norm_attention, (2, 16, 32)),
}


# ---- helpers --------------------------------------------------------------------------------------
def _session(model: onnx.ModelProto, **opts: Any) -> fgo.InferenceSession:
    return fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS,
                                provider_options=[{**BASE, **opts}, {}])


def _agree(sess: fgo.InferenceSession, model: onnx.ModelProto, shape: tuple[int, ...], rng: np.random.Generator,
           rel: float = 1e-4) -> None:
    """Outputs against ONNX Runtime on fresh random inputs (twice: the second run is a warm one)."""
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        want = ref.run(None, {"x": x})[0]
        assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype
        assert np.isfinite(got).all()
        err = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
        assert err <= rel, f"relative error {err:.2e} (max abs {np.abs(got - want).max():.2e})"


def _rows(report: PartitionReport) -> list[RegionEntry]:
    units = [s for s in report.subgraphs if s.kind == "fusegraph"]
    assert len(units) == 1, str(report)
    return list(units[0].regions)


def _fake_floor(monkeypatch: pytest.MonkeyPatch, incumbent_ms: Callable[[Region], float], fusegraph_ms: float,
                measured: list[str]) -> None:
    """Every session's chooser gets a fake incumbent taking ``incumbent_ms(region)`` and
    fusegraph's plan ``fusegraph_ms`` on a virtual clock (fusegraph's plan still runs);
    ``measured`` collects the pattern of each region timed."""
    clock = Clock()
    real = region_choice.chooser_for

    def timer(cands: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, timing.Timing]:
        for k in ("warmup_s", "min_rounds", "device_clock"):  # on a GPU the chooser passes a CUDA clock
            kw.pop(k, None)
        wrapped = {**cands, "fusegraph": virtual_call(clock, fusegraph_ms, cands["fusegraph"])}
        return timing.time_candidates(wrapped, clock=clock, steady=False, min_rounds=3, per_round=1, **kw)

    def make(region: Region, inputs: Mapping[str, Any]) -> Callable[[], object]:
        measured.append(region.pattern)
        return virtual_call(clock, incumbent_ms(region))

    def chooser_for(plan: Any) -> Chooser:
        chooser = real(plan)
        chooser.incumbent = CallableIncumbent("fake", make)
        chooser.timer = timer
        return chooser

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)


# ---- tests ----------------------------------------------------------------------------------------
GOLDEN = {
    "conv_blocks": ["cudnn.conv.bias_act", "cudnn.conv.bias_act", "cudnn.conv.bias_act", "triton.reduction"],
    "gemm_gelu": ["cudnn.matmul.bias_act", "cudnn.matmul.bias"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_floor_off_claims_every_region_and_outputs_agree_with_onnx_runtime(name: str, rng: np.random.Generator) -> None:
    make, shape = MODELS[name]
    model = make(rng)
    sess = _session(model, floor="off")
    _agree(sess, model, shape, rng)
    report = sess.partition_report()
    rows = _rows(report)
    patterns = [r.pattern for r in rows]
    if name in GOLDEN:
        assert patterns == GOLDEN[name], str(report)
    else:  # the attention block: the norm, the projections, the attention core, the residual
        assert patterns[0] == "triton.norm.layernorm" and patterns.count("cudnn.matmul") >= 3, str(report)
        assert "cudnn.sdpa" in patterns or "triton.softmax" in patterns, str(report)
        assert patterns[-1] == "triton.pointwise", str(report)
    assert all(r.where == "fusegraph:torch" and r.source == "claimed" for r in rows), str(report)
    assert all("the floor is off" in r.why for r in rows)
    # every node of the model in exactly one region, in run order
    names = [n for r in rows for n in r.nodes]
    assert sorted(names) == sorted(n.name for n in model.graph.node)
    assert [r.index for r in rows] == list(range(len(rows)))
    assert report.coverage == 1.0
    text = str(report)
    assert f"r0 {patterns[0]} [" in text and "-> fusegraph:torch: fusegraph (torch): claimed" in text
    assert "regions against torch.eager on cpu" in text
    assert f"engines that ran: fusegraph:torch x{len(rows)}" in report.summary()


def test_a_faster_incumbent_keeps_its_regions_and_the_report_says_why(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    measured: list[str] = []
    # the incumbent wins the convolutions (1 ms against 2), loses the rest (4 ms)
    _fake_floor(monkeypatch, lambda r: 1.0 if r.pattern.startswith("cudnn.conv") else 4.0, 2.0, measured)
    model = conv_blocks(rng)
    sess = _session(model, floor="on")
    _agree(sess, model, MODELS["conv_blocks"][1], rng)  # the incumbent's regions really run (op by op)
    report = sess.partition_report()
    rows = _rows(report)
    convs = [r for r in rows if r.pattern.startswith("cudnn.conv")]
    assert len(convs) == 3 and all(r.where == "fake" and r.source == "measured" for r in convs), str(report)
    for r in convs:
        assert (r.fusegraph_ms, r.incumbent_ms) == (pytest.approx(2.0), pytest.approx(1.0))
        assert "fusegraph 2.0000 ms vs fake 1.0000 ms" in r.why and "0.50x the incumbent (needs > 1.03x)" in r.why
    (pool,) = [r for r in rows if r.pattern == "triton.reduction"]
    assert pool.where == "fusegraph:torch" and "2.00x the incumbent" in pool.why
    assert report.fusegraph_nodes == 2 and report.coverage == pytest.approx(2 / 9)
    assert "-> fake: fake: measured; fusegraph 2.0000 ms vs fake 1.0000 ms" in str(report)
    assert "fake x3" in report.summary() and "fusegraph:torch x1" in report.summary()
    # a second session reads the verdicts back and builds no plan the incumbent beat
    built: list[str] = []
    faked = region_choice.chooser_for

    def chooser_for(plan: Any) -> Chooser:
        c = faked(plan)
        inner = c.builder
        assert inner is not None
        c.builder = lambda region: built.append(region.pattern) or inner(region)  # type: ignore[func-returns-value]
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    measured.clear()
    again = _session(model, floor="on")
    assert measured == [] and built == ["triton.reduction"]
    assert [r.source for r in _rows(again.partition_report())] == ["cached"] * 4
    _agree(again, model, MODELS["conv_blocks"][1], rng)


def test_verdicts_are_read_back_by_a_second_session_without_measuring(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)
    trials: list[str] = []  # the reference each trial run of a built plan is compared with
    real_eager = plan_regions.RegionUnit._eager

    def eager(self: Any, graph: Any, *, tf32: bool | None = None, **kw: Any) -> Any:
        if tf32 is False:
            trials.append(graph.name)
        return real_eager(self, graph, tf32=tf32, **kw)

    monkeypatch.setattr(plan_regions.RegionUnit, "_eager", eager)
    model = conv_blocks(rng)
    first = _rows(_session(model, floor="on").partition_report())
    # conv1 and conv2 are one computation on one shape: one content key, measured once, tried once
    assert sorted(measured) == ["cudnn.conv.bias_act", "cudnn.conv.bias_act", "triton.reduction"]
    assert len(trials) == 3, trials
    assert [r.source for r in first] == ["measured"] * 4 and all(r.where == "fusegraph:torch" for r in first)
    measured.clear()
    sess = _session(model, floor="on")
    second = _rows(sess.partition_report())
    assert measured == [], "a second session measured again"
    assert len(trials) == 3, trials  # nor tried again the plans whose stored verdicts say they won
    assert [r.source for r in second] == ["cached"] * 4
    assert [(r.where, r.fusegraph_ms, r.incumbent_ms) for r in second] == [
        (r.where, r.fusegraph_ms, r.incumbent_ms) for r in first]
    _agree(sess, model, MODELS["conv_blocks"][1], rng)
    # another incumbent is another question: measured again
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)
    monkeypatch.setattr(region_choice, "chooser_for", _renamed(region_choice.chooser_for, "other"))
    _session(model, floor="on")
    assert len(measured) == 3


def _renamed(make: Callable[[Any], Chooser], name: str) -> Callable[[Any], Chooser]:
    def chooser_for(plan: Any) -> Chooser:
        c = make(plan)
        c.incumbent = CallableIncumbent(name, c.incumbent.runnable)  # type: ignore[attr-defined]
        return c

    return chooser_for


def test_a_region_fusegraph_cannot_build_is_refused_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    real = region_choice.chooser_for

    def chooser_for(plan: Any) -> Chooser:
        c = real(plan)
        builder = c.builder
        assert builder is not None

        def build(region: Region) -> Any:
            if region.pattern == "cudnn.matmul.bias":
                raise UnsupportedError("no second GEMM in this test")
            return builder(region)

        c.builder = build
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    model = gemm_gelu(rng)
    sess = _session(model, floor="off")
    _agree(sess, model, MODELS["gemm_gelu"][1], rng)
    rows = _rows(sess.partition_report())
    assert [(r.pattern, r.where, r.source) for r in rows] == [
        ("cudnn.matmul.bias_act", "fusegraph:torch", "claimed"),
        ("cudnn.matmul.bias", "torch.eager", "refused"),
    ]
    assert rows[1].nodes == ("fc2",) and "UnsupportedError: no second GEMM in this test" in rows[1].why


def test_a_plan_that_disagrees_with_pytorch_is_refused_and_never_cached(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)  # fusegraph would win every region
    faked = region_choice.chooser_for

    def chooser_for(plan: Any) -> Chooser:
        c = faked(plan)
        builder = c.builder
        assert builder is not None

        def build(region: Region) -> Any:
            built = builder(region)
            if region.pattern == "triton.reduction":  # a wrong plan: its outputs doubled
                execute = built.execute
                built.execute = lambda pack: {k: v * 2 for k, v in execute(pack).items()}
            return built

        c.builder = build
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    model = conv_blocks(rng)
    for _ in range(2):  # the refusal is not kept: the second session checks again
        measured.clear()
        sess = _session(model, floor="on")
        _agree(sess, model, MODELS["conv_blocks"][1], rng)  # the incumbent runs the pooling
        rows = _rows(sess.partition_report())
        assert [(r.pattern, r.where) for r in rows] == [("cudnn.conv.bias_act", "fusegraph:torch")] * 3 + [
            ("triton.reduction", "fake")]
        assert rows[-1].source == "refused"
        assert "disagrees with the same nodes op by op on PyTorch (relative error 1.0e+00)" in rows[-1].why
        assert "triton.reduction" not in measured


def test_autotune_tunes_each_region_within_its_share_and_keys_its_verdicts_apart(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)
    tuned: list[tuple[str, float]] = []

    def fake_tune(self: plan_regions.RegionUnit, region: Region) -> Any:
        tuned.append((region.pattern, self.tune_s))  # the selection layer's autotuner stands in
        return region.graph.build(handle=self.handle, engine="reference")

    monkeypatch.setattr(plan_regions.RegionUnit, "_tuned", fake_tune)
    model = conv_blocks(rng)
    sess = _session(model, floor="on", autotune="3")
    _agree(sess, model, MODELS["conv_blocks"][1], rng)
    # 3 distinct regions (conv1 and conv2 are one computation): 1 s each
    assert sorted(tuned) == [("cudnn.conv.bias_act", 1.0)] * 3 + [("triton.reduction", 1.0)]
    assert all(r.where.startswith("fusegraph:reference") for r in _rows(sess.partition_report()))
    measured.clear()
    _session(model, floor="on")  # untuned: its own verdicts
    assert len(measured) == 3


def test_the_floor_timed_for_real_measures_every_region_once(rng: np.random.Generator) -> None:
    model = norm_attention(rng)
    sess = _session(model, floor="on")
    _agree(sess, model, MODELS["norm_attention"][1], rng)
    rows = _rows(sess.partition_report())
    assert rows and all(r.source == "measured" for r in rows), rows
    for r in rows:  # both medians, and the side that runs it the one the verdict names
        assert r.fusegraph_ms is not None and r.fusegraph_ms > 0 and r.incumbent_ms is not None and r.incumbent_ms > 0
        assert r.where in ("fusegraph:torch", "torch.eager")
        assert ("the incumbent" in r.why) and (r.where == "torch.eager") == ("needs >" in r.why)


def test_regions_stay_off_on_the_cpu_unless_asked_and_the_option_is_checked(rng: np.random.Generator) -> None:
    model = gemm_gelu(rng)
    for value in ("auto", "off"):
        report = _session(model, floor="off", regions=value).partition_report()
        assert all(not s.regions for s in report.subgraphs)
        assert "regions" not in str(report)
    assert fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS,
                                provider_options=[{"regions": True}, {}]).get_provider_options()[
        "FusegraphExecutionProvider"]["regions"] == "on"
    with pytest.raises(ValueError, match="regions='sometimes'"):
        _session(model, regions="sometimes")


def test_without_the_torch_engine_the_unit_is_built_whole_and_says_why(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    monkeypatch.setattr(region_choice, "unavailable", lambda: "the torch engine is unavailable (a test)")
    model = conv_blocks(rng)
    sess = _session(model, floor="off")
    _agree(sess, model, MODELS["conv_blocks"][1], rng)
    report = sess.partition_report()
    (unit,) = [s for s in report.subgraphs if s.kind == "fusegraph"]
    assert unit.regions == () and "not run region by region: the torch engine is unavailable (a test)" in unit.note


def test_a_unit_whose_regions_cannot_be_ordered_is_built_whole(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    def cyclic(pieces: Any, graph: Any) -> list[int]:
        raise region_pieces.NoRegions("its regions depend on each other in a cycle")

    monkeypatch.setattr(region_pieces, "run_order", cyclic)
    model = gemm_gelu(rng)
    sess = _session(model, floor="off")
    _agree(sess, model, MODELS["gemm_gelu"][1], rng)
    (unit,) = [s for s in sess.partition_report().subgraphs if s.kind == "fusegraph"]
    assert unit.regions == () and unit.engine == "torch"
    assert "not run region by region: its regions depend on each other in a cycle" in unit.note


def test_data_movement_no_region_takes_runs_op_by_op_and_keeps_coverage(rng: np.random.Generator) -> None:
    """Softmax -> Transpose -> Reshape -> MatMul: the transpose and reshape follow no anchor that
    takes an epilogue and precede one, so no region takes them; they run op by op on PyTorch
    between the softmax and the GEMM, and do not count against coverage."""
    nodes = [helper.make_node("Softmax", ["x"], ["p"], name="softmax", axis=-1),
             helper.make_node("Transpose", ["p"], ["t"], name="transpose", perm=[0, 2, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="gemm")]
    inits = [numpy_helper.from_array(np.array([64, 16], np.int64), "shape"), _const(rng, "w", (16, 8))]
    model = _model("movement", nodes, [2, 16, 32], [64, 8], inits)
    sess = _session(model, floor="off")
    _agree(sess, model, (2, 16, 32), rng)
    report = sess.partition_report()
    rows = _rows(report)
    assert [(r.pattern, r.nodes, r.where, r.compute) for r in rows] == [
        ("triton.softmax", ("softmax",), "fusegraph:torch", True),
        ("", ("transpose", "reshape"), "torch.eager", False),
        ("cudnn.matmul", ("gemm",), "fusegraph:torch", True),
    ], str(report)
    assert rows[1].why.startswith("data movement only") and rows[1].source == ""
    assert report.coverage == 1.0
    assert "r1 (no region) [Transpose,Reshape] (transpose, reshape) -> torch.eager: data movement only" in str(report)


def test_units_on_either_side_of_onnx_runtime_pass_their_values_and_lazy_compile_builds_at_first_run(
        rng: np.random.Generator) -> None:
    """GlobalAveragePool excluded: the convolutions are one unit, ONNX Runtime pools (a torch
    tensor handed to it as a host array), Flatten is a second unit of its own; with
    lazy_compile the regions are split, chosen and built at the first run."""
    model = conv_blocks(rng)
    for lazy in (False, True):
        sess = _session(model, floor="off", op_types_to_exclude="GlobalAveragePool", lazy_compile=lazy)
        _agree(sess, model, MODELS["conv_blocks"][1], rng)
        report = sess.partition_report()
        assert [s.kind for s in report.subgraphs] == ["fusegraph", "onnxruntime", "fusegraph"], str(report)
        first, _, last = report.subgraphs
        assert [r.pattern for r in first.regions] == ["cudnn.conv.bias_act"] * 3
        assert [(r.pattern, r.nodes) for r in last.regions] == [("", ("flatten",))], str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_on_cuda_each_region_is_measured_against_pytorch_op_by_op(name: str, rng: np.random.Generator) -> None:
    """On cuda:0 with the defaults (regions=auto, every engine, the floor on): outputs agree
    with ONNX Runtime's CPU provider (TF32 may be on: 1e-3), every region was measured (or
    refused) against torch.eager -- never ONNX Runtime -- and the unit ran as one CUDA graph
    or says why not."""
    make, shape = MODELS[name]
    model = make(rng)
    sess = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS,
                                provider_options=[{"device": "cuda:0"}, {}])
    _agree(sess, model, shape, rng, rel=1e-3)
    report = sess.partition_report()
    rows = _rows(report)
    assert all(r.source in ("measured", "cached", "refused", "") for r in rows), str(report)
    assert all(r.where == "torch.eager" or r.where.startswith("fusegraph:") for r in rows)
    assert all(r.incumbent_ms is not None for r in rows if r.source in ("measured", "cached")), str(report)
    assert "regions against torch.eager on cuda:0" in str(report)
    assert "one CUDA graph" in str(report) or "not captured" in str(report)
    assert "onnxruntime" not in " ".join(r.why for r in rows).lower()


def test_the_folded_kernel_candidate_refuses_with_reasons_where_it_cannot_build() -> None:
    """On a GPU session the preferred candidate is the region with its border reshapes folded
    on a kernel engine; where there is nothing to fold, or no kernel engine runs here (this
    CPU), it refuses with the reasons, and the chooser goes on to the usual build."""
    import fusegraph as fg
    from fusegraph.regions.views import KERNEL_ENGINES, folded_kernel_plan

    plain = fg.Graph("plain", io_data_type=fg.DataType.FLOAT)
    plain.relu(plain.tensor("x", [4, 8])).set_output(True).set_name("y")
    with pytest.raises(UnsupportedError, match="no border reshape"):
        folded_kernel_plan(plain.validate(), fg.Handle("cpu"))
    g = fg.Graph("rows", io_data_type=fg.DataType.FLOAT)
    g.softmax(g.reshape(g.tensor("x", [2, 3, 8]), [6, 8]), axis=1).set_output(True).set_name("y")
    with pytest.raises(UnsupportedError) as info:
        folded_kernel_plan(g.validate(), fg.Handle("cpu"))
    for name in KERNEL_ENGINES:
        assert f"{name}:" in str(info.value), info.value


def test_a_preferred_folded_candidate_runs_in_the_unit_and_agrees(monkeypatch: pytest.MonkeyPatch,
                                                                   rng: np.random.Generator) -> None:
    """The unit runs a region whose preferred candidate won (its border reshapes folded into
    views, here built on the torch engine standing in for the GPU's kernel engines): the
    usual build is never asked for it, and the model's outputs are ONNX Runtime's."""
    import fusegraph as fg
    from fusegraph.regions.views import FoldedPlan, fold_border_reshapes

    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 50.0, 1.0, measured)  # fusegraph always wins
    faked = region_choice.chooser_for
    folded_won: list[str] = []
    built: list[str] = []

    def stand_in(region: Region) -> Any:
        f = fold_border_reshapes(region.graph)
        if f is None:
            raise UnsupportedError("no border reshape to fold into a view")
        folded_won.append(region.pattern)
        return FoldedPlan(region.graph, f, f.graph.build(handle=fg.Handle("cpu"), engine="torch"))

    def chooser_for(plan: Any) -> Chooser:
        c = faked(plan)
        inner = c.builder
        assert inner is not None
        c.builder = lambda region: built.append(region.pattern) or inner(region)  # type: ignore[func-returns-value]
        c.preferred = stand_in
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, floor="on")
    _agree(sess, model, shape, rng)
    assert folded_won, "no region had a border reshape to fold"
    assert not set(folded_won) & set(built), (folded_won, built)
    assert all(r.fusegraph for r in _rows(sess.partition_report()))


def test_a_step_hands_its_plan_activations_in_the_declared_layout(rng: np.random.Generator) -> None:
    """A piece run op by op may hand on a view (Swin-T: a Transpose's channels-last-strided
    [8, 768, 7, 7]); kernel plans read only the declared layout, so the step copies such an
    input into it, and passes one already laid out as declared untouched."""
    from types import SimpleNamespace

    import torch

    dense = SimpleNamespace(shape=(2, 6, 3, 3), strides=(54, 9, 3, 1))  # what the step reads of a TensorAttr
    seen: list[Any] = []

    def strict(pack: dict[str, Any]) -> dict[str, Any]:
        x = pack["in0"]
        assert tuple(x.stride()) == dense.strides, x.stride()  # what a cuDNN / Triton plan insists on
        seen.append(x)
        return {"out0": x * 2}

    run = region_values.laid_out(strict, [dense], ["in0"])
    base = torch.from_numpy(rng.standard_normal((2, 3, 3, 6)).astype(np.float32))
    view = base.permute(0, 3, 1, 2)  # [2, 6, 3, 3] with strides (54, 1, 18, 6)
    got = run({"in0": view})["out0"]
    torch.testing.assert_close(got, view * 2, rtol=0, atol=0)
    ready = view.contiguous()
    run({"in0": ready})
    assert seen[-1] is ready


def _on_cuda_op_by_op(rng: np.random.Generator, note: str) -> None:
    """The norm-attention model on cuda:0 agrees with ONNX Runtime, its report carries
    ``note``, and no unit of it runs on ONNX Runtime."""
    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS,
                                provider_options=[{"device": "cuda:0"}, {}])
    _agree(sess, model, shape, rng, rel=1e-3)
    report = str(sess.partition_report())
    assert note in report, report
    assert "onnxruntime" not in report.split("subgraphs:")[1].split("\n")[0], report


@pytest.mark.gpu
def test_on_cuda_a_unit_failing_at_run_time_runs_op_by_op_on_pytorch(monkeypatch: pytest.MonkeyPatch,
                                                                     rng: np.random.Generator) -> None:
    """A region unit that fails at run time falls back to its nodes op by op on PyTorch on the
    same GPU -- the incumbent the floor measured -- not to ONNX Runtime's CPU provider."""
    from fusegraph.errors import VariantPackError

    def broken(self: Any, values: Any) -> Any:
        raise VariantPackError("a stand-in layout failure", tensor="in0")

    monkeypatch.setattr(plan_regions.RegionUnit, "run", broken)
    _on_cuda_op_by_op(rng, "run op by op on PyTorch: VariantPackError")


def test_a_floor_budget_in_seconds_leaves_regions_to_later_sessions(monkeypatch: pytest.MonkeyPatch,
                                                                    rng: np.random.Generator) -> None:
    """``floor=<seconds>`` bounds the regions' first measurement: past the budget the rest run
    op by op, unmeasured and unrecorded, and the next session measures them; a model of many
    distinct regions converges over sessions instead of taking minutes in its first."""
    from types import SimpleNamespace

    from fusegraph.regions import choose as choose_mod

    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)  # fusegraph wins every region it measures
    ticks = iter(range(10_000))
    monkeypatch.setattr(choose_mod, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))  # 1 s a region
    from fusegraph.onnx.options import ProviderOptions

    budget = [region_choice.region_budget(ProviderOptions.parse({"floor": f})) for f in ("1.5", "on", "auto")]
    assert budget == [1.5, None, None]
    model = conv_blocks(rng)
    sess = _session(model, floor="1.5")
    first = _rows(sess.partition_report())
    assert [r.source for r in first] == ["measured", "measured", "measured", "unmeasured"], str(sess.partition_report())
    assert first[-1].where == "fake" and "budget (1.5 s) was spent" in first[-1].why
    _agree(sess, model, MODELS["conv_blocks"][1], rng)
    measured.clear()
    again = _rows(_session(model, floor="1.5").partition_report())
    assert measured == ["triton.reduction"]  # only what the first session left
    assert [r.source for r in again] == ["cached", "cached", "cached", "measured"]
    assert all(r.where == "fusegraph:torch" for r in again)


def test_a_failed_unit_rebuilt_op_by_op_gives_onnx_runtimes_answer(rng: np.random.Generator) -> None:
    """What a GPU session puts in place of a unit that failed at run time
    (``plan_build.op_by_op_instead``: the same nodes op by op on PyTorch), checked here on
    the CPU: built from the unit's nodes, it runs on the values the unit was given and
    answers as ONNX Runtime does, and the report says why it is there."""
    from fusegraph.onnx import plan_build
    from fusegraph.onnx.units import to_host

    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, floor="off")
    (plan,) = sess._plans.values()
    unit = next(u for u in plan.units if isinstance(u, plan_regions.RegionUnit))
    x = rng.standard_normal(shape).astype(np.float32)
    got = plan_build.op_by_op_instead(plan, unit, "VariantPackError: a stand-in", {"x": x})
    assert got is not None
    fallback, outs = got
    assert not isinstance(fallback, plan_regions.RegionUnit) and fallback.nodes == unit.nodes
    assert any("run op by op on PyTorch: VariantPackError" in n for n in fallback.engine_notes)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    (name,) = unit.outputs
    out = np.asarray(to_host(outs[name]), np.float64)
    assert np.linalg.norm(out - want) / max(float(np.linalg.norm(want)), 1e-30) <= 1e-5


def test_a_group_that_failed_to_build_is_built_op_by_op_and_answers_as_onnx_runtime(rng: np.random.Generator) -> None:
    """What a GPU session builds in place of a claimed group whose build failed
    (``plan_build.op_by_op_built_instead``: the same nodes op by op on PyTorch, not ONNX
    Runtime's CPU provider), checked on the CPU: it answers as ONNX Runtime does and its
    notes say why it is there."""
    from fusegraph.onnx import plan_build
    from fusegraph.onnx.units import to_host

    make, shape = MODELS["norm_attention"]
    model = make(rng)
    sess = _session(model, floor="off")
    (plan,) = sess._plans.values()
    unit = next(u for u in plan.units if isinstance(u, plan_regions.RegionUnit))
    built = plan_build.op_by_op_built_instead(plan, "again", unit.nodes, unit.inputs, unit.outputs,
                                              "CompileError: a stand-in")
    assert built is not None and not isinstance(built, plan_regions.RegionUnit) and built.nodes == unit.nodes
    assert any("failed to build, so run op by op on PyTorch: CompileError" in n for n in built.engine_notes)
    x = rng.standard_normal(shape).astype(np.float32)
    outs = built.run({"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    (name,) = unit.outputs
    out = np.asarray(to_host(outs[name]), np.float64)
    assert np.linalg.norm(out - want) / max(float(np.linalg.norm(want)), 1e-30) <= 1e-5


@pytest.mark.gpu
def test_on_cuda_a_group_failing_to_build_runs_op_by_op_on_pytorch(monkeypatch: pytest.MonkeyPatch,
                                                                   rng: np.random.Generator) -> None:
    """A claimed group whose region build fails on a GPU runs its nodes op by op on PyTorch
    on the same GPU, not on ONNX Runtime's CPU provider."""
    from fusegraph.errors import CompileError

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise CompileError("a stand-in build failure")

    monkeypatch.setattr(plan_regions, "region_unit", broken)
    _on_cuda_op_by_op(rng, "failed to build, so run op by op on PyTorch: CompileError")


def test_a_preferred_candidate_that_could_not_build_is_not_tried_again(monkeypatch: pytest.MonkeyPatch,
                                                                      rng: np.random.Generator) -> None:
    """Where the preferred candidate was refused and the usual build got a verdict, a later
    session reads that verdict and does not build the preferred candidate again (on a GPU
    each try is a kernel build that fails the same way)."""
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)
    faked = region_choice.chooser_for
    tried: list[str] = []

    def refused(region: Region) -> Any:
        tried.append(region.pattern)
        raise UnsupportedError("no kernel engine builds it (a stand-in)")

    def chooser_for(plan: Any) -> Chooser:
        c = faked(plan)
        c.preferred = refused
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    model = conv_blocks(rng)
    first = _rows(_session(model, floor="on").partition_report())
    assert tried and [r.source for r in first] == ["measured"] * 4
    tried.clear()
    measured.clear()
    sess = _session(model, floor="on")
    assert tried == [] and measured == []
    assert [r.source for r in _rows(sess.partition_report())] == ["cached"] * 4
    _agree(sess, model, MODELS["conv_blocks"][1], rng)

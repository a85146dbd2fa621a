"""The region layer (fusegraph/regions/): which regions a graph splits into and under
which pattern names (golden), cycle safety, one content key for one computation, the
verdict cache's round trip and keys, the incumbent winning where it is faster (decided
on a virtual clock: no wall-clock asserts), the region plan's numbers against the float64
reference, and the report's coverage."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_fakes import Clock, virtual_call

import fusegraph as fg
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.unsupported import UNSUPPORTED
from fusegraph.errors import UnsupportedError
from fusegraph.graph.ops import DATA_MOVEMENT, OpKind
from fusegraph.reference.executor import run_reference
from fusegraph.reference.inputs import random_inputs
from fusegraph.regions import split
from fusegraph.regions.choose import Chooser
from fusegraph.regions.incumbent import CallableIncumbent, TorchOpByOp
from fusegraph.regions.plan import RegionPlan, Step, assemble, fusegraph_step
from fusegraph.regions.report import Report, rows_for
from fusegraph.regions.split import Region
from fusegraph.regions.verdicts import Verdict, VerdictStore, verdict_key
from fusegraph.select import timing


def _model(name: str = "m") -> fg.Graph:
    """conv + bias + relu -> flatten -> GEMM + bias + GELU -> softmax -> a pointwise chain."""
    g = fg.Graph(name, io_data_type=fg.DataType.FLOAT)
    x, w, b = g.tensor("x", [2, 3, 8, 8]), g.tensor("w", [4, 3, 3, 3]), g.tensor("b", [1, 4, 1, 1])
    y = g.relu(g.add(g.conv_fprop(x, w, padding=[1, 1]), b))
    r = g.reshape(y, [2, 256])
    z = g.gelu(g.add(g.matmul(r, g.tensor("w2", [256, 16])), g.tensor("b2", [1, 16])))
    s = g.softmax(z, axis=1)
    g.exp(g.mul(s, s)).set_output(True).set_name("out")
    return g.validate()


def test_a_model_splits_along_what_the_engines_fuse() -> None:
    got = split(_model())
    assert [(r.pattern, r.nodes) for r in got.regions] == [
        ("cudnn.conv.bias_act", ("conv_fprop_0", "pointwise_0", "pointwise_1", "reshape_0")),
        ("cudnn.matmul.bias_act", ("matmul_0", "pointwise_2", "pointwise_3")),
        ("triton.softmax", ("softmax_0",)),
        ("triton.pointwise", ("pointwise_4", "pointwise_5")),
    ]
    assert got.rejected == ()
    assert [r.inputs for r in got.regions][:2] == [("x", "w", "b"), ("reshape_0::y", "w2", "b2")]
    assert got.regions[-1].outputs == ("out",)


def transformer_block(scale: float | None = None) -> fg.Graph:
    """Layer norm, a QKV GEMM + bias, causal attention over its slices, the residual add
    (the attention output scaled by ``scale`` first, where given)."""
    g = fg.Graph("block", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [8, 32])
    h, _, _ = g.layernorm(x, g.tensor("g", [1, 32]), g.tensor("beta", [1, 32]), 1e-5)
    qkv = g.add(g.matmul(h, g.tensor("wqkv", [32, 96])), g.tensor("bqkv", [1, 96]))
    q = g.reshape(g.slice(qkv, [0, 0], [8, 32], [1, 1]), [1, 2, 8, 16])
    k = g.reshape(g.slice(qkv, [0, 32], [8, 64], [1, 1]), [1, 2, 8, 16])
    v = g.reshape(g.slice(qkv, [0, 64], [8, 96], [1, 1]), [1, 2, 8, 16])
    o = g.reshape(g.sdpa(q, k, v, causal=True), [8, 32])
    if scale is not None:
        o = g.mul(o, g.scalar(scale))
    g.add(o, x).set_output(True).set_name("y")
    return g.validate()


def test_a_transformer_block_splits_into_norm_gemm_attention() -> None:
    got = split(transformer_block())
    assert [r.pattern for r in got.regions] == [
        "triton.norm.layernorm", "cudnn.matmul.bias", "cudnn.sdpa", "triton.pointwise",
    ]
    assert any("data movement only" in rej.reason for rej in got.rejected)  # slices + reshapes alone


def test_no_region_closes_a_cycle_through_another_region_or_outside_code() -> None:
    g = fg.Graph("cyc", io_data_type=fg.DataType.FLOAT)
    a, w = g.tensor("a", [4, 4]), g.tensor("w", [4, 4])
    t = g.matmul(a, w)  # anchor A
    u = g.matmul(t, w)  # anchor B reads A's output
    g.add(t, u).set_output(True).set_name("y")  # reading both: joining A would close A -> B -> add
    got = split(g.validate())
    assert [r.nodes for r in got.regions] == [("matmul_0",), ("matmul_1", "pointwise_0")]
    # the same through code outside the graph: ``ext`` is computed from t by someone else
    h = fg.Graph("opaque", io_data_type=fg.DataType.FLOAT)
    t2 = h.matmul(h.tensor("a", [4, 4]), h.tensor("w", [4, 4]))
    h.add(t2, h.tensor("ext", [4, 4])).set_output(True).set_name("y")
    h.validate()
    assert [r.nodes for r in split(h).regions] == [("matmul_0", "pointwise_0")]
    apart = split(h, opaque={"ext": [t2.name]})
    assert [r.nodes for r in apart.regions] == [("matmul_0",), ("pointwise_0",)]


def test_splitting_is_deterministic_and_one_computation_has_one_key() -> None:
    one, two = split(_model("a")), split(_model("b"))
    assert [r.key for r in one.regions] == [r.key for r in two.regions]
    # two identical GEMM + bias layers in one graph: one content key, so measured once
    g = fg.Graph("twice", io_data_type=fg.DataType.FLOAT)
    h = g.tensor("x", [4, 8])
    for i in range(2):
        h = g.relu(g.add(g.matmul(h, g.tensor(f"w{i}", [8, 8])), g.tensor(f"b{i}", [1, 8])))
    h.set_output(True).set_name("y")
    keys = [r.key for r in split(g.validate()).regions]
    assert len(keys) == 2 and keys[0] == keys[1]


# ---- verdicts ----------------------------------------------------------------------------------
def test_the_verdict_cache_round_trips_and_its_key_sees_everything_a_timing_depends_on(tmp_path: Path) -> None:
    versions = {"fusegraph": "1", "engine:torch": "2.13.0"}
    key = verdict_key("abc", "cpu[x]", "inductor", versions)
    store = VerdictStore(tmp_path)
    measured = Verdict(True, "measured", "1.40x the incumbent", "torch", 1.0, 1.4, "inductor")
    store.record(key, measured)
    store.record(verdict_key("def", "cpu[x]", "inductor", versions), Verdict(True, "claimed", engine="torch"))
    store.flush()
    again = VerdictStore(tmp_path)
    got = again.lookup(key)
    assert got is not None and got.source == "cached"
    assert (got.fusegraph, got.fusegraph_ms, got.incumbent_ms, got.why) == (True, 1.0, 1.4, "1.40x the incumbent")
    assert again.lookup(verdict_key("def", "cpu[x]", "inductor", versions)) is None  # claims are not kept
    for changed in (
        verdict_key("abc", "cuda[NVIDIA H200]", "inductor", versions),
        verdict_key("abc", "cpu[x]", "torch.eager", versions),
        verdict_key("abc", "cpu[x]", "inductor", {**versions, "lib:torch": "2.14.0"}),
        verdict_key("abc", "cpu[x]", "inductor", versions, {"margin": 0.1}),
    ):
        assert changed != key and again.lookup(changed) is None
    (tmp_path / "regions-verdicts.json").write_text("{torn")
    assert VerdictStore(tmp_path).lookup(key) is None  # a torn table counts as empty


# ---- choosing ---------------------------------------------------------------------------------
def _chooser(clock: Clock, fusegraph_ms: float, incumbent_ms: float, store: VerdictStore | None = None) -> Chooser:
    def timer(cands: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, timing.Timing]:
        wrapped = {**cands, "fusegraph": virtual_call(clock, fusegraph_ms, cands["fusegraph"])}
        return timing.time_candidates(wrapped, clock=clock, steady=False, min_rounds=3, per_round=1, **kw)

    fake = CallableIncumbent("fake", lambda region, inputs: virtual_call(clock, incumbent_ms))
    return Chooser(fg.Handle("cpu"), fake, engine="torch", timer=timer, store=store)


def _inputs(rng: np.random.Generator) -> Callable[[Region], dict[str, np.ndarray]]:
    return lambda region: random_inputs(region.graph, rng)


@pytest.mark.parametrize(("incumbent_ms", "winner"), [(1.0, "incumbent"), (1.95, "incumbent"), (5.0, "fusegraph")])
def test_a_faster_incumbent_keeps_its_region(incumbent_ms: float, winner: str, rng: np.random.Generator, tmp_path: Path) -> None:
    """fusegraph costs 2 virtual ms a call: an incumbent at 1 ms keeps the region, one at
    1.95 ms too (inside the margin: a tie goes to the incumbent), one at 5 ms loses it."""
    store = VerdictStore(tmp_path)
    regions = split(_model()).regions
    choices = _chooser(Clock(), 2.0, incumbent_ms, store).choose_all(regions, _inputs(rng))
    assert all(c.verdict.source == "measured" for c in choices)
    assert {("fusegraph" if c.claimed else "incumbent") for c in choices} == {winner}
    assert all(c.verdict.incumbent_ms == pytest.approx(incumbent_ms) for c in choices)
    # the next front door reads the verdicts back without measuring (a timer that fails)
    def no_timing(*args: Any, **kw: Any) -> dict[str, timing.Timing]:
        raise AssertionError("measured again")

    later = _chooser(Clock(), 2.0, incumbent_ms, VerdictStore(tmp_path))
    later.timer = no_timing
    again = later.choose_all(regions, _inputs(rng))
    assert [c.verdict.source for c in again] == ["cached"] * len(regions)
    assert [c.claimed for c in again] == [c.claimed for c in choices]


class _TimedPlan(ExecutionPlan):
    """A plan whose call takes ``ms`` virtual milliseconds (the region's real plan runs it)."""

    def __init__(self, inner: ExecutionPlan, clock: Clock, ms: float, name: str) -> None:
        super().__init__(inner.graph, inner.handle, EngineConfig(name))
        self.inner, self.clock, self.ms = inner, clock, ms

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        self.clock.now += self.ms / 1e3
        return self.inner.execute(variant_pack)


class _Candidates:
    """Candidates on one virtual clock: ``make(name, ms)`` builds a plan taking ``ms`` a call
    (None: refused), ``built`` lists what was built, ``fake`` is an incumbent at 3 ms."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.built: list[str] = []
        self.fake = CallableIncumbent("fake", lambda region, inputs: virtual_call(self.clock, 3.0))

    def make(self, name: str, ms: float | None) -> Callable[[Region], ExecutionPlan]:
        def build(region: Region) -> ExecutionPlan:
            if ms is None:
                raise UnsupportedError(f"{name} takes no such graph")
            self.built.append(name)
            return _TimedPlan(region.graph.build(handle=fg.Handle("cpu"), engine="torch"), self.clock, ms, name)

        return build

    def timer(self, cands: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, timing.Timing]:
        return timing.time_candidates(cands, clock=self.clock, steady=False, min_rounds=3, per_round=1, **kw)


@pytest.mark.parametrize(("preferred_ms", "builder_ms", "kept"), [
    (1.0, 5.0, "first"),      # the preferred candidate wins: the builder's plan is never built
    (5.0, 1.0, "second"),     # it loses: the builder's plan is measured and kept
    (5.0, 5.0, "incumbent"),  # both lose: the incumbent keeps it, the reason names both
    (None, 1.0, "second"),    # it cannot build: the builder's plan as before
])
def test_a_preferred_candidate_is_measured_first(preferred_ms: float | None, builder_ms: float, kept: str,
                                                  rng: np.random.Generator, tmp_path: Path) -> None:
    cs = _Candidates()
    make, timer, fake, built = cs.make, cs.timer, cs.fake, cs.built
    chooser = Chooser(fg.Handle("cpu"), fake, engine="torch", timer=timer, store=VerdictStore(tmp_path),
                      builder=make("second", builder_ms), preferred=make("first", preferred_ms))
    region = split(_model()).regions[0]
    choices = chooser.choose_all([region, region], _inputs(rng))  # one content key twice: measured once
    c = choices[0]
    assert (c.verdict.engine if c.claimed else "incumbent") == kept
    assert [x.claimed for x in choices] == [c.claimed] * 2
    assert all((x.plan is not None and str(x.plan.config) == kept) for x in choices) == c.claimed
    if kept == "first":
        assert "second" not in built
    if kept == "incumbent":
        assert "first tried: first" in c.verdict.why, c.verdict.why
    # a later front door reads both verdicts back and measures nothing
    def no_timing(*args: Any, **kw: Any) -> dict[str, timing.Timing]:
        raise AssertionError("measured again")

    later = Chooser(fg.Handle("cpu"), fake, engine="torch", timer=no_timing, store=VerdictStore(tmp_path),
                    builder=make("second", builder_ms), preferred=make("first", preferred_ms))
    again = later.choose(region, _inputs(rng))
    assert again.verdict.source == "cached" and again.claimed == c.claimed
    assert (str(again.plan.config) if again.plan is not None else "incumbent") == kept


@pytest.mark.parametrize(("builder_ms", "fallback_ms", "kept"), [
    (1.0, 1.0, "split"),      # the builder's plan wins: the fallback is never built
    (5.0, 1.0, "ieee"),       # it loses: the fallback is measured and kept
    (None, 1.0, "ieee"),      # it cannot build: the fallback as well
    (5.0, 5.0, "incumbent"),  # both lose: the incumbent keeps it, the reason names both
])
def test_a_fallback_candidate_is_measured_where_the_builders_plan_loses(
        builder_ms: float | None, fallback_ms: float, kept: str, rng: np.random.Generator, tmp_path: Path) -> None:
    """The ONNX door's split-product plan (the builder) with the float32 plan it replaced as a
    fallback: a region the split slows down is still claimed by the float32 plan."""
    cs = _Candidates()
    make, timer, fake, built = cs.make, cs.timer, cs.fake, cs.built

    def chooser(timing_fn: Any) -> Chooser:
        return Chooser(fg.Handle("cpu"), fake, engine="torch", timer=timing_fn, store=VerdictStore(tmp_path),
                       builder=make("split", builder_ms), fallbacks=(("ieee", make("ieee", fallback_ms)),))

    region = split(_model()).regions[0]
    first = chooser(timer)
    assert not first.stored(region)
    choices = first.choose_all([region, region], _inputs(rng))  # one content key twice: measured once
    c = choices[0]
    assert (c.verdict.engine if c.claimed else "incumbent") == kept
    assert [x.claimed for x in choices] == [c.claimed] * 2
    assert all((x.plan is not None and str(x.plan.config) == kept) for x in choices) == c.claimed
    if kept == "split":
        assert "ieee" not in built
    if kept == "incumbent":
        assert "also tried: split" in c.verdict.why, c.verdict.why
    # a later front door reads the verdicts back and measures nothing
    def no_timing(*args: Any, **kw: Any) -> dict[str, timing.Timing]:
        raise AssertionError("measured again")

    later = chooser(no_timing)
    assert later.stored(region)
    again = later.choose(region, _inputs(rng))
    assert again.verdict.source in ("cached", "refused") and again.claimed == c.claimed
    assert (str(again.plan.config) if again.plan is not None else "incumbent") == kept


def test_fallbacks_are_tried_only_where_they_apply(rng: np.random.Generator, tmp_path: Path) -> None:
    """A region the fallbacks are not for (``fallback_when`` False: nothing was split) keeps the
    builder's verdict alone: the fallback is never built or measured, and the stored loss
    decides the region in a later session."""
    cs = _Candidates()
    chooser = Chooser(fg.Handle("cpu"), cs.fake, engine="torch", timer=cs.timer, store=VerdictStore(tmp_path),
                      builder=cs.make("split", 5.0), fallbacks=(("ieee", cs.make("ieee", 1.0)),),
                      fallback_when=lambda region: False)
    region = split(_model()).regions[0]
    c = chooser.choose(region, _inputs(rng))
    assert not c.claimed and c.verdict.source == "measured" and "also tried" not in c.verdict.why
    assert cs.built == ["split"]
    assert chooser.stored(region)


def test_floor_off_claims_every_region_it_can_build_and_refusals_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(UNSUPPORTED, "torch", {**UNSUPPORTED.get("torch", {}), OpKind.SOFTMAX: "not in this test"})
    chooser = Chooser(fg.Handle("cpu"), TorchOpByOp(fg.Handle("cpu")), floor=False, engine="torch")
    got = split(_model())
    choices = chooser.choose_all(got.regions)
    verdicts = {c.region.pattern: c.verdict for c in choices}
    assert verdicts["triton.softmax"].source == "refused" and "not in this test" in verdicts["triton.softmax"].why
    assert all(v.source == "claimed" and v.fusegraph for p, v in verdicts.items() if p != "triton.softmax")
    nodes = _model().nodes
    ops = {n.name: n.kind.value for n in nodes}
    compute = [n.name for n in nodes if n.kind not in DATA_MOVEMENT]  # the reshape does not count
    report = Report(tuple(rows_for(got, choices, ops, "torch.eager", compute)))
    assert report.coverage == pytest.approx(8 / 9)  # all but the softmax
    assert report.patterns()["cudnn.conv.bias_act"] == 1
    refused = [r for r in report.rows if not r.fusegraph]
    assert [r.node for r in refused] == ["softmax_0"] and "not in this test" in refused[0].why


def test_a_region_plan_runs_the_model_with_the_chosen_steps(rng: np.random.Generator) -> None:
    """The claimed regions on fusegraph (torch engine), the others by the incumbent op by op,
    intermediates passed as torch tensors: the model's output matches the float64 reference."""
    torch = pytest.importorskip("torch", reason="the region plan passes torch tensors between steps")
    g = _model()
    got = split(g)
    cpu = fg.Handle("cpu")
    chooser = Chooser(cpu, TorchOpByOp(cpu), floor=False, engine="torch")
    choices = chooser.choose_all(got.regions)
    choices[2].plan = None  # the softmax region by the incumbent

    def op_by_op(region: Region) -> Step:
        names = [f"in{i}" for i in range(len(region.inputs))]

        def run(values: Any) -> list[Any]:
            res: Any = TorchOpByOp(cpu).runnable(region, dict(zip(names, values, strict=True)))()
            return [res[f"out{i}"] for i in range(len(region.outputs))]

        return Step(f"r{region.index}", region.inputs, region.outputs, run, "torch.eager")

    plan = assemble(choices, ["out"], op_by_op)
    assert [s.where for s in plan.steps].count("torch.eager") == 1
    feed = random_inputs(g, rng)
    out = plan.execute({k: torch.from_numpy(v) for k, v in feed.items()})["out"]
    assert isinstance(out, torch.Tensor)
    want = run_reference(g, feed)["out"]
    err = float(np.linalg.norm(out.numpy() - want) / np.linalg.norm(want))
    assert err < 1e-5, err
    assert plan.capture({k: torch.from_numpy(v) for k, v in feed.items()}) == "not every input is a CUDA tensor"


@pytest.mark.gpu
def test_a_region_plan_captured_as_one_cuda_graph_replays_the_same_numbers(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch", reason="the region plan passes torch tensors between steps")
    g = _model()
    cuda = fg.Handle("cuda:0")
    # torch-engine steps without CUDA graphs of their own (a capture inside a capture fails)
    uncaptured = {"config": {"engine": "torch", "knobs": {"cuda_graph": False}}}
    choices = Chooser(cuda, TorchOpByOp(cuda), floor=False, engine="torch",
                      build_options=uncaptured).choose_all(split(g).regions)
    assert all(c.claimed for c in choices), [c.verdict.describe() for c in choices]
    plan = RegionPlan([fusegraph_step(f"r{c.region.index}", c.plan, c.region.inputs, c.region.outputs)
                       for c in choices if c.plan is not None], ["out"])
    feed = random_inputs(g, rng)
    values = {k: torch.from_numpy(v).cuda() for k, v in feed.items()}
    eager = plan.execute(values)["out"]
    why = plan.capture(values)
    assert why == "", why
    fresh = {k: torch.from_numpy(v).cuda() for k, v in random_inputs(g, rng).items()}
    replayed = plan.execute(fresh)["out"]
    again = RegionPlan(plan.steps, ["out"]).execute(fresh)["out"]  # the same steps, uncaptured
    assert torch.allclose(replayed, again, rtol=1e-5, atol=1e-6)
    want = run_reference(g, feed)["out"]
    assert float(np.linalg.norm(eager.cpu().numpy() - want) / np.linalg.norm(want)) < 1e-4


def test_assembled_steps_run_producers_first() -> None:
    """The split lists an anchor region before the chain it reads (x -> exp -> matmul is
    [matmul, exp]); the assembled plan runs the chain first."""
    from fusegraph.regions.plan import Step, producers_first

    def step(name: str, ins: tuple[str, ...], outs: tuple[str, ...]) -> Step:
        return Step(name, ins, outs, lambda args: [sum(args)], "test")

    matmul, exp = step("matmul", ("e", "w"), ("y",)), step("exp", ("x",), ("e",))
    assert [s.name for s in producers_first([matmul, exp])] == ["exp", "matmul"]
    with pytest.raises(fg.ExecutionError, match="no order runs them"):
        producers_first([step("a", ("q",), ("p",)), step("b", ("p",), ("q",))])

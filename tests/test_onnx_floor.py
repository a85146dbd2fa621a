"""The floor (fusegraph/onnx/floor.py): claimed subgraphs kept on fusegraph only where faster
than ONNX Runtime. Timings are injected (a fake timer replaces ``floor.time_pair``), so no
test depends on the machine's speed; numerics are checked against ONNX Runtime."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph.onnx as fgo
from fusegraph.onnx import floor
from fusegraph.onnx.options import ProviderOptions


def _chain(rng: np.random.Generator) -> onnx.ModelProto:
    """conv -> relu | exp (excluded: ORT) | conv -> sigmoid: two claimed groups around one ORT node."""
    w1 = (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["b"], name="relu1"),
        helper.make_node("Neg", ["b"], ["c"], name="neg"),
        helper.make_node("Conv", ["c", "w2"], ["d"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["d"], ["y"], name="sig"),
    ]
    g = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m)
    return m


class FakeTimer:
    """Returns the given (fusegraph ms, ORT ms) pairs in call order; calls each side once."""

    def __init__(self, pairs: Sequence[tuple[float, float]]) -> None:
        self.pairs = list(pairs)
        self.calls = 0

    def __call__(self, fg: floor.Call, ref: floor.Call, budget_s: float) -> tuple[float, float]:
        assert budget_s >= 0
        fg()
        ref()
        self.calls += 1
        return self.pairs.pop(0)


@pytest.fixture
def fake_timer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def install(pairs: Sequence[tuple[float, float]]) -> FakeTimer:
        t = FakeTimer(pairs)
        monkeypatch.setattr(floor, "time_pair", t)
        return t

    yield install


def _session(model: onnx.ModelProto, cache: Path, **opts: Any) -> fgo.InferenceSession:
    o = {"engine": "reference", "torch_mlir_tier": "off", "op_types_to_exclude": "Neg",
         "floor": "on", "runners": "off", "cache_dir": str(cache), **opts}  # runners: test_onnx_runners.py
    return fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, o), "CPUExecutionProvider"])


def _check(sess: fgo.InferenceSession, model: onnx.ModelProto, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,), (want,) = sess.run(None, {"x": x}), ref.run(None, {"x": x})
    assert not np.isnan(got).any()
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64))
    assert err < 1e-5, f"relative error {err:.2e}"


# ---- the decision --------------------------------------------------------------------------------
def test_decide_keeps_only_clearly_faster() -> None:
    assert floor.decide(0.5, 1.0).keep
    assert not floor.decide(1.0, 1.0).keep  # a tie goes to ONNX Runtime
    assert not floor.decide(0.99, 1.0).keep  # within the margin: noise
    assert not floor.decide(2.0, 1.0).keep
    v = floor.decide(2.0, 1.0)
    assert "2.000 ms" in v.describe() and "1.000 ms" in v.describe() and "ONNX Runtime" in v.describe()


def test_a_lucky_block_alone_does_not_keep_fusegraph() -> None:
    """The best blocks say fusegraph, the rounds' paired ratios do not: ONNX Runtime."""
    v = floor.decide(0.7, 1.0, paired=1.02)
    assert not v.keep and "paired ratio 1.02x" in v.describe()
    assert floor.decide(0.7, 1.0, paired=0.8).keep
    assert floor.decide_timing((0.7, 1.0)).keep  # a timer without paired ratios (clear-cut calls)


def test_time_pair_pairs_adjacent_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One lucky fusegraph block (1 ms in the first round, 2 ms after, ORT 1.5 ms throughout)
    wins by best blocks but not by the rounds' paired ratios."""
    clock = FakeClock()
    monkeypatch.setattr(floor.time, "perf_counter", clock)

    def lucky() -> None:
        clock.now += 0.001 if clock.now < 0.010 else 0.002

    t = floor.time_pair(lucky, clock.side("o", 0.0015), 0.0)
    assert (t.fusegraph_ms, t.ort_ms) == pytest.approx((1.0, 1.5))
    assert t.paired == pytest.approx(2.0 / 1.5)
    assert not floor.decide_timing(t).keep
    steady = floor.time_pair(clock.side("f", 0.001), clock.side("o", 0.0015), 0.0)
    assert steady.paired == pytest.approx(1.0 / 1.5) and floor.decide_timing(steady).keep


def test_slower_unit_is_handed_back_and_merged_with_its_ort_neighbour(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any
) -> None:
    model = _chain(rng)
    # first claimed group slower, second faster, then the whole plan faster than ORT alone
    timer = fake_timer([(2.0, 1.0), (0.5, 1.0), (0.5, 1.0)])
    sess = _session(model, tmp_path)
    assert timer.calls == 3
    rep = sess.partition_report()
    kinds = [(s.kind, sorted(s.op_types)) for s in rep.subgraphs]
    # conv1+relu1 joined the Neg's ONNX Runtime unit: two units, not three
    assert kinds == [("onnxruntime", ["Conv", "Neg", "Relu"]), ("fusegraph", ["Conv", "Sigmoid"])]
    ort_unit, fg_unit = rep.subgraphs
    assert "handed to ONNX Runtime" in ort_unit.note and "2.000 ms" in ort_unit.note
    assert fg_unit.fusegraph_ms == 0.5 and fg_unit.ort_ms == 1.0 and "kept on fusegraph" in fg_unit.floor
    assert "kept on fusegraph" in rep.floor
    reasons = {u.node: u.reason for u in rep.unclaimed}
    assert "handed to ONNX Runtime" in reasons["conv1"] and "op_types_to_exclude" in reasons["neg"]
    assert "floor" in str(rep) and rep.to_dict()["subgraphs"][1]["fusegraph_ms"] == 0.5
    _check(sess, model, rng)


def test_whole_model_that_loses_runs_on_onnxruntime(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    model = _chain(rng)
    fake_timer([(0.5, 1.0), (0.5, 1.0), (3.0, 1.0)])  # each unit wins, the whole plan loses
    sess = _session(model, tmp_path)
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["onnxruntime"] and rep.fusegraph_nodes == 0
    assert "whole model" in rep.floor and "handed to ONNX Runtime" in rep.floor
    _check(sess, model, rng)


def test_verdicts_are_cached_per_machine(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    model = _chain(rng)
    fake_timer([(2.0, 1.0), (0.5, 1.0), (0.5, 1.0)])
    first = [s.kind for s in _session(model, tmp_path).partition_report().subgraphs]
    again = fake_timer([])  # a later session decides without timing anything
    sess = _session(model, tmp_path)
    assert again.calls == 0
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == first
    assert "(cached)" in rep.subgraphs[0].note and "(cached)" in rep.subgraphs[1].floor
    _check(sess, model, rng)
    # another machine (or versions) has its own verdicts
    here = floor.VerdictCache(str(tmp_path), "machine A")
    here.record("k", floor.decide(2.0, 1.0))
    here.flush()
    assert floor.VerdictCache(str(tmp_path), "machine A").lookup("k") == floor.Verdict(False, 2.0, 1.0, "cached")
    assert floor.VerdictCache(str(tmp_path), "machine B").lookup("k") is None


def test_cached_whole_model_verdict_builds_nothing(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _chain(rng)
    fake_timer([(0.5, 1.0), (0.5, 1.0), (3.0, 1.0)])
    _session(model, tmp_path)
    from fusegraph.onnx import plan

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a unit was built although the cached verdict is ONNX Runtime")

    monkeypatch.setattr(plan.SessionPlan, "_fusegraph_unit", no_build)
    sess = _session(model, tmp_path)
    assert [s.kind for s in sess.partition_report().subgraphs] == ["onnxruntime"]
    _check(sess, model, rng)


def test_floor_off_and_pinned_engine_measure_nothing(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    model = _chain(rng)
    timer = fake_timer([])
    for opts in ({"floor": "off"}, {"floor": "auto"}):  # auto: off where an engine is pinned
        rep = _session(model, tmp_path, **opts).partition_report()
        assert [s.kind for s in rep.subgraphs] == ["fusegraph", "onnxruntime", "fusegraph"]
        assert rep.subgraphs[0].floor == "floor: off" and rep.floor == ""
    assert timer.calls == 0


def test_unit_that_disagrees_is_handed_back(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _chain(rng)
    timer = fake_timer([])
    monkeypatch.setattr(floor, "agreement", lambda got, want: 0.5)
    rep = _session(model, tmp_path).partition_report()
    assert timer.calls == 0 and rep.fusegraph_nodes == 0
    assert "disagrees with ONNX Runtime" in rep.subgraphs[0].note


def test_boundary_copies_are_counted(rng: np.random.Generator, tmp_path: Path) -> None:
    """NHWC inside the claimed conv groups: the feed is laid out on entry, each conv group's
    output made contiguous for ONNX Runtime or the caller, ORT's output laid out again."""
    rep = _session(_chain(rng), tmp_path, floor="off", channels_last="on").partition_report()
    b = rep.boundaries
    assert b.values == 3  # x -> unit 0, b -> Neg, c -> unit 2
    assert b.copies == 4 and b.copy_bytes == 4 * 4 * 6 * 6 * 4
    assert "4 copied" in str(rep)
    flat = _session(_chain(rng), tmp_path, floor="off", channels_last="off").partition_report()
    assert flat.boundaries.copies == 0


# ---- pieces ---------------------------------------------------------------------------------------
def test_group_key_ignores_names_and_weights(rng: np.random.Generator) -> None:
    from fusegraph.onnx.model import specialize

    def key(model: onnx.ModelProto) -> str:
        og = specialize(model, {"x": (1, 4, 6, 6)})
        return floor.group_key(og, og.nodes, ["x"], ["y"])

    a = _chain(rng)
    b = _chain(rng)  # other weights
    for n in b.graph.node:
        n.name = n.name + "_renamed"
    assert key(a) == key(b)
    c = _chain(rng)
    c.graph.node[0].attribute[0].ints[:] = [0, 0, 0, 0]  # other pads: another sub-model
    c.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 2
    c.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 2
    c.graph.node[3].attribute[0].ints[:] = [0, 0, 0, 0]
    assert key(a) != key(c)


class FakeClock:
    """time.perf_counter for floor.time_pair: each call of a side advances it by that side's cost."""

    def __init__(self) -> None:
        self.now = 0.0
        self.order: list[str] = []

    def __call__(self) -> float:
        return self.now

    def side(self, name: str, cost_s: float) -> floor.Call:
        def run() -> None:
            self.order.append(name)
            self.now += cost_s

        return run


def test_time_pair_alternates_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(floor.time, "perf_counter", clock)
    fg_ms, ort_ms, *_ = floor.time_pair(clock.side("f", 0.002), clock.side("o", 0.003), 0.0)
    assert (fg_ms, ort_ms) == pytest.approx((2.0, 3.0))
    order = clock.order
    assert order[:2] == ["f", "o"]  # one call each first (not clear-cut here)
    runs_per_block = floor.MIN_RUNS + 1  # a warm-up run, then the timed ones
    blocks = [order[i:i + runs_per_block] for i in range(2, len(order), runs_per_block)]
    assert len(blocks) == 2 * floor.ROUNDS and all(len(set(b)) == 1 for b in blocks)
    assert [b[0] for b in blocks] == ["f", "o", "o", "f", "f", "o"]


def test_time_pair_decides_clear_cut_cases_after_two_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(floor.time, "perf_counter", clock)
    fg_ms, ort_ms, *_ = floor.time_pair(clock.side("f", 2.0), clock.side("o", 0.1), 10.0)
    assert clock.order == ["f", "o", "f", "o"] and (fg_ms, ort_ms) == pytest.approx((2000.0, 100.0))


def test_time_pair_does_not_let_one_stalled_call_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call stalled by a neighbour (600 ms of an 11 ms plan) is not clear-cut: the
    second call each disagrees, so the blocks decide."""
    clock = FakeClock()
    monkeypatch.setattr(floor.time, "perf_counter", clock)
    costs = iter([0.6] + [0.011] * 1000)

    def stalled() -> None:
        clock.order.append("f")
        clock.now += next(costs)

    fg_ms, ort_ms, *_ = floor.time_pair(stalled, clock.side("o", 0.014), 0.0)
    assert fg_ms == pytest.approx(11.0) and ort_ms == pytest.approx(14.0)


@pytest.mark.parametrize(
    ("raw", "want"), [("auto", "auto"), ("1", "on"), ("off", "off"), (0, "off"), ("2.5", "2.5"), ("", "auto")]
)
def test_floor_option(raw: Any, want: str) -> None:
    assert ProviderOptions.parse({"floor": raw}).floor == want


@pytest.mark.parametrize("raw", ["-1", "fast", "nan", "inf"])
def test_floor_option_rejects(raw: str) -> None:
    with pytest.raises(ValueError, match="floor"):
        ProviderOptions.parse({"floor": raw})


def test_floor_budget() -> None:
    assert ProviderOptions.parse({}).floor_budget(pinned=False) > 0
    assert ProviderOptions.parse({}).floor_budget(pinned=True) == 0
    assert ProviderOptions.parse({"floor": "on"}).floor_budget(pinned=True) > 0
    assert ProviderOptions.parse({"floor": "3"}).floor_budget(pinned=False) == 3.0


def test_units_beyond_the_budget_are_kept_unmeasured(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    model = _chain(rng)
    timer = fake_timer([(0.5, 1.0), (0.5, 1.0)])  # the first unit, then the whole model
    rep = _session(model, tmp_path, floor="0.0001").partition_report()
    assert timer.calls == 2
    first, _, second = rep.subgraphs
    assert "(measured)" in first.floor and "not measured" in second.floor and "budget" in second.floor
    assert second.kind == "fusegraph"


def test_engine_warnings_reach_the_report(
    rng: np.random.Generator, tmp_path: Path, fake_timer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No silent fallback: what an engine warns of while a unit is built or first run (e.g.
    the torch engine running eagerly because oneDNN Graph refused the graph) is in the report."""
    import logging

    from fusegraph.onnx import units

    run = units.FusegraphUnit.run

    def warning_run(self: Any, values: Any) -> Any:
        logging.getLogger("fusegraph.engines.torch").warning("graph '%s': simulated eager fallback", self.name)
        return run(self, values)

    monkeypatch.setattr(units.FusegraphUnit, "run", warning_run)
    model = _chain(rng)
    sess = _session(model, tmp_path, floor="off")
    _check(sess, model, rng)
    rep = sess.partition_report()
    assert "simulated eager fallback" in rep.subgraphs[0].note
    assert rep.subgraphs[0].note.count("simulated") == 1  # first run only
    fake_timer([(2.0, 1.0), (0.5, 1.0), (0.5, 1.0)])
    rep = _session(model, tmp_path / "b").partition_report()
    assert "the engine said" in rep.subgraphs[0].note and "simulated eager fallback" in rep.subgraphs[0].note


def test_a_losing_unit_is_tried_on_the_other_engine(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    """With the selection layer choosing, a unit that loses is built on the other compiling
    engine and timed the same way (plan_floor.runner_up); its win is kept, recorded as the
    group's choice, and a later session builds that engine directly, measuring nothing."""
    from fusegraph.engines.registry import REGISTRY
    from fusegraph.onnx import choices

    compiling = [e.name for e in REGISTRY.engines() if e.name != "reference" and e.available()]
    if len(compiling) < 2:
        pytest.skip(f"needs two compiling engines, found {compiling}")
    model = _chain(rng)
    timer = fake_timer([(2.0, 1.0), (0.5, 1.0), (0.5, 1.0)])  # first engine loses, the other wins; whole plan wins
    sess = _session(model, tmp_path, engine="auto", op_types_to_exclude="")
    assert timer.calls == 3
    rep = sess.partition_report()
    (unit,) = [s for s in rep.subgraphs if s.kind == "fusegraph"]
    assert "kept on fusegraph" in unit.floor and unit.fusegraph_ms == 0.5
    assert (tmp_path / choices.FILE).is_file()
    _check(sess, model, rng)
    first = next(iter(sess._plans.values())).units[0].plan.engine
    recorded = json.loads((tmp_path / choices.FILE).read_text())
    assert [v["engine"] for v in recorded.values()] == [first]
    again = _session(model, tmp_path, engine="auto", op_types_to_exclude="")
    assert timer.calls == 3  # cached verdicts: nothing timed
    assert next(iter(again._plans.values())).units[0].plan.engine == first
    _check(again, model, rng)


def test_both_engines_losing_says_so(rng: np.random.Generator, tmp_path: Path, fake_timer: Any) -> None:
    from fusegraph.engines.registry import REGISTRY

    compiling = [e.name for e in REGISTRY.engines() if e.name != "reference" and e.available()]
    if len(compiling) < 2:
        pytest.skip(f"needs two compiling engines, found {compiling}")
    model = _chain(rng)
    fake_timer([(2.0, 1.0), (3.0, 1.0)])
    sess = _session(model, tmp_path, engine="auto", op_types_to_exclude="")
    rep = sess.partition_report()
    assert [s.kind for s in rep.subgraphs] == ["onnxruntime"]
    assert "handed to ONNX Runtime" in rep.subgraphs[0].note and "on engine" in rep.subgraphs[0].note
    assert "3.000 ms" in rep.subgraphs[0].note
    _check(sess, model, rng)

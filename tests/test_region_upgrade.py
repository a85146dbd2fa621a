"""A session's regions chosen after it opens (fusegraph/onnx/region_upgrade.py, issue 24
item 6): on a GPU with ``floor_mode=background`` the regions without a stored verdict start
on the incumbent (the same nodes op by op on PyTorch) and a background thread builds and
measures them, then swaps the upgraded plan in. Checked on the CPU by turning the deferral on
there (it is GPU-only by default), with a virtual clock and a builder the test holds back:
outputs against ONNX Runtime before, during and after the upgrade, the report's rows (pending,
then measured), a warm second session with nothing pending, runs and measurements taking
turns, a failing background thread leaving the incumbent running, a dropped session stopping
its thread; one GPU-marked test with the real deferral on cuda:0."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_onnx_regions import MODELS, PROVIDERS, _agree, _fake_floor, _rows, _session, conv_blocks

import fusegraph.onnx as fgo
from fusegraph.onnx import region_choice, region_upgrade
from fusegraph.onnx.plan_regions import RegionUnit
from fusegraph.regions.choose import PENDING, Chooser

pytest.importorskip("torch", reason="the region path passes torch tensors (fusegraph[torch])")
pytestmark = pytest.mark.usefixtures("own_cache")

SHAPE = MODELS["conv_blocks"][1]


@pytest.fixture
def deferring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deferral on for CPU sessions too (by default only a GPU session defers)."""
    monkeypatch.setattr(region_upgrade, "deferred", lambda opts, handle: True)


def _held_builder(monkeypatch: pytest.MonkeyPatch, gate: threading.Event, built: list[str],
                  fail: BaseException | None = None) -> None:
    """Each session's builder waits for ``gate`` (so the test decides when the background
    thread gets on), records what it builds, and raises ``fail`` where given."""
    inner_for = region_choice.chooser_for

    def chooser_for(plan: Any) -> Chooser:
        c = inner_for(plan)
        inner = c.builder
        assert inner is not None

        def build(region: Any) -> Any:
            assert gate.wait(30), "the test never released the builder"
            built.append(region.pattern)
            if fail is not None:
                raise fail
            return inner(region)

        c.builder = build
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)


def _unit(sess: fgo.InferenceSession) -> RegionUnit:
    units = [u for p in sess._plans.values() for u in p.units if isinstance(u, RegionUnit)]
    assert len(units) == 1
    return units[0]


def test_a_first_session_runs_the_incumbent_at_once_and_upgrades_in_the_background(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)  # fusegraph wins every region
    release, built = threading.Event(), []
    _held_builder(monkeypatch, release, built)
    model = conv_blocks(rng)
    sess = _session(model, floor="on")
    unit = _unit(sess)
    assert unit.upgrade is None and unit._later is not None  # the thread starts at the first run
    assert unit._measuring  # regions without a verdict: measured (the incumbent is captured on a GPU)
    rows = _rows(sess.partition_report())
    assert [r.source for r in rows] == [PENDING] * 4, str(sess.partition_report())
    assert all(r.where == "fake" for r in rows)  # the incumbent runs them
    assert all("built and measured in the background" in r.why for r in rows)
    assert built == [] and measured == []
    _agree(sess, model, SHAPE, rng)  # runs while every region is pending: the incumbent's numbers
    assert unit.upgrade is not None and not unit.upgrade.done and not unit._swapped
    assert sess.wait_for_evaluation(timeout=0.05) is False  # still held back
    release.set()
    assert sess.wait_for_evaluation(timeout=60)
    assert unit.upgrade.error is None
    rows = _rows(sess.partition_report())
    assert [r.source for r in rows] == ["measured"] * 4, str(sess.partition_report())
    assert all(r.where == "fusegraph:torch" for r in rows)
    # conv1 and conv2 share one content key: measured once, as in an inline choice
    assert sorted(measured) == ["cudnn.conv.bias_act", "cudnn.conv.bias_act", "triton.reduction"]
    _agree(sess, model, SHAPE, rng)  # the upgraded plan's numbers
    assert unit._swapped and unit._later is None and unit._weights_dev == {}
    # a second session finds every verdict stored: nothing is measured again; its winners
    # are built in the background too (the next test), and with floor_mode=inline at once
    measured.clear()
    again = _session(model, floor="on")
    assert [r.source for r in _rows(again.partition_report())] == [PENDING] * 4
    _agree(again, model, SHAPE, rng)
    assert again.wait_for_evaluation(timeout=60)
    assert [r.source for r in _rows(again.partition_report())] == ["cached"] * 4
    assert measured == []
    _agree(again, model, SHAPE, rng)
    monkeypatch.setattr(region_upgrade, "deferred", lambda opts, handle: False)
    inline = _session(model, floor="on")
    assert _unit(inline).upgrade is None and _unit(inline)._later is None
    assert [r.source for r in _rows(inline.partition_report())] == ["cached"] * 4 and measured == []


def test_a_warm_session_builds_its_winners_in_the_background(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator) -> None:
    """A stored verdict keeping fusegraph's plan: the plan is not built at open (on a GPU
    each loads or compiles kernels); the region starts on the incumbent and its plan is
    built (not measured again) in the background."""
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 1.0 if r.pattern.startswith("cudnn.conv") else 4.0, 2.0, measured)
    model = conv_blocks(rng)
    first = _session(model, floor="on")
    assert first.wait_for_evaluation(timeout=60)
    faked = region_choice.chooser_for
    slow: list[str] = []

    def chooser_for(plan: Any) -> Chooser:
        c = faked(plan)
        inner = c.build_later
        assert inner is not None  # the ONNX door builds every stored winner later
        c.build_later = lambda v: slow.append(v.engine) or inner(v)  # type: ignore[func-returns-value]
        return c

    monkeypatch.setattr(region_choice, "chooser_for", chooser_for)
    measured.clear()
    sess = _session(model, floor="on")
    rows = _rows(sess.partition_report())
    # the pooling region won (its plan deferred); the convolutions lost (the incumbent, at once)
    assert [r.source for r in rows] == ["cached", "cached", "cached", PENDING], str(sess.partition_report())
    assert "keeps fusegraph's plan (torch): built in the background" in rows[3].why and slow == ["torch"]
    assert not _unit(sess)._measuring  # only built: the incumbent plan is not worth a capture
    _agree(sess, model, SHAPE, rng)
    assert sess.wait_for_evaluation(timeout=60) and measured == []  # built, not measured again
    rows = _rows(sess.partition_report())
    assert [r.source for r in rows] == ["cached"] * 4 and rows[3].where == "fusegraph:torch"
    _agree(sess, model, SHAPE, rng)


def test_runs_during_the_upgrade_stay_right_and_the_incumbent_keeps_what_it_wins(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator) -> None:
    measured: list[str] = []
    # the incumbent wins the convolutions: those stay op by op after the upgrade
    _fake_floor(monkeypatch, lambda r: 1.0 if r.pattern.startswith("cudnn.conv") else 4.0, 2.0, measured)
    model = conv_blocks(rng)
    sess = _session(model, floor="on")
    unit = _unit(sess)
    ref_sess = fgo.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    runs = 0
    while unit.upgrade is None or not unit.upgrade.done or runs < 3:  # runs beside the thread's work
        x = rng.standard_normal(SHAPE).astype(np.float32)
        got, want = sess.run(None, {"x": x})[0], ref_sess.run(None, {"x": x})[0]
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
        runs += 1
    assert sess.wait_for_evaluation(timeout=60)
    rows = _rows(sess.partition_report())
    assert [r.where for r in rows] == ["fake", "fake", "fake", "fusegraph:torch"], str(sess.partition_report())
    assert all(r.source == "measured" for r in rows)
    _agree(sess, model, SHAPE, rng)


def test_a_failing_background_choice_leaves_the_incumbent_running(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator,
        caplog: pytest.LogCaptureFixture) -> None:
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, [])
    release, built = threading.Event(), []
    release.set()
    _held_builder(monkeypatch, release, built, fail=RuntimeError("boom in a compiler"))
    model = conv_blocks(rng)
    sess = _session(model, floor="on")
    unit = _unit(sess)
    assert sess.wait_for_evaluation(timeout=60)  # starts the thread where no run has
    assert isinstance(unit.upgrade.error, RuntimeError) if unit.upgrade else False
    assert "choosing its regions in the background failed (RuntimeError: boom in a compiler)" in caplog.text
    assert [r.source for r in _rows(sess.partition_report())] == [PENDING] * 4
    _agree(sess, model, SHAPE, rng)  # still the incumbent, still right
    assert not unit._swapped


def test_a_dropped_session_stops_its_background_thread(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator) -> None:
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, [])
    release, built = threading.Event(), []
    _held_builder(monkeypatch, release, built)
    model = conv_blocks(rng)
    sess = _session(model, floor="on")
    unit = _unit(sess)
    sess.run(None, {"x": rng.standard_normal(SHAPE).astype(np.float32)})  # starts the thread
    upgrade = unit.upgrade
    assert upgrade is not None
    threading.Timer(0.2, release.set).start()  # the region at hand finishes after the drop
    ref = weakref.ref(unit)
    del sess, unit
    assert upgrade.wait(30)
    assert upgrade.cancel.is_set() and upgrade.error is None
    assert len(built) < 3, built  # stopped after the region at hand, not every region built
    import gc

    gc.collect()
    assert ref() is None, "the stopped unit is still alive"


def test_measurements_wait_for_the_runs_of_every_unit_on_the_device(
        monkeypatch: pytest.MonkeyPatch, deferring: None, rng: np.random.Generator) -> None:
    """The chooser's measurements go through the device's gate: while a run (of any session
    on the device) holds it, a built region waits to be timed."""
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 4.0, 2.0, measured)
    release, built = threading.Event(), []
    release.set()
    _held_builder(monkeypatch, release, built)
    sess = _session(conv_blocks(rng), floor="on")
    unit = _unit(sess)
    assert unit.chooser.guard is not None and unit.gate is region_upgrade.gate_for("cpu")
    with unit.gate.run():  # as a run of another session would
        unit._start_upgrade()
        deadline = time.monotonic() + 30
        while not built and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert built and measured == [], (built, measured)  # built, and waiting to be timed
    assert unit.wait(60) and unit.upgrade is not None and unit.upgrade.error is None
    assert sorted(measured) == ["cudnn.conv.bias_act", "cudnn.conv.bias_act", "triton.reduction"]


def test_the_gate_lets_a_waiting_run_in_before_the_next_measurement() -> None:
    gate = region_upgrade.Gate()
    order: list[str] = []
    in_run, let_go = threading.Event(), threading.Event()

    def user() -> None:
        with gate.run():
            in_run.set()
            assert let_go.wait(10)
            order.append("run")

    def measurer() -> None:
        with gate.measure():
            order.append("measure")

    t1 = threading.Thread(target=user)
    t1.start()
    assert in_run.wait(10)
    t2 = threading.Thread(target=measurer)
    t2.start()
    time.sleep(0.05)
    assert order == []  # the measurement waits for the run in flight
    let_go.set()
    t1.join(10)
    t2.join(10)
    assert order == ["run", "measure"]


def test_only_gpu_sessions_defer_by_default() -> None:
    from fusegraph.onnx.options import ProviderOptions
    from fusegraph.runtime.handle import Handle

    cpu = Handle("cpu")
    opts = ProviderOptions.parse({"floor_mode": "background"})
    assert not region_upgrade.deferred(opts, cpu)
    gpu: Callable[[], Any] = lambda: type("H", (), {"device": type("D", (), {"is_gpu": True})()})()  # noqa: E731
    assert region_upgrade.deferred(opts, gpu())
    for off in ({"floor_mode": "inline"}, {"floor_mode": "background", "autotune": "10"},
                {"floor_mode": "background", "precision": "tf32"}):
        assert not region_upgrade.deferred(ProviderOptions.parse(off), gpu()), off


@pytest.mark.gpu
def test_on_cuda_a_first_session_defers_and_its_upgrade_is_captured(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = conv_blocks(rng)
    opts = {"device": "cuda:0", "floor_mode": "background", "runners": "off"}
    sess = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[opts, {}])
    unit = _unit(sess)
    assert unit._later is not None and unit.upgrade is None, "a cold GPU session should defer its regions"
    pieces = unit._later[0]  # rebuilt in place by the upgrade
    slow = ("cudnn_benchmark", False)
    assert any(slow in p.plan.config.knobs for p in pieces), "the incumbent's convolutions should start untimed"
    _agree(sess, model, SHAPE, rng, rel=1e-3)  # the first run captures the incumbent plan, then the thread starts
    assert unit.upgrade is not None
    assert sess.wait_for_evaluation(timeout=300)
    assert unit.upgrade.error is None
    assert not [p.where for p in pieces if slow in p.plan.config.knobs], "the upgrade should time every convolution"
    assert all(r.source in ("measured", "refused") for r in _rows(sess.partition_report()))
    _agree(sess, model, SHAPE, rng, rel=1e-3)
    assert unit.capture_note == "one CUDA graph", unit.capture_note
    again = fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[opts, {}])
    assert _unit(again).upgrade is None
    _agree(again, model, SHAPE, rng, rel=1e-3)


def test_captures_are_postponed_on_the_choosing_thread_only() -> None:
    from fusegraph.engines import cuda_capture

    seen: list[bool] = []
    with cuda_capture.postponed():
        assert not cuda_capture.allowed()
        other = threading.Thread(target=lambda: seen.append(cuda_capture.allowed()))
        other.start()
        other.join(10)
        with cuda_capture.postponed():
            assert not cuda_capture.allowed()
        assert not cuda_capture.allowed()  # nested: still postponed
    assert cuda_capture.allowed() and seen == [True]

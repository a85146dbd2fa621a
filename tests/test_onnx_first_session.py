"""A model's first session on the CPU (issue 24 item 7): one evaluation per machine and device
whatever the load, the background child held while the caller's session runs (and its
timings not spoiled by the holds), a new input shape of a dynamic model never waiting for an
evaluation, and a child still at work at exit naming its log. Decisions are asserted (keys,
launches, the child's process state, the gate's counter), never wall-clock times; numerics
against ONNX Runtime."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_floor import FakeClock, _chain, fake_timer  # noqa: F401  (fixture)

import fusegraph.onnx as fgo
from fusegraph.onnx import background, direct, evaluate, floor, session
from fusegraph.onnx.options import ProviderOptions
from fusegraph.onnx.session import session_handle
from fusegraph.select.device_id import device_id

OPTS = {"engine": "reference", "torch_mlir_tier": "off", "op_types_to_exclude": "Neg", "floor": "on",
        "floor_mode": "background", "runners": "off"}
REAL_POPEN = subprocess.Popen  # the session test replaces the child's command
SLEEPER = "import time\nwhile True:\n    time.sleep(0.005)\n"
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists() or sys.platform == "win32",
                                reason="the child's stopped state is read from /proc (Linux)")


def _open(model: Any, cache: Path, **extra: Any) -> fgo.InferenceSession:
    return fgo.InferenceSession(model, providers=[(fgo.PROVIDER, {**OPTS, "cache_dir": str(cache), **extra}),
                                                  "CPUExecutionProvider"])


def _cache(tmp: Path, **extra: Any) -> floor.VerdictCache:
    opts = ProviderOptions.parse({**OPTS, "cache_dir": str(tmp), **extra})
    return floor.cache_for(opts, device_id(session_handle(opts)))


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def _no_launch(*a: Any, **k: Any) -> Any:
    raise AssertionError("no background evaluation expected")


# ---- (a) one evaluation per machine and device ---------------------------------------------------
def test_a_second_session_in_another_load_class_reuses_the_verdict(tmp_path: Path, rng: np.random.Generator,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(rng)
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    source = background.source_of(str(path))
    assert source is not None
    busy = _cache(tmp_path / "c", load="busy", runners="ort-nospin")
    busy.record(source.content, floor.Verdict(False, 4.0, 10.0, "measured", runner="ort-nospin"))
    busy.flush()
    monkeypatch.setattr(background, "launch", _no_launch)
    quiet = _open(str(path), tmp_path / "c", load="quiet", runners="ort-nospin")
    assert quiet._direct is not None and quiet._direct.evaluation is None
    assert getattr(quiet._direct.runner, "name", "") == "onnxruntime"  # ORT without spinning won on a busy machine only
    v = quiet._direct.verdict
    assert v is not None and v.load == "busy" and "on a quiet one the caller's session" in v.why
    again = _open(str(path), tmp_path / "c", load="busy", runners="ort-nospin")
    assert again._direct is not None and getattr(again._direct.runner, "name", "") == "ort-nospin"
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for sess in (quiet, again):
        got = sess.run(None, {"x": x})[0]
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_the_verdict_key_holds_the_engines_versions_not_the_load(tmp_path: Path) -> None:
    a = _cache(tmp_path, load="busy").settings
    assert a == _cache(tmp_path, load="quiet").settings
    assert "iree-base-compiler" in a and "onnxruntime" in a and "load" not in a


# ---- (b) the child held while the session runs ----------------------------------------------------
@pytest.fixture
def sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Starts stand-ins for the child (their own process group, as launch starts it); kills them after."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = REAL_POPEN([sys.executable, "-c", SLEEPER], start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


@needs_proc
def test_the_gate_stops_the_child_for_a_run_and_continues_it_when_idle(tmp_path: Path, sleeper: Any) -> None:
    proc = sleeper()
    counter = tmp_path / "c.gate"
    counter.write_bytes(background.COUNTER.pack(0))
    gate = background.Gate(proc.pid, counter, resume_s=0.05)
    with gate.hold():
        assert _until(lambda: background._held(proc.pid)), "the child should be stopped during the run"
        assert background.COUNTER.unpack(counter.read_bytes())[0] == 1  # bumped before the stop
    assert _until(lambda: not background._held(proc.pid)), "the child should go on once the session is idle"
    for _ in range(5):  # back to back: stopped once, not woken between runs
        gate.enter()
        gate.leave()
    assert gate.pauses == 2
    gate.enter()
    gate.close()  # the caller's process exits: continued for good, even mid-run
    assert _until(lambda: not background._held(proc.pid))
    gate.leave()
    gate.enter()
    assert not gate.stopped and gate.pauses == 2


def test_the_child_goes_on_only_after_a_longer_pause_than_usual() -> None:
    gate = background.Gate(0, None, resume_s=0.1)
    assert gate.idle_needed() == 0.1  # no runs yet
    gate._gaps.extend([0.05, 0.06, 0.04])  # a caller running every ~50 ms
    assert gate.idle_needed() == pytest.approx(background.IDLE_FACTOR * 0.05)
    gate._gaps.extend([30.0] * 5)  # one that runs twice a minute still lets the child finish
    assert gate.idle_needed() == background.MAX_IDLE_S


@needs_proc
def test_a_session_holds_its_child_while_run_is_in_progress(tmp_path: Path, rng: np.random.Generator,
                                                            monkeypatch: pytest.MonkeyPatch, sleeper: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    commands: list[list[str]] = []

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        commands.append(cmd)
        assert kw.get("start_new_session")
        return sleeper()

    monkeypatch.setattr(background.subprocess, "Popen", popen)
    model = _chain(rng)
    sess = _open(model.SerializeToString(), tmp_path)
    assert sess._direct is not None and sess._direct.evaluation is not None
    evaluation = sess._direct.evaluation
    assert evaluation.gate is not None and "--gate" in commands[0]
    seen: list[bool] = []
    real = sess._direct.runner

    class Probe:
        name = "onnxruntime"

        def run(self, wanted: Any, feed: Any, run_options: Any = None) -> list[Any]:
            seen.append(_until(lambda: background._held(evaluation.pid), 5.0))
            return real.run(wanted, feed, run_options)

    sess._direct.runner = Probe()
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = sess.run(None, {"x": x})[0]
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
    assert seen == [True], "the child must be stopped while the session's run is in progress"
    assert _until(lambda: not background._held(evaluation.pid)), "and go on after it"
    assert evaluation.gate.pauses == 1

    # (d) the caller's process exits while the child works: continued, and its log named
    sess.run(None, {"x": x})
    evaluation.gate.enter()  # as if the exit came in the middle of a run
    with caplog.at_level(logging.WARNING, logger="fusegraph.onnx"):
        background.at_exit()
    assert str(evaluation.log_path) in caplog.text and str(evaluation.pid) in caplog.text
    assert "still running" in caplog.text
    assert _until(lambda: not background._held(evaluation.pid)), "a child is never left stopped at exit"


def test_at_exit_says_nothing_for_finished_children(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    cache = _cache(tmp_path)
    background._register(background.Evaluation(proc, proc.pid, tmp_path / "x.log", tmp_path / "x.lock", cache,
                                               background.Source("m", None, b"")))
    with caplog.at_level(logging.WARNING, logger="fusegraph.onnx"):
        background.at_exit()
    assert "still running" not in caplog.text


def test_timed_calls_the_child_was_held_in_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(floor.time, "perf_counter", clock)
    held = {"n": 0, "calls": 0}
    monkeypatch.setattr(floor.PAUSES, "read", lambda: held["n"])

    def fg() -> None:
        held["calls"] += 1
        if held["calls"] in (1, 5):  # the clear-cut call and a timed one: the parent held the child
            held["n"] += 1
            clock.now += 0.5
        clock.now += 0.001

    t = floor.time_pair(fg, clock.side("o", 0.0015), 0.0)
    assert (t.fusegraph_ms, t.ort_ms) == pytest.approx((1.0, 1.5))
    assert floor.decide_timing(t).keep


def test_the_child_reads_the_gate_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(floor.PAUSES, "read", floor.PAUSES.read)  # restored after the test
    path = tmp_path / "g.gate"
    path.write_bytes(background.COUNTER.pack(0))
    mapped = evaluate._count_holds(str(path))
    assert mapped is not None and floor.PAUSES() == 0
    path.write_bytes(background.COUNTER.pack(7))
    assert floor.PAUSES() == 7
    mapped.close()


# ---- (c) a new input shape never waits ---------------------------------------------------------------
def _dynamic(rng: np.random.Generator) -> onnx.ModelProto:
    w = (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["y"])]
    g = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class FakeChild:
    gate = None

    def __init__(self, log_path: Path, verdict: floor.Verdict) -> None:
        self.log_path = log_path
        self.finished = False
        self._verdict = verdict
        self.pid = 0

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished

    def verdict(self) -> floor.Verdict:
        return self._verdict

    def describe(self) -> str:
        return "fake child"


def test_a_new_shape_runs_on_ort_at_once_and_is_evaluated_in_the_background(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _dynamic(rng)
    data = model.SerializeToString()
    release = threading.Event()
    launched: list[tuple[str, dict[str, Any]]] = []
    children: list[FakeChild] = []

    def launch(source: background.Source, opts: Any, cache: Any, shapes: Any = None) -> FakeChild:
        launched.append((source.content, dict(shapes)))
        release.wait(30)  # a slow launch (or lookup) must not hold up the caller's run
        children.append(FakeChild(tmp_path / "fake.log", floor.Verdict(False, 3.0, 1.0, "cached", "ORT won")))
        return children[-1]

    def no_plan(*a: Any, **k: Any) -> Any:
        raise AssertionError("no plan is built for a shape that has no verdict")

    monkeypatch.setattr(background, "launch", launch)
    monkeypatch.setattr(session, "SessionPlan", no_plan)
    monkeypatch.setattr(direct, "POLL_S", 0.0)
    sess = _open(data, tmp_path)
    shaped = sess._direct
    assert isinstance(shaped, direct.ShapedOrt) and not launched
    assert [i.shape for i in sess.get_inputs()] == [["N", 4, 6, 6]]
    ref = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (1, 3, 1):
        x = rng.standard_normal((n, 4, 6, 6)).astype(np.float32)
        got, want = sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
        assert got.shape == (n, 4, 6, 6) and np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
    assert _until(lambda: len(launched) == 1)
    assert launched[0][1] == {"x": (1, 4, 6, 6)} and "|shapes x=1x4x6x6" in launched[0][0]
    assert shaped.pending and "waiting for its evaluation" in sess.partition_report().floor
    release.set()
    assert _until(lambda: shaped.evaluation is not None)
    sess.run(None, {"x": rng.standard_normal((3, 4, 6, 6)).astype(np.float32)})
    assert len(launched) == 1, "one child at a time: batch 3 waits for batch 1's"
    children[0].finished = True
    sess.run(None, {"x": rng.standard_normal((3, 4, 6, 6)).astype(np.float32)})  # polls: batch 1 decided, 3 launched
    assert _until(lambda: len(launched) == 2) and launched[1][1] == {"x": (3, 4, 6, 6)}
    children[1].finished = True
    assert sess.wait_for_evaluation(timeout=30)
    assert {k: v.keep for k, v in shaped.shape_verdicts.items()} == {
        (("x", (1, 4, 6, 6)),): False, (("x", (3, 4, 6, 6)),): False}
    assert "ORT won" in sess.partition_report().floor


def _recorded_at_batch_2(tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                         verdict: floor.Verdict) -> bytes:
    """A dynamic model whose verdict at batch 2 is already in the cache (no child is launched)."""
    data = _dynamic(rng).SerializeToString()
    source = background.source_of(data)
    assert source is not None
    cache = _cache(tmp_path)
    cache.record(background.at_shapes(source, {"x": (2, 4, 6, 6)}).content, verdict)
    cache.flush()
    monkeypatch.setattr(background, "launch", _no_launch)
    return data


def test_a_dropped_dynamic_session_frees_its_plans_without_the_collector(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, fake_timer: Any) -> None:  # noqa: F811
    """The shapes runner (direct.ShapedOrt) holds its session weakly: dropping a dynamic-shape
    session frees it and the plans built for its shapes at once, with the collector off."""
    import gc
    import weakref

    with contextlib.suppress(ImportError):  # a first import of torch inside the session leaves a frame cycle
        import torch  # noqa: F401
    data = _recorded_at_batch_2(tmp_path, rng, monkeypatch, floor.Verdict(True, 1.0, 2.0, "measured"))
    fake_timer([(1.0, 2.0), (1.0, 2.0)])
    sess = _open(data, tmp_path)
    sess.run(None, {"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32)})
    assert sess.wait_for_evaluation(timeout=120)
    assert isinstance(sess._direct, direct.ShapedOrt)
    (plan,) = sess._direct.plans.values()
    refs = [weakref.ref(sess), weakref.ref(sess._direct), weakref.ref(plan)]
    del plan
    gc.collect()
    gc.disable()
    try:
        del sess
        alive = [type(r()).__name__ for r in refs if r() is not None]
    finally:
        gc.enable()
    assert not alive, f"outlive the dropped session: {alive}"


def test_a_recorded_shape_verdict_is_not_evaluated_again(tmp_path: Path, rng: np.random.Generator,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    data = _recorded_at_batch_2(tmp_path, rng, monkeypatch, floor.Verdict(False, 3.0, 1.0, "measured"))
    sess = _open(data, tmp_path)
    sess.run(None, {"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32)})
    assert sess.wait_for_evaluation(timeout=30)
    assert isinstance(sess._direct, direct.ShapedOrt)
    (verdict,) = sess._direct.shape_verdicts.values()
    assert verdict.source == "cached" and not verdict.keep


def test_a_shape_where_fusegraph_won_gets_its_plan(tmp_path: Path, rng: np.random.Generator,
                                                   monkeypatch: pytest.MonkeyPatch, fake_timer: Any) -> None:  # noqa: F811
    data = _recorded_at_batch_2(tmp_path, rng, monkeypatch, floor.Verdict(True, 1.0, 2.0, "measured"))
    fake_timer([(1.0, 2.0), (1.0, 2.0)])  # the plan's own floor (no unit verdicts cached here): fusegraph wins
    sess = _open(data, tmp_path)
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sess.run(None, {"x": x})
    assert sess.wait_for_evaluation(timeout=120)
    assert isinstance(sess._direct, direct.ShapedOrt) and (("x", (2, 4, 6, 6)),) in sess._direct.plans
    got = sess.run(None, {"x": x})[0]
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    assert any(s.kind == "fusegraph" for s in sess.partition_report().subgraphs)


def test_a_real_child_evaluates_a_dynamic_model_at_its_shape(tmp_path: Path, rng: np.random.Generator) -> None:
    data = _dynamic(rng).SerializeToString()
    sess = _open(data, tmp_path)
    sess.run(None, {"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32)})
    assert sess.wait_for_evaluation(timeout=300), "the background evaluation did not finish in 300 s"
    source = background.source_of(data)
    assert source is not None
    recorded = _cache(tmp_path).lookup(background.at_shapes(source, {"x": (2, 4, 6, 6)}).content)
    # the reference engine is far slower than ONNX Runtime: its verdict, measured in the child
    assert recorded is not None and not recorded.keep and "evaluated in the background" in recorded.why
    assert recorded.load == "quiet"


def test_a_process_that_exits_while_its_child_works_names_the_log(tmp_path: Path, rng: np.random.Generator) -> None:
    """The real exit path: a script opens a new model and exits at once; its child goes on
    (continued, not killed) and the script's last words name the child's log."""
    import os
    import re
    import signal

    path = tmp_path / "chain.onnx"
    onnx.save(_chain(rng), path)
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "import fusegraph.onnx as fgo\n"
        f"opts = {dict(OPTS, cache_dir=str(tmp_path / 'cache'))!r}\n"
        "s = fgo.InferenceSession(sys.argv[1], providers=[(fgo.PROVIDER, opts), 'CPUExecutionProvider'])\n"
        "assert s._direct is not None and s._direct.evaluation is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = re.search(r"still running \(pid (\d+)\).*Its log: (\S+\.log)", done.stderr)
    assert found, done.stderr
    pid, log_path = int(found.group(1)), Path(found.group(2))
    assert log_path.parent == tmp_path / "cache" / background.DIR
    try:
        assert not background._held(pid) or not Path("/proc").exists()
    finally:  # the child this test caused: ended here rather than left to finish on its own
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

"""Background evaluation (fusegraph/onnx/background.py, direct.py, evaluate.py): a model with
no floor verdict opens on ONNX Runtime at once while a child measures fusegraph's plan; a
later session decides from the recorded verdict; a session switches to fusegraph's plan
when the evaluation finds it faster. Numerics are checked against ONNX Runtime; timings
are injected where a verdict must come out one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_onnx_floor import _chain, fake_timer  # noqa: F401  (fixture)

import fusegraph.onnx as fgo
from fusegraph.onnx import background, direct, floor
from fusegraph.onnx.load import ModelError
from fusegraph.onnx.options import ProviderOptions
from fusegraph.onnx.session import session_handle
from fusegraph.select.device_id import device_id

OPTS = {"engine": "reference", "torch_mlir_tier": "off", "op_types_to_exclude": "Neg", "floor": "on",
        "floor_mode": "background", "runners": "off"}  # whole-model runners: test_onnx_runners.py


def _open(model: Any, cache: Path, **extra: Any) -> fgo.InferenceSession:
    o = {**OPTS, "cache_dir": str(cache), **extra}
    return fgo.InferenceSession(model, providers=[(fgo.PROVIDER, o), "CPUExecutionProvider"])


def _agrees(sess: fgo.InferenceSession, model: onnx.ModelProto, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,), (want,) = sess.run(None, {"x": x}), ref.run(None, {"x": x})
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-5, err


def _cache(tmp: Path, **extra: Any) -> floor.VerdictCache:
    opts = ProviderOptions.parse({**OPTS, "cache_dir": str(tmp), **extra})
    return floor.cache_for(opts, device_id(session_handle(opts)))


def test_cold_session_runs_ort_while_the_child_evaluates_then_warm_decides_from_the_verdict(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    model = _chain(rng)
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    sess = _open(str(path), tmp_path / "cache")
    assert sess._direct is not None and sess._direct.evaluation is not None
    report = sess.partition_report()
    assert "while fusegraph's evaluation" in report.floor and "pid" in report.floor
    assert [s.kind for s in report.subgraphs] == ["onnxruntime"]
    _agrees(sess, model, rng)  # the incumbent serves meanwhile
    assert sess.wait_for_evaluation(timeout=300), "the background evaluation did not finish in 300 s"
    log = sess._direct.verdict if sess._direct is not None else None
    # The reference engine is far slower than ONNX Runtime: the verdict is ONNX Runtime's.
    assert sess._direct is not None and log is not None and not log.keep and log.source == "cached"
    assert "evaluated in the background" in log.why
    assert not list((tmp_path / "cache" / background.DIR).glob("*.lock"))
    _agrees(sess, model, rng)
    # Every node's reason is there once the verdict is in (explained from the caches, nothing built).
    report = sess.partition_report()
    assert "handed to ONNX Runtime" in report.floor
    assert report.unclaimed, "the explained report lists why nodes run on ONNX Runtime"

    warm = _open(str(path), tmp_path / "cache")  # decided without building, parsing or a child
    assert warm._direct is not None and warm._direct.evaluation is None and warm._model_value is None
    _agrees(warm, model, rng)
    assert warm.wait_for_evaluation(timeout=0)


def test_bytes_model_goes_to_the_child_as_a_file_it_removes(tmp_path: Path, rng: np.random.Generator) -> None:
    model = _chain(rng)
    sess = _open(model.SerializeToString(), tmp_path)
    assert sess._direct is not None and sess._direct.evaluation is not None
    assert sess.wait_for_evaluation(timeout=300)
    assert not list((tmp_path / background.DIR).glob("*.onnx")), "the child's copy of the bytes is removed"
    source = background.source_of(model.SerializeToString())
    assert source is not None and _cache(tmp_path).lookup(source.content) is not None


def test_a_faster_plan_replaces_ort_in_the_running_session(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, fake_timer: Any  # noqa: F811
) -> None:
    model = _chain(rng)

    class Finished:
        log_path = tmp_path / "fake.log"
        gate = None

        def done(self) -> bool:
            return True

        def wait(self, timeout: float | None = None) -> bool:
            return True

        def verdict(self) -> floor.Verdict:
            return floor.Verdict(True, 1.0, 2.0, "cached", "fusegraph's plan won")

        def describe(self) -> str:
            return "finished"

    monkeypatch.setattr(background, "launch", lambda *a: Finished())
    sess = _open(model.SerializeToString(), tmp_path)
    assert sess._direct is not None
    # The plan built after the verdict measures its units inline: make fusegraph win them.
    fake_timer([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)])
    assert sess.wait_for_evaluation(timeout=120)
    assert sess._direct is None, "the session should have switched to fusegraph's plan"
    report = sess.partition_report()
    assert any(s.kind == "fusegraph" for s in report.subgraphs), str(report)
    _agrees(sess, model, rng)


def test_run_switches_without_waiting(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, fake_timer: Any  # noqa: F811
) -> None:
    """``run`` polls the child (never blocks on it) and takes the plan once built."""
    model = _chain(rng)
    state = {"done": False}

    class Later:
        log_path = tmp_path / "fake.log"
        gate = None

        def done(self) -> bool:
            return state["done"]

        def verdict(self) -> floor.Verdict:
            return floor.Verdict(True, 1.0, 2.0, "cached", "won")

        def describe(self) -> str:
            return "running"

    monkeypatch.setattr(background, "launch", lambda *a: Later())
    monkeypatch.setattr(direct, "POLL_S", 0.0)
    sess = _open(model.SerializeToString(), tmp_path)
    _agrees(sess, model, rng)
    assert sess._direct is not None  # not done: still ONNX Runtime
    fake_timer([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)])
    state["done"] = True
    _agrees(sess, model, rng)  # sees the verdict, starts the build
    assert sess._direct is not None and sess._direct._builder is not None
    sess._direct._builder.join(120)
    _agrees(sess, model, rng)  # takes the plan
    assert sess._direct is None


def test_a_recorded_win_builds_the_plan_at_creation(tmp_path: Path, rng: np.random.Generator,
                                                     fake_timer: Any) -> None:  # noqa: F811
    model = _chain(rng)
    data = model.SerializeToString()
    source = background.source_of(data)
    assert source is not None
    cache = _cache(tmp_path)
    cache.record(source.content, floor.Verdict(True, 1.0, 2.0, "measured", "won"))
    cache.flush()
    fake_timer([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)])
    sess = _open(data, tmp_path)
    assert sess._direct is None and sess._last is not None
    _agrees(sess, model, rng)


def test_a_child_that_died_is_recorded_and_not_retried(tmp_path: Path, rng: np.random.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(rng)
    data = model.SerializeToString()
    source = background.source_of(data)
    assert source is not None
    cache = _cache(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    work = tmp_path / background.DIR
    work.mkdir(parents=True)
    lock = work / f"{background._digest(source.content, cache.settings)}.lock"
    lock.write_text(dead.stdout.strip())

    def no_child(*a: Any, **k: Any) -> Any:
        raise AssertionError("no new child for a model whose evaluator died")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    sess = _open(data, tmp_path)
    assert sess._direct is not None and sess._direct.evaluation is None
    verdict = _cache(tmp_path).lookup(source.content)
    assert verdict is not None and not verdict.keep and "ended without a verdict" in verdict.why
    assert not lock.exists()
    _agrees(sess, model, rng)
    again = _open(data, tmp_path)
    assert again._direct is not None and again._direct.verdict is not None


def test_malformed_model_is_a_typed_error_before_ort_reads_it(tmp_path: Path) -> None:
    with pytest.raises(ModelError):
        _open(b"\x08\x07garbage", tmp_path)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError):
        _open(str(bad), tmp_path)


def test_background_applies_only_where_the_floor_measures(tmp_path: Path, rng: np.random.Generator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(rng).SerializeToString()

    def no_launch(*a: Any) -> Any:
        raise AssertionError("no background evaluation expected")

    monkeypatch.setattr(background, "launch", no_launch)
    for extra in ({"floor": "off"}, {"floor_mode": "inline", "floor": "off"}, {"lazy_compile": "1"}):
        sess = _open(model, tmp_path, **extra)
        assert sess._direct is None, extra


def test_floor_mode_option() -> None:
    assert ProviderOptions.parse({"floor_mode": "Inline"}).floor_mode == "inline"
    with pytest.raises(ValueError, match="floor_mode"):
        ProviderOptions.parse({"floor_mode": "later"})

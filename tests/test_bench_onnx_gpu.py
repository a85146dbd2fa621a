"""benchmarks/bench_onnx_gpu.py's setup columns (issue 24 items 6 and 8): open + first run,
until full speed (``wait_for_evaluation``), warm in this process and in a new one. The CPU
smoke run end to end, the new process's failures, and the wait against sessions that stand
in for a pending background evaluation. No timing is asserted, only that each number is
there, finite and positive, and that every session's output agrees with PyTorch's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from bench_modules import load_bench

pytest.importorskip("torch", reason="the benchmark exports PyTorch modules to ONNX")

@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("bench_onnx_gpu", "bench_onnx_gpu_for_setup_test")


def _positive(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _row(bench: ModuleType, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    out = tmp_path / "rows.json"
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 1, data["rows"]
    return data, printed


def test_quick_warm_setup_reports_every_setup_column(bench: ModuleType, tmp_path: Path, rng: np.random.Generator,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick --warm-setup`` (the conv net, fresh random weights and input): setup, ready,
    warm and new-process seconds present and positive for the sessions it opens, the new
    process's imports apart, every output within float32 tolerance of eager PyTorch."""
    seed = str(int(rng.integers(1 << 31)))
    data, printed = _row(bench, ["--quick", "--warm-setup", "--models", "convnet", "--seed", seed], tmp_path, capsys)
    row = data["rows"][0]
    assert "error" not in row and "warm_process_error" not in row, row
    setup = row["setup_s"]
    for col in ("fusegraph", "fusegraph-ready", "fusegraph-whole", "fusegraph-whole-ready", "fusegraph-warm",
                "fusegraph-warm-ready", "fusegraph-warm-process", "fusegraph-warm-process-ready"):
        assert _positive(setup.get(col)), (col, setup)
    assert setup["fusegraph-ready"] >= setup["fusegraph"]  # the same clock, read later
    assert setup["fusegraph-warm-process-ready"] >= setup["fusegraph-warm-process"]
    for variant in ("fusegraph", "fusegraph-whole", "fusegraph-warm"):
        assert isinstance(row[f"{variant}_pending"], bool)
    child = row["warm_process"]
    assert {"numpy", "onnx", "torch", "fusegraph.onnx"} <= set(child["imports_s"]), child
    assert all(_positive(v) for v in child["imports_s"].values()), child
    assert child["cuda_init_s"] is None  # the CPU run creates no CUDA context
    assert 0 < child["open_s"] <= child["setup_s"]
    for variant in ("fusegraph", "fusegraph-whole", "fusegraph-warm-process"):
        err = row["rel_err"][variant]
        assert err < 1e-5, (variant, err)  # NaN fails too
    assert set(data["geomean_setup_s"]) >= {"fusegraph", "fusegraph-ready", "fusegraph-warm-process"}
    assert all(_positive(v) for v in data["geomean_setup_s"].values())
    line = next(ln for ln in printed.splitlines() if ln.startswith("convnet"))
    assert " fusegraph setup " in line and "(ready " in line and "; warm " in line and ", new process " in line, line
    assert "new process: imports " in printed and "not setup" in printed, printed


def test_a_background_evaluation_is_waited_for_and_its_plan_checked(
        bench: ModuleType, tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``floor_mode=background`` with no engine pinned (a cache of its own): the first session
    is pending after its first run; ``-ready`` is read after the wait, the first run's plan and
    the upgraded one are both checked against PyTorch, the sessions opened later find the
    verdict stored (nothing pending, in this process and in the new one)."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEGRAPH_FLOOR_MODE", "background")
    seed = str(int(rng.integers(1 << 31)))
    data, printed = _row(bench, ["--quick", "--warm-setup", "--models", "convnet", "--seed", seed, "--variants",
                                 "fusegraph", "--options", "engine=,floor_mode=background"], tmp_path, capsys)
    row = data["rows"][0]
    assert "error" not in row and "warm_process_error" not in row, row
    assert row["fusegraph_pending"] is True, "the conv net was not pending on the CPU: this test no longer covers the wait"
    assert row["setup_s"]["fusegraph-ready"] >= row["setup_s"]["fusegraph"]
    for variant in ("fusegraph-first", "fusegraph", "fusegraph-warm-process"):
        assert row["rel_err"][variant] < 1e-5, (variant, row["rel_err"])
    assert row["fusegraph-warm_pending"] is False and row["warm_process"]["pending"] is False, row
    assert _positive(row["setup_s"]["fusegraph-warm-process-ready"])
    assert "(ready " in printed


def test_a_failing_new_process_is_reported_in_the_row(bench: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The new process exiting with an error, or running past --process-timeout: the row says
    which (the child's last stderr line), no exception, no setup number for it."""
    args = bench.argparse.Namespace(device="cpu", ready_timeout=5.0, process_timeout=60.0)
    want = np.ones(2, np.float32)
    model, feed = tmp_path / "m.onnx", tmp_path / "m.npz"
    monkeypatch.setattr(bench, "CHILD", "raise SystemExit('the model would not open')")
    row: dict[str, Any] = {"setup_s": {}, "rel_err": {}}
    bench._warm_process(row, model, feed, {}, want, args)
    assert "exited 1" in row["warm_process_error"] and "would not open" in row["warm_process_error"], row
    assert "fusegraph-warm-process" not in row["setup_s"]
    monkeypatch.setattr(bench, "CHILD", "import time; time.sleep(30)")
    args.process_timeout = 0.5
    row = {"setup_s": {}, "rel_err": {}}
    bench._warm_process(row, model, feed, {}, want, args)
    assert "--process-timeout 0.5 s" in row["warm_process_error"], row
    row["model"], row["batch"], row["ms"] = "m", 1, {}
    row["setup_s"]["fusegraph"] = row["setup_s"]["fusegraph-ready"] = 1.5
    assert "new process: the new process ran past" in bench._setup_text(row)


class Pending:
    """A session whose background evaluation ends after ``polls`` waits (never: None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.calls = polls, []

    def wait_for_evaluation(self, timeout: float | None = None) -> bool:
        self.calls.append(timeout)
        return self.polls is not None and len(self.calls) > self.polls


def test_ready_waits_for_a_pending_evaluation(bench: ModuleType) -> None:
    """Nothing pending: ready at once, the first run's plan is the one timed. Pending: ready
    once ``wait_for_evaluation`` returns (with the given timeout), the caller reruns for the
    upgraded plan's agreement. Still pending at the timeout: no ready number, the row says so."""
    for polls, pending, ready in ((0, False, True), (1, True, True), (None, True, False)):
        row: dict[str, Any] = {"setup_s": {}}
        sess = Pending(polls)
        assert bench._wait_ready(row, "fusegraph", sess, 0.0, 7.0) is pending
        assert row["fusegraph_pending"] is pending
        assert ("fusegraph-ready" in row["setup_s"]) is ready, row
        assert ("fusegraph_ready_error" in row) is not ready, row
        assert sess.calls == ([0] if not pending else [0, 7.0])


def test_the_printed_setup_line(bench: ModuleType) -> None:
    """The line's form (issue 24): first, ready, warm in this process and in a new one; a warm
    session that was still evaluating shows its own ready time."""
    row: dict[str, Any] = {"setup_s": {"fusegraph": 4.1, "fusegraph-ready": 9.0, "fusegraph-warm": 0.9,
                                       "fusegraph-warm-ready": 0.9, "fusegraph-warm-process": 2.8,
                                       "fusegraph-warm-process-ready": 2.8}}
    assert bench._setup_text(row) == "  fusegraph setup 4.1 s (ready 9.0 s; warm 0.9 s, new process 2.8 s)"
    row["fusegraph-warm-process_pending"] = True
    row["setup_s"]["fusegraph-warm-process-ready"] = 5.0
    assert bench._setup_text(row).endswith("new process 2.8 s [ready 5.0 s])")
    assert bench._setup_text({"setup_s": {"eager": 0.1}}) == ""
    cuda_only = {"setup_s": {"fusegraph-cuda": 3.0}, "fusegraph-cuda_ready_error": "still evaluating"}
    assert bench._setup_text(cuda_only) == "  fusegraph setup 3.0 s (ready: not yet)"


@pytest.mark.gpu
def test_the_gpu_run_reports_ready_and_a_new_process(bench: ModuleType, tmp_path: Path, rng: np.random.Generator,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """On cuda:0 (the conv net, batch 1, NumPy and io_binding sessions, the provider's default
    options): every setup column positive, the new process's CUDA context timed apart, the
    outputs within 1e-3 of eager PyTorch (fp32)."""
    seed = str(int(rng.integers(1 << 31)))
    data, _ = _row(bench, ["--models", "convnet", "--batch", "1", "--variants", "fusegraph,fusegraph-cuda,eager",
                           "--rounds", "5", "--warmup-s", "0.2", "--warm-setup", "--seed", seed], tmp_path, capsys)
    row = data["rows"][0]
    assert "error" not in row and "warm_process_error" not in row, row
    for col in ("fusegraph", "fusegraph-ready", "fusegraph-cuda", "fusegraph-cuda-ready", "fusegraph-warm",
                "fusegraph-warm-ready", "fusegraph-warm-process", "fusegraph-warm-process-ready"):
        assert _positive(row["setup_s"].get(col)), (col, row["setup_s"])
    assert _positive(row["warm_process"]["cuda_init_s"]), row["warm_process"]
    for variant in ("fusegraph", "fusegraph-cuda", "fusegraph-warm-process"):
        assert row["rel_err"][variant] < 1e-3, (variant, row["rel_err"])

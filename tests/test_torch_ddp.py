"""``torch.compile(backend="fusegraph")`` under PyTorch's own DDP and FSDP2 (issue 23 item 4),
through benchmarks/bench_torch_ddp.py in two processes: the floor-on backend's losses must
be eager's (the script exits non-zero otherwise, and any rank that raises fails the
launch). On two GPUs this is where the step check once took the compiled piece's first call,
which DDP's graph split reads for fake outputs, and rank 1 then crashed (fixed in
step_floor.why_not; the check now waits for real calls there: ddp_split.py); on the
CPU the same path runs with gloo, split in two by --quick's small buckets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from fusegraph.torch import loop_trial  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_torch_ddp.py"


def _launch(args: list[str], cache: Path, timeout: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    return proc.stdout


def _step_verdicts(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    from fusegraph.regions.verdicts import VerdictStore
    from fusegraph.torch import step_floor

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(cache))
    path = VerdictStore().path
    table = json.loads(path.read_text()) if path.exists() else {}
    return [v for v in table.values() if v.get("engine") == step_floor.ENGINE and v.get("source") == "measured"]


@pytest.mark.parametrize(("fsdp", "accumulate"), [(False, 1), (True, 1), (False, 2)],
                         ids=["ddp", "fsdp2", "ddp-accumulate"])
def test_two_cpu_processes_track_eager(fsdp: bool, accumulate: int, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the DDP split's pieces are checked alone at the first step, then chosen together on the
    # loop's steps from the second (its first period not kept): 5 rounds of each choice at
    # least, up to loop_trial.SAMPLES_MAX (20) where the sign test does not separate them,
    # three choices at most, so 64 steps hold the longest trial; with gradient accumulation
    # (no_sync but for the last micro-batch) a step is an optimizer step. FSDP2 stores nothing
    # this test reads: 20 steps
    steps = 20 if fsdp else 3 * loop_trial.SAMPLES_MAX + 4
    args = ["--cpu", "--quick", "--steps", str(steps), "--variants", "eager,fusegraph-floor", "--accumulate",
            str(accumulate), *(["--fsdp"] if fsdp else [])]
    out = _launch(args, tmp_path, 600)
    assert "fusegraph-floor losses" in out, out
    if not fsdp:
        # --quick's small buckets split the graph in two: each piece was timed alone at its
        # first real call, then both on the loop's steps (ddp_split.py), and their verdicts
        # stored; run again, both are read
        verdicts = _step_verdicts(tmp_path, monkeypatch)
        assert len(verdicts) >= 2, verdicts
        out = _launch(args, tmp_path, 600)
        assert "fusegraph-floor losses" in out, out
        assert _step_verdicts(tmp_path, monkeypatch) == verdicts  # read, not timed again


@pytest.mark.gpu
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_gpus_track_eager(fsdp: bool, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, this machine has {torch.cuda.device_count()}: run on nvidia-h100-x2")
    out = _launch(["--steps", "6", "--variants", "eager,inductor,fusegraph-floor", *(["--fsdp"] if fsdp else [])],
                  tmp_path, 900)
    assert "fusegraph-floor losses" in out, out

"""``torch.compile(backend="fusegraph")`` under PyTorch's own DDP and FSDP2 (issue 23 item 4),
through benchmarks/bench_torch_ddp.py in two processes: the floor-on backend's five losses
must be eager's (the script exits non-zero otherwise, and any rank that raises fails the
launch). On two GPUs this is where the step check once took the compiled piece's first call,
which DDP's graph split reads for fake outputs, and rank 1 then crashed (fixed in
step_floor.why_not); on the CPU the same path runs with gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_torch_ddp.py"


def _launch(args: list[str], cache: Path, timeout: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    return proc.stdout


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_cpu_processes_track_eager(fsdp: bool, tmp_path: Path) -> None:
    out = _launch(["--cpu", "--quick", "--variants", "eager,fusegraph-floor", *(["--fsdp"] if fsdp else [])],
                  tmp_path, 600)
    assert "fusegraph-floor losses" in out, out


@pytest.mark.gpu
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_gpus_track_eager(fsdp: bool, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, this machine has {torch.cuda.device_count()}: run on nvidia-h100-x2")
    out = _launch(["--steps", "6", "--variants", "eager,inductor,fusegraph-floor", *(["--fsdp"] if fsdp else [])],
                  tmp_path, 900)
    assert "fusegraph-floor losses" in out, out

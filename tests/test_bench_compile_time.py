"""benchmarks/bench_compile_time.py on the CPU: each run a new process, as a script run
again and again would be. The fusegraph chain's second run compiles from the verdict its
first stored, once that run's loop (20 steps, on which the backend may weigh close sides)
decided, so no first pass (fusegraph's trace and region floor) runs in it; the JSON keeps
every run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the compile-time benchmark needs torch")

from fusegraph.torch.phases import FIRST_PASS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_second_run_compiles_from_the_stored_verdict(tmp_path: Path) -> None:
    # 45 steps: a loop trial of two sides may take 4x loop_steps rounds before it decides and
    # stores (loop_trial.SAMPLES_MAX), two steps a round
    out = tmp_path / "ct.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_compile_time.py"), "--device", "cpu",
                           "--models", "convnet", "--runs", "2", "--chains", "fusegraph", "--steps", "45",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]["convnet"]["fusegraph"]
    assert len(runs) == 2
    assert all(r["seconds"] > 0 and math.isfinite(r["loss"]) for r in runs)
    assert FIRST_PASS in runs[0]["phases"], runs[0]  # the first run explores
    assert FIRST_PASS not in runs[1]["phases"], runs[1]

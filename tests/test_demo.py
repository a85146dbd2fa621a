"""`fusegraph demo` (the README's first command) runs end to end in a fresh process."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def _check(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "OK" in out.stdout.splitlines()[-1]
    m = re.search(r"relative ([0-9.e+-]+), max abs", out.stdout)
    assert m is not None, out.stdout
    assert float(m.group(1)) <= 1e-2  # f16 output against an independent float64 computation


def test_demo_on_the_reference_engine_exits_zero() -> None:
    _check(_run([sys.executable, "-m", "fusegraph.cli", "demo", "--engine", "reference"]))


def test_demo_with_default_engine_through_the_console_script() -> None:
    exe = shutil.which("fusegraph")
    if exe is None:
        pytest.skip("the `fusegraph` console script is not on PATH (run `pip install -e .`)")
    _check(_run([exe, "demo"]))

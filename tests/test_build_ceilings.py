"""Bounded builds by default (issue 16, item 3): an IREE compile runs as a child under a
memory and time ceiling unless the user opts out, and what the child does is reported
truthfully -- a crash is a crash (not "out of memory"), a memory ceiling names the peak, a
time ceiling the time -- while the calling process lives on. Stand-in compilers (small
Python scripts in place of iree-compile) make each case deterministic and fast; the real
compiler's ceilings are tested in tests/test_contract_bounded_build.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fusegraph.engines.iree import compile as ic
from fusegraph.runtime.bounded import DEFAULT_MEMORY_CAP

MLIR = "module {}\n"


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """iree-compile replaced by a script running ``body`` (argv as iree-compile gets it)."""
    script = tmp_path / "fake-iree-compile"
    script.write_text(f"#!{sys.executable}\nimport os, sys, time, signal\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(ic, "iree_compile_path", lambda: script)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ic.LIMITS_ENV, raising=False)
    monkeypatch.delenv(ic.COMPILER_ENV, raising=False)


def test_default_is_a_bounded_child() -> None:
    backend, limits = ic.plan_compile()
    assert backend == "cli" and limits == ic.default_limits()
    assert limits.memory_bytes is not None and 1 << 30 <= limits.memory_bytes <= DEFAULT_MEMORY_CAP
    assert limits.seconds == ic.DEFAULT_SECONDS


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({ic.COMPILER_ENV: "inprocess"}, ("inprocess", None)),
        ({ic.LIMITS_ENV: "off"}, ("inprocess", None)),
        ({ic.LIMITS_ENV: "off", ic.COMPILER_ENV: "cli"}, ("cli", None)),
        ({ic.LIMITS_ENV: "512,30"}, ("cli", ic.CompileLimits(512 << 20, 30.0))),
        ({ic.LIMITS_ENV: "512,"}, ("cli", ic.CompileLimits(512 << 20, ic.DEFAULT_SECONDS))),
        ({ic.LIMITS_ENV: ",30", ic.COMPILER_ENV: "inprocess"}, ("cli", "default-memory,30")),
        ({ic.LIMITS_ENV: "lots"}, ("cli", "default")),
        ({ic.LIMITS_ENV: "-5,0"}, ("cli", "default")),
    ],
)
def test_what_the_environment_asks_for(env: dict[str, str], want: tuple[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    backend, limits = ic.plan_compile()
    d = ic.default_limits()
    expected = {"default": d, "default-memory,30": ic.CompileLimits(d.memory_bytes, 30.0)}.get(str(want[1]), want[1])
    assert (backend, limits) == (want[0], expected)


def test_explicit_backend_wins_over_the_default() -> None:
    assert ic.plan_compile("inprocess") == ("inprocess", None)
    assert ic.plan_compile("cli") == ("cli", ic.default_limits())
    tight = ic.CompileLimits(64 << 20, 5.0)
    assert ic.plan_compile("inprocess", tight) == ("cli", tight)


def test_a_crash_is_reported_as_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "sys.stderr.write('Stack dump: ... memref.alloc ... mmap\\n'); os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(ic.IreeCompileFailure) as info:
        ic.compile_mlir(MLIR, [])
    assert not isinstance(info.value, ic.IreeCompileLimitExceeded), str(info.value)
    assert "crashed (SIGSEGV)" in str(info.value) and "memref.alloc" in info.value.diagnostic


def test_a_diagnostic_mentioning_alloc_is_not_a_memory_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "sys.stderr.write('error: failed to legalize memref.alloc; LLVM ERROR: bad\\n'); sys.exit(1)")
    with pytest.raises(ic.IreeCompileFailure) as info:
        ic.compile_mlir(MLIR, [])
    assert not isinstance(info.value, ic.IreeCompileLimitExceeded)
    assert "exited with status 1" in str(info.value)


def test_memory_ceiling_stops_the_child_and_names_its_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # touches 40 MiB a step, forever: the resident-memory watch must stop it
    _fake(tmp_path, monkeypatch, "keep = []\nwhile True:\n    keep.append(bytearray(40 << 20))\n    time.sleep(0.02)")
    with pytest.raises(ic.IreeCompileLimitExceeded) as info:
        ic.compile_mlir(MLIR, [], limits=ic.CompileLimits(memory_bytes=200 << 20, seconds=60))
    msg = str(info.value)
    assert "memory ceiling (memory 200 MiB, time 60 s)" in msg and "MiB resident" in msg
    peak = int(msg.split("reached ")[1].split(" MiB")[0])
    assert 200 <= peak < 1200, msg  # stopped at or past the ceiling (the message rounds to whole MiB)


def test_time_ceiling_stops_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "time.sleep(60)")
    with pytest.raises(ic.IreeCompileLimitExceeded, match="time ceiling"):
        ic.compile_mlir(MLIR, [], limits=ic.CompileLimits(seconds=0.5))


def test_address_space_backstop_reads_as_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "sys.stderr.write('LLVM ERROR: out of memory\\nAllocation failed\\n'); os.abort()")
    with pytest.raises(ic.IreeCompileLimitExceeded, match="ran out of address space"):
        ic.compile_mlir(MLIR, [], limits=ic.CompileLimits(memory_bytes=1 << 30))


def test_a_bounded_compile_that_succeeds_returns_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "out = sys.argv[sys.argv.index('-o') + 1]\nopen(out, 'wb').write(b'VMFB' * 300)")
    r = ic.compile_mlir(MLIR, [])
    assert r.backend == "cli" and r.vmfb == b"VMFB" * 300
    assert os.environ.get(ic.LIMITS_ENV) is None


# ---- the runaway of issue 16: a data-tiled bf16 matmul whose result is sliced -------------------
def _runaway_graph() -> object:
    import fusegraph as fg

    dt = fg.DataType
    g = fg.Graph("i8_bf16_matmul_slice", io_data_type=dt.BFLOAT16, intermediate_data_type=dt.BFLOAT16,
                 compute_data_type=dt.FLOAT)
    a = g.identity(g.tensor("a", [16, 32, 128], data_type=dt.INT8))
    a.set_data_type(dt.BFLOAT16)
    c = g.matmul(a, g.tensor("b", [16, 128, 64]))
    c.set_dim([16, 32, 64])
    g.slice(c, [0], [32], axes=[2]).set_name("c").set_output(True)
    return g.validate()


def test_the_runaway_graph_compiles_without_data_tiling_whatever_the_ukernels(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """With data tiling this graph compiled for 117-273 s (default ukernels) or grew past 6 GiB
    (ukernels='none'); without, ~1 s. The engine turns data tiling off for it unless pinned."""
    import fusegraph as fg
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.iree import IreeEngine

    monkeypatch.setenv(ic.LIMITS_ENV, "3072,120")  # should the fix regress: a typed refusal, not a hang
    g = _runaway_graph()
    plan = IreeEngine().build(g, fg.Handle("cpu"), EngineConfig("iree", (("ukernels", "none"),)))
    assert plan.config.get("data_tiling") is False
    a = rng.integers(-5, 6, (16, 32, 128)).astype(np.int8)
    b = rng.standard_normal((16, 128, 64)).astype(fg.DataType.BFLOAT16.numpy)
    out = np.asarray(plan.execute({"a": a, "b": b})["c"], np.float64)
    ref = (a.astype(np.float64) @ b.astype(np.float64))[..., :32]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2
    with pytest.raises(fg.UnsupportedError, match="data_tiling"):
        IreeEngine().build(g, fg.Handle("cpu"), EngineConfig("iree", (("data_tiling", True), ("ukernels", "none"))))


# ---- probes are bounded too -------------------------------------------------------------------
def test_a_run_past_its_memory_ceiling_is_stopped_with_its_peak() -> None:
    from fusegraph.runtime.bounded import run_bounded

    grow = "import time\nkeep = []\nwhile True:\n    keep.append(bytearray(40 << 20)); time.sleep(0.02)"
    r = run_bounded([sys.executable, "-c", grow], memory_bytes=150 << 20, seconds=60)
    assert r.stopped == "memory" and r.peak_rss_bytes > 150 << 20 and r.returncode != 0
    r = run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], seconds=0.3)
    assert r.stopped == "time"
    r = run_bounded([sys.executable, "-c", "print('fine')"], memory_bytes=1 << 30, seconds=60)
    assert (r.stopped, r.returncode, r.stdout.strip()) == (None, 0, "fine")


def test_the_onednn_graph_probe_runs_under_a_memory_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import fusegraph as fg
    from fusegraph.engines.torch import onednn_graph as ong
    from fusegraph.runtime import bounded

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bounded, "default_memory_ceiling", lambda: 40 << 20)  # a Python with torch is larger
    g = fg.Graph("probe_me", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [1, 4, 8, 8], fg.strides_for([1, 4, 8, 8], "NHWC"))
    w = g.tensor("w", [4, 4, 3, 3], fg.strides_for([4, 4, 3, 3], "KRSC"))
    g.relu(g.conv_fprop(x, w, padding=[1, 1])).set_name("y").set_output(True)
    g.validate()
    why = ong.probe(g, ["w"], ())
    assert "memory ceiling (40 MiB resident)" in why, why

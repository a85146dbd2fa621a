"""The IREE engine's module cache: hit, miss, corruption, disabled, fresh process, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.iree import IreeEngine
from fusegraph.engines.iree.cache import (
    CacheCorruptionWarning,
    ModuleCache,
    cache_root,
    clear_memory,
)
from fusegraph.engines.iree.targets import TARGETS
from fusegraph.reference.executor import run_reference

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(d))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.delenv("FUSEGRAPH_IREE_COMPILER", raising=False)
    clear_memory()
    return d


def small_graph(scale_name: str = "g", n: int = 16) -> fg.Graph:
    g = fg.Graph(scale_name, io_data_type="float")
    a, b = g.tensor("a", [4, n]), g.tensor("b", [4, n])
    g.tanh(g.mul(g.add(a, b), b)).set_output(True).set_name("y")
    return g.validate()


def check_runs(plan: fg.engines.base.ExecutionPlan, g: fg.Graph, rng: np.random.Generator) -> None:
    ins = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in g.inputs()}
    out = plan.execute(ins)["y"]
    ref = run_reference(g, ins)["y"]
    assert not np.isnan(out).any()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_default_root_is_the_platform_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import platformdirs

    monkeypatch.delenv("FUSEGRAPH_CACHE_DIR")
    assert cache_root() == Path(platformdirs.user_cache_dir("fusegraph"))


def test_miss_then_memory_hit_then_disk_hit(cache_dir: Path, rng: np.random.Generator) -> None:
    e, h, g = IreeEngine(), fg.Handle("cpu"), small_graph()
    p1 = e.build(g, h)
    assert p1.entry.source == "compiled"
    assert p1.entry.path is not None and p1.entry.path.is_relative_to(cache_dir)
    files = {p.name for p in p1.entry.path.iterdir()}
    assert {"module.vmfb", "module.mlir", "flags.txt", "command.sh", "stats.json", "graph.json", "manifest.json"} <= files
    p2 = e.build(small_graph(), h)  # an equal graph, built anew
    assert p2.entry.source == "memory" and p2.key == p1.key
    clear_memory()
    p3 = e.build(small_graph(), h)
    assert p3.entry.source == "disk" and p3.key == p1.key
    check_runs(p3, g, rng)


def test_key_covers_flags_target_and_emitter() -> None:
    e, g = IreeEngine(), small_graph()
    cpu = TARGETS["cpu"]
    f1 = ("--a",)
    k = e.cache_key(g, cpu, f1, None)
    assert k == e.cache_key(small_graph(), cpu, f1, None)
    assert k != e.cache_key(g, cpu, ("--b",), None)
    assert k != e.cache_key(g, TARGETS["cuda"], f1, None)
    assert k != e.cache_key(small_graph(n=32), cpu, f1, None)

    def other(graph: fg.Graph, func_name: str = "main", options: object = None) -> None:
        raise AssertionError("not called")

    other.version = "v2"  # type: ignore[attr-defined]
    assert k != IreeEngine(emitter=other).cache_key(g, cpu, f1, None)
    p1 = e.build(g, fg.Handle("cpu"))
    p2 = e.build(g, fg.Handle("cpu"), EngineConfig("iree", (("opt_level", "O1"),)))
    assert p1.key != p2.key and p2.entry.source == "compiled"


@pytest.mark.parametrize("damage", ["truncate_vmfb", "flip_vmfb", "bad_manifest", "missing_vmfb"])
def test_corrupt_entry_is_detected_rebuilt_and_warned(damage: str, rng: np.random.Generator) -> None:
    e, h, g = IreeEngine(), fg.Handle("cpu"), small_graph()
    entry = e.build(g, h).entry
    assert entry.path is not None
    vmfb = entry.path / "module.vmfb"
    if damage == "truncate_vmfb":
        vmfb.write_bytes(vmfb.read_bytes()[: vmfb.stat().st_size // 2])
    elif damage == "flip_vmfb":
        data = bytearray(vmfb.read_bytes())
        data[len(data) // 2] ^= 0xFF
        vmfb.write_bytes(bytes(data))
    elif damage == "bad_manifest":
        (entry.path / "manifest.json").write_text('{"schema": 1, "key": "')
    else:
        vmfb.unlink()
    clear_memory()
    with pytest.warns(CacheCorruptionWarning, match="corrupt"):
        again = e.build(small_graph(), h)
    assert again.entry.source == "compiled" and again.key == entry.key
    assert ModuleCache().verify(entry.key) is None  # rebuilt sound
    check_runs(again, g, rng)


def test_disabled_cache_compiles_every_time_and_writes_nothing(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")
    e, h, g = IreeEngine(), fg.Handle("cpu"), small_graph()
    p1 = e.build(g, h)
    p2 = e.build(g, h)
    assert p1.entry.source == p2.entry.source == "compiled"
    assert p1.entry.path is None
    assert not (cache_dir / "iree").exists()
    check_runs(p2, g, rng)


SCRIPT = """
import json, sys
import fusegraph as fg
from fusegraph.engines.iree import IreeEngine
g = fg.Graph("g", io_data_type="float")
a, b = g.tensor("a", [4, 16]), g.tensor("b", [4, 16])
g.tanh(g.mul(g.add(a, b), b)).set_output(True).set_name("y")
g.validate()
p = IreeEngine().build(g, fg.Handle("cpu"))
print(json.dumps({"source": p.entry.source, "key": p.key, "dispatches": p.dispatch_count}))
"""


def test_fresh_process_is_served_from_disk(cache_dir: Path) -> None:
    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "leaked" not in proc.stderr and "Segmentation" not in proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["source"] == "compiled" and runs[1]["source"] == "disk"
    assert runs[0]["key"] == runs[1]["key"] and runs[1]["dispatches"] == 1


def test_command_sh_reproduces_the_entry(rng: np.random.Generator) -> None:
    entry = IreeEngine().build(small_graph(), fg.Handle("cpu")).entry
    assert entry.path is not None
    cmd = (entry.path / "command.sh").read_text()
    assert "iree-compile" in cmd and "--iree-input-type=torch" in cmd
    proc = subprocess.run(["sh", str(entry.path / "command.sh")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((entry.path / "repro-stats.json").read_text())
    assert stats["stream-aggregate"]["execution"]["dispatch-count"] == entry.dispatch_count
    assert (entry.path / "repro.vmfb").stat().st_size > 1000
    assert ModuleCache().verify(entry.key) is None  # the extra files do not disturb the entry


def test_concurrent_puts_leave_one_sound_entry() -> None:
    cache = ModuleCache()
    key = "ab" * 32
    payloads = [bytes([i]) * 5000 for i in range(6)]
    errors: list[BaseException] = []

    def put(data: bytes) -> None:
        try:
            cache.put(key, data, {"module.mlir": "x"}, {"n": data[0]})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.verify(key) is None
    clear_memory()
    got = cache.get(key)
    assert got is not None and got.vmfb in payloads and got.meta["n"] == got.vmfb[0]
    leftovers = [p.name for p in cache.entry_dir(key).parent.iterdir() if p.name != key]
    assert leftovers == []


def test_cache_cli_info_list_clear(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusegraph.cli import main

    IreeEngine().build(small_graph(), fg.Handle("cpu"))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out and "entries         : 1" in out
    assert main(["cache", "list", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and " g " in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert "no entries" in capsys.readouterr().out


def test_no_warning_on_a_clean_hit() -> None:
    e, h = IreeEngine(), fg.Handle("cpu")
    e.build(small_graph(), h)
    clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert e.build(small_graph(), h).entry.source == "disk"

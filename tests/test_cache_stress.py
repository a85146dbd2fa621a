"""Caches under stress: many processes on one cache directory, processes killed mid-write,
unusable locations, the size limit.

The module cache is driven by a fake compiler (a sleep, then a put) where the point is the
locking, so that 16 processes cost seconds; one test runs real IREE compiles. The tuning
database and the JSON tables of runtime/cache_dir.py get the same treatment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from fusegraph.engines.iree import cache as cache_mod
from fusegraph.engines.iree.cache import CacheEntry, ModuleCache
from fusegraph.runtime import cache_dir, cache_limit
from fusegraph.runtime.cache_dir import (
    CacheUnavailableWarning,
    read_table,
    update_table,
    write_table,
)

PROCS = 16
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}


def _spawn(code: str, args: list[str], n: int = PROCS, timeout: float = 180) -> list[str]:
    """Runs ``code`` in ``n`` processes at once (they start together on a go file); returns
    each one's stdout. Every process must exit 0."""
    go = Path(args[0]) / f".go-{time.monotonic_ns()}"
    prelude = textwrap.dedent(f"""
        import os, sys, time
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), str(i), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for i in range(n)
    ]
    time.sleep(0.5)
    go.write_text("go")
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"process failed (rc {p.returncode}):\n{err[-3000:]}"
        outs.append(out)
    go.unlink()
    return outs


# ---- the module cache: one compile per key across processes ------------------------------
FAKE_COMPILE = """
    import hashlib, json
    from pathlib import Path
    from fusegraph.engines.iree.cache import ModuleCache
    me, root = int(sys.argv[1]), Path(sys.argv[2])
    cache = ModuleCache(root, enabled=True)
    keys = ["same" * 16, f"{me:064x}", f"{me % 4:063x}f"]  # one key for all, one own, one of 4 shared

    def build(key):
        def compile_it():
            with open(root / "compiles.log", "a") as log:  # O_APPEND: whole lines
                log.write(key + "\\n")
            time.sleep(0.2)  # a compile takes time: the others must wait, not compile too
            vmfb = hashlib.sha256(key.encode()).digest() * 4096
            return cache.put(key, vmfb, {"module.mlir": "// " + key}, {"graph_name": key[:8]})
        return compile_it

    got = {}
    for k in keys:
        e = cache.compile_once(k, build(k))
        assert e.vmfb == hashlib.sha256(k.encode()).digest() * 4096, "wrong module for " + k
        got[k] = e.source
    print(json.dumps(got))
"""


def test_16_processes_compile_each_key_once(tmp_path: Path) -> None:
    outs = _spawn(FAKE_COMPILE, [str(tmp_path)])
    compiles = (tmp_path / "compiles.log").read_text().split()
    keys = {"same" * 16, *(f"{i:064x}" for i in range(PROCS)), *(f"{i:063x}f" for i in range(4))}
    assert sorted(compiles) == sorted(keys), "some key was compiled more than once (or never)"
    cache = ModuleCache(tmp_path, enabled=True)
    for k in keys:
        assert cache.verify(k) is None, f"entry {k[:12]} is corrupt"
    sources = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert sum(s["same" * 16] == "compiled" for s in sources) == 1
    assert not list(tmp_path.glob("iree/*/.tmp-*")), "temporary directories left behind"


def test_real_iree_compiles_once_for_4_processes(tmp_path: Path) -> None:
    """Real IREE compiles: 4 processes build the same graph (and one graph each) at once."""
    code = """
        import json
        import numpy as np
        import fusegraph as fg
        from fusegraph.engines.registry import REGISTRY
        from fusegraph.runtime.handle import default_handle
        me = int(sys.argv[1])
        out = {}
        for name, scale in (("shared", 2.0), (f"own{me}", 3.0 + me)):
            g = fg.Graph(name=name, io_data_type=fg.DataType.FLOAT)
            x = g.tensor("x", [4, 8])
            g.mul(g.tanh(x), g.scalar(scale)).set_name("y").set_output(True)
            g.validate()
            plan = REGISTRY.get("iree").build(g, default_handle())
            a = np.random.default_rng(me).standard_normal((4, 8)).astype(np.float32)
            y = plan.execute({"x": a})["y"]
            assert np.allclose(y, np.tanh(a) * scale, rtol=1e-5, atol=1e-6), name
            out[name] = plan.entry.source
        print(json.dumps(out))
    """
    env_backup = dict(ENV)
    ENV["FUSEGRAPH_CACHE_DIR"] = str(tmp_path)
    ENV.pop("FUSEGRAPH_CACHE", None)
    try:
        outs = _spawn(code, [str(tmp_path)], n=4, timeout=300)
    finally:
        ENV.clear()
        ENV.update(env_backup)
    sources = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert [s["shared"] for s in sources].count("compiled") == 1, sources
    assert all(s[f"own{i}"] == "compiled" for i, s in enumerate(sources))
    cache = ModuleCache(tmp_path, enabled=True)
    entries = cache.list_entries()
    assert len(entries) == 5 and all(cache.verify(e["key"]) is None for e in entries)


# ---- killed mid-write ----------------------------------------------------------------------
KILLED_PUT = """
    import os, signal, sys
    from pathlib import Path
    from fusegraph.engines.iree import cache as c
    root = Path(sys.argv[2])
    real = c._write_synced

    def half_then_die(path, data):
        if path.name == c.VMFB:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    c._write_synced = half_then_die
    c.ModuleCache(root, enabled=True).put("k" * 64, b"x" * 100000, {"module.mlir": "m"}, {})
"""


def test_a_process_killed_mid_write_leaves_nothing_that_loads(tmp_path: Path) -> None:
    go = tmp_path / "x"
    go.mkdir()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_PUT), "0", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    cache = ModuleCache(tmp_path, enabled=True)
    assert list(tmp_path.glob("iree/*/.tmp-*")), "the writer should have died inside its temp dir"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no corruption warning either: the entry simply is not there
        assert cache.get("k" * 64) is None
    assert cache.list_entries() == []
    # the next writer installs a sound entry; old temp dirs are swept
    e = cache.put("k" * 64, b"y" * 1000, {}, {})
    assert e.path is not None and cache.verify("k" * 64) is None
    cache_mod._MEMORY.clear()
    got = cache.get("k" * 64)
    assert got is not None and got.vmfb == b"y" * 1000
    old = time.time() - 2 * cache_mod.STALE_TMP_S
    for d in tmp_path.glob("iree/*/.tmp-*"):
        os.utime(d, (old, old))
    cache.evict()
    assert not list(tmp_path.glob("iree/*/.tmp-*"))


KILLED_TABLE = """
    import os, signal, sys
    from pathlib import Path
    from fusegraph.runtime import cache_dir as cd
    path = Path(sys.argv[2]) / "table.json"

    def half_then_die(p, data):
        with open(p.with_name(".partial"), "wb") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    cd.atomic_write_bytes = half_then_die
    cd.update_table(path, lambda t: t.update({"new": 1}))
"""


def test_a_table_writer_killed_mid_write_leaves_the_old_table(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    write_table(path, {"old": {"v": 1}})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_TABLE), "0", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert read_table(path) == {"old": {"v": 1}}
    update_table(path, lambda t: t.update({"after": 2}))  # the lock died with its holder
    assert read_table(path) == {"old": {"v": 1}, "after": 2}


def test_torn_or_foreign_table_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"a": 1, "b": ')
    assert read_table(path) == {}
    path.write_text("[1, 2]")
    assert read_table(path) == {}
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert read_table(path) == {}


# ---- tables and the tuning database under 16 writers -----------------------------------------
TABLE_WRITERS = """
    from pathlib import Path
    from fusegraph.runtime.cache_dir import update_table
    me, path = int(sys.argv[1]), Path(sys.argv[2]) / "table.json"
    for j in range(5):
        update_table(path, lambda t: t.update({f"p{me}-{j}": me}))
"""


def test_16_processes_update_one_table_without_losing_entries(tmp_path: Path) -> None:
    _spawn(TABLE_WRITERS, [str(tmp_path)])
    table = read_table(tmp_path / "table.json")
    assert table == {f"p{i}-{j}": i for i in range(PROCS) for j in range(5)}


TUNING_WRITERS = """
    from pathlib import Path
    from fusegraph.engines.base import EngineConfig
    from fusegraph.select.tuning_db import Measurement, TuningDB, TuningEntry
    me, path = int(sys.argv[1]), Path(sys.argv[2]) / "tuning" / "tuning.json"
    db = TuningDB(path)
    for j in range(3):
        cfg = EngineConfig("reference")
        db.put(TuningEntry(f"{me:02d}{j}" + "0" * 61, f"g{me}", "cpu", {"fusegraph": "x"}, cfg,
                           [Measurement(cfg, "ok", median_ms=1.0 + me, runs=3)]))
"""


def test_16_processes_write_the_tuning_db_without_losing_entries(tmp_path: Path) -> None:
    from fusegraph.select.tuning_db import TuningDB

    _spawn(TUNING_WRITERS, [str(tmp_path)])
    db = TuningDB(tmp_path / "tuning" / "tuning.json")
    keys = sorted(e.graph_key[:3] for e in db.entries())
    assert keys == sorted(f"{i:02d}{j}" for i in range(PROCS) for j in range(3))
    assert not list((tmp_path / "tuning").glob(".tuning*")), "temporary files left behind"


CHOICE_WRITERS = """
    from fusegraph.engines.base import EngineConfig
    from fusegraph.onnx import choices
    me, root = int(sys.argv[1]), sys.argv[2]
    for j in range(3):
        cfg = EngineConfig("torch", (("compile", bool(j % 2)),))
        choices.record(root, f"g{me}-{j}", "cpu", choices.Choice(cfg, "NHWC", 1.0 + me + j))
"""


def test_16_processes_record_onnx_choices_without_losing_entries(tmp_path: Path) -> None:
    """The ONNX provider's remembered engine choices (onnx-choices.json) are written from
    sessions and background evaluations at once: none may lose another's entry."""
    from fusegraph.onnx import choices

    _spawn(CHOICE_WRITERS, [str(tmp_path)])
    for i in range(PROCS):
        for j in range(3):
            got = choices.lookup(str(tmp_path), f"g{i}-{j}", "cpu")
            assert got is not None, f"entry g{i}-{j} was lost"
            assert got.median_ms == 1.0 + i + j and got.config.knobs == (("compile", bool(j % 2)),)


# ---- unusable locations: uncached, one warning ---------------------------------------------------
def _unusable(kind: str, tmp_path: Path) -> Path:
    if kind == "file":
        p = tmp_path / "cache"
        p.write_text("I am a file")
        return p
    if kind == "proc":  # unwritable even for root (the tests may run as root)
        return Path("/proc/self/fusegraph-cache")
    raise AssertionError(kind)


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    cache_dir._WARNED.clear()


@pytest.mark.parametrize("kind", ["file", "proc"])
def test_unusable_module_cache_runs_uncached_with_one_warning(kind: str, tmp_path: Path) -> None:
    root = _unusable(kind, tmp_path)
    cache = ModuleCache(root, enabled=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        entries = [cache.compile_once(f"{i:064x}", lambda i=i: cache.put(f"{i:064x}", b"m%d" % i, {}, {}))
                   for i in range(3)]
        entries.append(cache.put("f" * 64, b"again", {}, {}))
    mine = [w for w in seen if issubclass(w.category, CacheUnavailableWarning)]
    assert len(mine) == 1, [str(w.message) for w in seen]
    assert str(root) in str(mine[0].message)
    assert [e.vmfb for e in entries] == [b"m0", b"m1", b"m2", b"again"]
    assert all(e.path is None for e in entries)


def test_full_disk_runs_uncached_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(cache_mod, "_write_synced", enospc)
    cache = ModuleCache(tmp_path, enabled=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        e1 = cache.put("a" * 64, b"one", {}, {})
        e2 = cache.put("b" * 64, b"two", {}, {})
    mine = [w for w in seen if issubclass(w.category, CacheUnavailableWarning)]
    assert len(mine) == 1 and "No space left" in str(mine[0].message)
    assert (e1.vmfb, e2.vmfb, e1.path, e2.path) == (b"one", b"two", None, None)
    assert not list(tmp_path.glob("iree/*/.tmp-*")) and cache.list_entries() == []


def test_iree_engine_with_a_file_as_cache_dir_runs_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    import fusegraph as fg

    root = _unusable("file", tmp_path)
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(root))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    cache_mod._MEMORY.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for scale in (1.5, 2.5):
            g = fg.Graph(name="unusable", io_data_type=fg.DataType.FLOAT)
            x = g.tensor("x", [3, 5])
            g.mul(g.sin(x), g.scalar(scale)).set_name("y").set_output(True)
            a = rng.standard_normal((3, 5)).astype(np.float32)
            y = g.validate().execute({"x": a}, engine="iree")["y"]
            np.testing.assert_allclose(y, np.sin(a) * scale, rtol=1e-5, atol=1e-6)
    mine = [w for w in seen if issubclass(w.category, CacheUnavailableWarning)]
    assert len(mine) == 1, [str(w.message) for w in seen]
    assert root.read_text() == "I am a file"


def test_unusable_tuning_db_warns_once_and_does_not_raise(tmp_path: Path) -> None:
    from fusegraph.engines.base import EngineConfig
    from fusegraph.select.tuning_db import TuningDB, TuningEntry

    db = TuningDB(_unusable("file", tmp_path) / "tuning" / "tuning.json")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(3):
            db.put(TuningEntry(f"{i}" * 64, "g", "cpu", {}, EngineConfig("reference")))
    assert len([w for w in seen if issubclass(w.category, CacheUnavailableWarning)]) == 1
    assert db.entries() == []


# ---- size limit, LRU ----------------------------------------------------------------------
def _put(cache: ModuleCache, key: str, size: int) -> CacheEntry:
    return cache.put(key, os.urandom(size), {}, {})


def test_size_limit_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = ModuleCache(tmp_path, enabled=True)
    cache.set_limit(1_000_000)
    keys = [f"{i:064x}" for i in range(5)]
    t0 = time.time() - 100
    for i, k in enumerate(keys[:4]):
        e = _put(cache, k, 200_000)
        assert e.path is not None
        os.utime(e.path, (t0 + i, t0 + i))  # 0 oldest ... 3 newest
    cache_mod._MEMORY.clear()
    assert cache.get(keys[0]) is not None  # used now: the most recent
    _put(cache, keys[4], 200_000)  # 5 x ~200 kB > 1 MB: one must go, the LRU one (1)
    on_disk = {e["key"] for e in cache.list_entries()}
    assert on_disk == {keys[0], keys[2], keys[3], keys[4]}, sorted(k[-1] for k in on_disk)
    assert sum(int(e["size"]) for e in cache.list_entries()) <= 1_000_000
    cache.set_limit(450_000)  # lowering the limit evicts at once
    assert {e["key"] for e in cache.list_entries()} == {keys[0], keys[4]}
    cache.set_limit(None)
    assert cache.limit() == cache_limit.DEFAULT_MAX_BYTES


def test_an_entry_larger_than_the_limit_is_kept_until_the_next_store(tmp_path: Path) -> None:
    """The entry just stored is never its own victim (it is about to be loaded)."""
    cache = ModuleCache(tmp_path, enabled=True)
    cache.set_limit(10_000)
    _put(cache, "a" * 64, 50_000)
    assert [e["key"] for e in cache.list_entries()] == ["a" * 64]
    _put(cache, "b" * 64, 50_000)
    assert [e["key"] for e in cache.list_entries()] == ["b" * 64]


def test_cache_limit_cli_shows_and_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from fusegraph.cli import main

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    assert main(["cache", "limit", "300K"]) == 0
    assert "0.31 MB" in capsys.readouterr().out
    assert ModuleCache(tmp_path).limit() == 300 * 1024
    assert main(["cache", "limit"]) == 0
    assert "size limit 0.31 MB" in capsys.readouterr().out
    assert main(["cache", "limit", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
    assert main(["cache", "limit", "nan"]) == 2
    assert main(["cache", "info"]) == 0
    assert "size limit" in capsys.readouterr().out
    assert main(["cache", "limit", "default"]) == 0
    assert ModuleCache(tmp_path).limit() == cache_limit.DEFAULT_MAX_BYTES

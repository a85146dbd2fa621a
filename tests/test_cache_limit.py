"""One size limit for every compiled artifact in the cache directory (runtime/cache_limit.py):
IREE entries, cuDNN plans, AOTInductor packages, tier modules and OpenVINO models, least
recently used out first, never the artifact just written; readers mark what they load."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fusegraph.runtime import cache_limit


@pytest.fixture()
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    return tmp_path


def _file(path: Path, size: int, age_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _iree_entry(root: Path, key: str, size: int, age_s: float) -> Path:
    d = root / "iree" / key[:2] / key
    _file(d / "module.vmfb", size, age_s)
    _file(d / "manifest.json", 0, age_s)
    t = time.time() - age_s
    os.utime(d, (t, t))
    return d


def _stores(root: Path) -> dict[str, Path]:
    return {
        "iree": _iree_entry(root, "ab" + "0" * 30, 1000, 500),
        "cudnn": _file(root / "cudnn" / "p.plan", 1000, 400),
        "torch-aoti": _file(root / "torch-aoti" / "m.pt2", 1000, 300),
        "onnx-tier": _file(root / "onnx-tier" / "r.vmfb", 1000, 200),
        "openvino": _file(root / "openvino" / "o.blob", 1000, 100),
        "onnx-specialized": _file(root / "onnx-specialized" / "k.fgspec", 1000, 50),
    }


def test_every_store_counts_and_the_oldest_go_first(root: Path) -> None:
    paths = _stores(root)
    _file(root / "cudnn" / ".plan-tmp123", 5000, 1000)  # a writer's temporary file: not an artifact
    _file(root / "tuning" / "db.json", 5000, 1000)  # a table: not an artifact
    assert cache_limit.usage(root) == {k: 1000 for k in paths}
    gone = cache_limit.set_limit(3500, root)
    assert gone == 3
    assert [k for k, p in paths.items() if p.exists()] == ["onnx-tier", "openvino", "onnx-specialized"]
    assert (root / "cudnn" / ".plan-tmp123").exists() and (root / "tuning" / "db.json").exists()
    assert cache_limit.limit(root) == 3500


def test_the_artifact_just_written_stays_even_alone_over_the_limit(root: Path) -> None:
    paths = _stores(root)
    cache_limit.set_limit(0, root)
    assert not any(p.exists() for p in paths.values())
    big = _file(root / "torch-aoti" / "new.pt2", 4000, 0)
    assert cache_limit.enforce(root, keep=[big]) == []
    assert big.exists()


def test_a_touched_artifact_outlives_older_ones(root: Path) -> None:
    paths = _stores(root)
    cache_limit.touch(paths["iree"])  # the oldest, just used
    cache_limit.set_limit(1500, root)
    assert [k for k, p in paths.items() if p.exists()] == ["iree"]


def test_cudnn_store_marks_loads_and_evicts_on_save(root: Path) -> None:
    from fusegraph.engines.cudnn import store

    old = _file(root / "torch-aoti" / "old.pt2", 3000, 300)
    store.save("k1", b"p" * 1000)
    time.sleep(0.01)
    cache_limit.set_limit(4500, root)  # everything fits: 4000 bytes
    assert old.exists()
    os.utime(root / "cudnn" / "k1.plan", (time.time() - 600, time.time() - 600))
    assert store.load("k1") == b"p" * 1000  # marked used now: old.pt2 is the least recent
    store.save("k2", b"q" * 1000)  # 5000 > 4500: one goes, the least recently used
    assert not old.exists()
    assert store.load("k1") is not None and store.load("k2") is not None


def test_cli_limit_reports_every_store(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusegraph.commands.cache import _limit

    _stores(root)

    class Args:
        size = "3K"
        yes = True  # below what the artifacts use: eviction confirmed, as `--yes` does

    assert _limit(Args()) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert cache_limit.limit(root) == 3072
    assert out.startswith("size limit 0.00 MB; compiled artifacts use 0.00 MB (onnx-tier 1000 B, openvino 1000 B, "
                          "onnx-specialized 1000 B)")

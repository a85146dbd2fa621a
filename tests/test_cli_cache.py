"""`fusegraph cache list|clear|info` cover every cache fusegraph writes (issue 16 item 5), with
sizes; clear removes only fusegraph's parts and keeps the size-limit setting and anything else
found in the directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import fusegraph
from fusegraph.cli import main
from fusegraph.commands.cache import PARTS, SETTINGS, part_usage

SRC = Path(fusegraph.__file__).parent


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fill(root: Path) -> None:
    for i, q in enumerate(PARTS):
        p = root / q.path
        if p.suffix == ".json":
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps({"k": "v" * (100 + i)}))
            (root / f".{p.name}.lock").write_text("")
        else:
            (p / "sub").mkdir(parents=True, exist_ok=True)
            (p / "sub" / "blob").write_bytes(b"x" * (1000 + i))
    (root / "limits.json").write_text('{"max_bytes": 12345}')
    (root / "someone-elses").mkdir()
    (root / "someone-elses" / "keep.txt").write_text("mine")


def test_every_cache_writer_in_the_source_is_a_listed_part() -> None:
    """A module that writes under cache_root() names a part (or a setting) of PARTS: a new cache
    added without teaching `fusegraph cache` about it fails here."""
    names = [q.path for q in PARTS] + list(SETTINGS)
    skip = {SRC / "runtime" / "cache_dir.py", SRC / "commands" / "cache.py"}
    writers = [p for p in SRC.rglob("*.py") if p not in skip and re.search(r"cache_root\(\)", p.read_text())]
    assert writers, "no module uses cache_root()?"
    for p in writers:
        text = p.read_text()
        assert any(f'"{n}"' in text for n in names), f"{p.relative_to(SRC)} writes under the cache directory but names no part of fusegraph.commands.cache.PARTS"
    assert "bench-models" in {q.path for q in PARTS}
    assert '"bench-models"' in (SRC.parent / "benchmarks" / "bench_models.py").read_text()


def test_part_paths_are_the_owners_constants() -> None:
    from fusegraph.engines.torch import frozen, onednn_graph
    from fusegraph.onnx import choices, floor, openvino_runner, torch_mlir_tier
    from fusegraph.runtime.cache_dir import cache_root
    from fusegraph.select import tuning_db

    paths = {q.name: q.path for q in PARTS}
    assert paths["onnx-choices"] == choices.FILE and paths["onnx-floor"] == floor.FILE
    assert paths["onednn-graph"] == onednn_graph.VERDICTS and paths["torch-aoti"] == frozen.PACKAGES
    assert tuning_db.default_path().parent == cache_root() / paths["tuning"]
    assert torch_mlir_tier._cache_root(None) == cache_root() / paths["onnx-tier"]
    assert paths["openvino"] == openvino_runner.CACHE_SUBDIR


def test_list_shows_every_part_with_its_size(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(root)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    for q in PARTS:
        line = next(ln for ln in out.splitlines() if ln.startswith(q.name + " "))
        assert " 0 B" not in line and re.search(r"\s1\s", line), line
    assert "someone-elses" in out and "never cleared" in out
    rows = {r["name"]: r for r in part_usage(root)}
    assert rows["iree"]["bytes"] == 1000 and rows["iree"]["files"] == 1
    assert main(["cache", "list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in data["parts"]} >= {q.name for q in PARTS}


def test_clear_removes_every_part_and_only_those(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(root)
    assert main(["cache", "clear", "--only", "tuning", "--only", "onnx-floor"]) == 0
    assert not (root / "tuning").exists() and not (root / "onnx-floor.json").exists()
    assert not (root / ".onnx-floor.json.lock").exists()
    assert (root / "iree").exists() and (root / "onednn-graph-verdicts.json").exists()
    capsys.readouterr()
    assert main(["cache", "clear", "--keep-failures"]) == 0
    out = capsys.readouterr().out
    assert "bench-models" in out and "in all from" in out
    left = sorted(p.name for p in root.iterdir())
    assert left == [".limits.json.lock", "failures", "limits.json", "someone-elses"] or left == [
        "failures", "limits.json", "someone-elses"], left
    assert main(["cache", "clear"]) == 0
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["limits.json", "someone-elses"]
    assert json.loads((root / "limits.json").read_text())["max_bytes"] == 12345
    assert (root / "someone-elses" / "keep.txt").read_text() == "mine"


def test_info_counts_everything(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(root)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    total = sum(r["bytes"] for r in part_usage(root) if r["name"] != "(other)")
    assert "everything" in out and total > 8000 and f"{len(PARTS)} files" in out
    with pytest.raises(SystemExit):  # argparse refuses a part that does not exist
        main(["cache", "clear", "--only", "nope"])


def test_only_the_cache_dir_module_asks_for_the_user_cache_directory() -> None:
    """Everything finds its place through runtime/cache_dir.cache_root (FUSEGRAPH_CACHE_DIR
    first, which the test suite points at a temporary directory): a module asking platformdirs
    itself wrote into the user's real cache even under pytest (the torch-mlir tier did)."""
    imports = re.compile(r"^\s*(import platformdirs|from platformdirs import)", re.MULTILINE)
    users = [p.relative_to(SRC) for p in SRC.rglob("*.py") if imports.search(p.read_text())]
    assert users == [Path("runtime/cache_dir.py")], users

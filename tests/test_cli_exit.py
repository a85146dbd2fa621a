"""The CLI's one exit-status convention (fusegraph/cli.py): 2 for a command line that cannot
be acted on as written, 1 for work that began and failed; `fusegraph cache limit` asks
before it evicts; `fusegraph run --compare ort` prints ONNX Runtime's latency beside
fusegraph's (issue 25 item 6)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusegraph.cli import exit_status, main
from fusegraph.errors import (
    CompileError,
    ExecutionError,
    UnsupportedError,
    ValidationError,
    VariantPackError,
)


def _model(tmp_path: Path, rng: np.random.Generator) -> Path:
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "exit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_missing_and_corrupt_models_are_both_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "nope.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an ONNX model" in err


def test_failures_of_the_work_are_status_1() -> None:
    assert exit_status(CompileError("iree-compile failed")) == 1
    assert exit_status(ExecutionError("the kernel failed")) == 1
    assert exit_status(UnsupportedError("no engine runs it")) == 1
    assert exit_status(ValidationError("bad dims")) == 2
    assert exit_status(VariantPackError("missing input")) == 2
    assert exit_status(FileNotFoundError(2, "No such file", "x.npy")) == 2


def test_cache_limit_below_use_asks_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from fusegraph.engines.iree.cache import ModuleCache

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    cache = ModuleCache(tmp_path, enabled=True)
    cache.put("a" * 64, os.urandom(20_000), {}, {})
    assert main(["cache", "limit", "0"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert len(cache.list_entries()) == 1  # nothing evicted
    assert main(["cache", "limit", "1G"]) == 0  # above what is used: nothing to ask
    assert main(["cache", "limit", "0", "--yes"]) == 0
    assert cache.list_entries() == []


def test_run_compare_ort_prints_both_latencies(tmp_path: Path, rng: np.random.Generator,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = _model(tmp_path, rng)
    assert main(["run", str(path), "--repeat", "3", "--engine", "reference", "--compare", "ort",
                 "--option", "torch_mlir_tier=off"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("vs ONNX Runtime"))
    assert "fusegraph" in line and "ONNX Runtime" in line and "ms" in line

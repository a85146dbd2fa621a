"""`fusegraph run`: partition summary, --check against ONNX Runtime, latency, --input files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusegraph.cli import main


def _model(tmp_path: Path, rng: np.random.Generator) -> Path:
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("Pad", ["r", "pads"], ["y"], mode="reflect"),
        ],
        "cli",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 10, 10])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_run_check_and_report(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    path = _model(tmp_path, rng)
    rc = main(["run", str(path), "--check", "--repeat", "3", "--engine", "reference", "--report",
               "--option", "torch_mlir_tier=off"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "partition report" in out and "2/3 non-constant nodes on fusegraph" in out
    assert "mode='reflect'" in out  # the unclaimed node's reason
    assert "latency: median" in out
    assert "check y: relative error" in out and "MISMATCH" not in out


def test_run_with_input_file_and_bad_option(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    path = _model(tmp_path, rng)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    rc = main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--check", "--repeat", "1",
               "--engine", "reference", "--option", "torch_mlir_tier=off"])
    out = capsys.readouterr().out
    assert rc == 0 and "partition:" in out and "check y" in out
    assert main(["run", str(path), "--option", "nope=1"]) == 2  # a usage error (fusegraph/cli.py)
    assert "--option: unknown FusegraphExecutionProvider option" in capsys.readouterr().err

"""The CLI fails loudly, once, in one line: user mistakes name the argument and never show a
traceback (``-v`` does); a requested device that is not there is an error unless
``--allow-fallback``; a closed pipe ends quietly; ``--version``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph
from fusegraph.cli import main
from fusegraph.onnx.report import PartitionReport, UnclaimedEntry


def _model(tmp_path: Path, rng: np.random.Generator) -> Path:
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "cli_errors",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fusegraph.cli", *argv], capture_output=True, text=True, timeout=300)


def _one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode != 0, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_version() -> None:
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"fusegraph {fusegraph.__version__}"


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--input", "x=does_not_exist.npy"], ["--input", "does_not_exist.npy"]),
        (["--engine", "no_such_engine"], ["--engine", "no_such_engine", "unknown engine"]),
        (["--option", "min_subgraph_size"], ["--option", "KEY=VALUE"]),
        (["--option", "min_subgraph_size=many"], ["--option", "min_subgraph_size", "integer"]),
        (["--device", "tpu:3"], ["--device", "tpu:3"]),
    ],
)
def test_user_mistakes_are_one_line(tmp_path: Path, rng: np.random.Generator, extra: list[str], needles: list[str]) -> None:
    _one_line_error(_cli("run", str(_model(tmp_path, rng)), "--repeat", "1", *extra), *needles)


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    _one_line_error(_cli("run", str(tmp_path / "nope.onnx")), "nope.onnx", "no such file")


def test_library_errors_are_one_line_and_verbose_shows_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(args: object) -> int:
        raise FileNotFoundError(2, "No such file or directory", "weights.bin")

    import fusegraph.commands.engines as engines_cmd

    monkeypatch.setattr(engines_cmd, "_run", boom)
    assert main(["engines"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "weights.bin" in err and "Traceback" not in err
    assert main(["-v", "engines"]) == 2
    assert "Traceback" in capsys.readouterr().err


def _gpu_usable() -> bool:
    from fusegraph.commands._checks import device_problem as _device_problem

    return _device_problem("cuda:0") is None


def test_missing_device_fails_unless_fallback_is_asked(tmp_path: Path, rng: np.random.Generator) -> None:
    if _gpu_usable():
        pytest.skip("a GPU is usable here: the missing-device path cannot be reached")
    path = str(_model(tmp_path, rng))
    _one_line_error(_cli("run", path, "--device", "cuda:0", "--repeat", "1"), "--device cuda:0", "--allow-fallback")
    out = _cli("run", path, "--device", "cuda:0", "--allow-fallback", "--repeat", "1", "--engine", "reference")
    assert out.returncode == 0, out.stderr
    said = [ln for ln in (out.stdout + out.stderr).splitlines() if "running on the CPU" in ln]
    assert len(said) == 1, out.stdout + out.stderr
    assert "engines that ran: reference" in out.stdout


def test_closed_pipe_ends_quietly() -> None:
    code = "import sys; from fusegraph.cli import main; sys.exit(main(['engines']))"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_report_groups_reasons() -> None:
    same = "the device cuda:0 is not usable here"
    rep = PartitionReport(
        model="m", total_nodes=5, folded_nodes=0, subgraphs=(),
        unclaimed=(
            *(UnclaimedEntry(f"n{i}", "Relu" if i % 2 else "Add", same, "onnxruntime") for i in range(4)),
            UnclaimedEntry("p", "Pad", "mode='reflect'", "onnxruntime"),
        ),
    )
    lines = str(rep).splitlines()
    assert sum(same in ln for ln in lines) == 1
    assert any(ln.strip().startswith("4 nodes (Addx2, Relux2") for ln in lines), lines
    assert any("1 node (Padx1; p)" in ln for ln in lines), lines

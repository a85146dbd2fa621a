"""Every subcommand driven with bad arguments (issue 16, "no CLI path a user can reach prints a
traceback without -v"): each ends with a non-zero status and one line on stderr that names the
argument; none raises out of ``main`` (which is what prints a traceback). A few run as real
processes with stdin closed and the output piped into ``head -1``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusegraph.cli import main


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> Path:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "sweep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "m.onnx"))
    (tmp_path / "garbage.onnx").write_bytes(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    (tmp_path / "empty.onnx").write_bytes(b"")
    np.save(tmp_path / "wrong_shape.npy", np.zeros((2, 2), np.float32))
    np.save(tmp_path / "wrong_type.npy", np.zeros((1, 3, 8, 8), np.int64))
    (tmp_path / "text.npy").write_text("not an array")
    (tmp_path / "a_file").write_text("x")
    monkeypatch.chdir(tmp_path)
    return tmp_path


CASES = [  # (argv, words the one stderr line must contain)
    (["demo", "--engine", "nope"], ["--engine", "nope"]),
    (["demo", "--device", "bogus"], ["--device", "bogus"]),
    (["demo", "--device", "cuda:0"], ["--device", "cuda:0"]),  # no usable GPU here (skipped where there is one)
    (["engines", "--device", "tpu:1"], ["--device", "tpu:1"]),
    (["cache", "limit", "abc"], ["limit", "abc"]),
    (["cache", "limit", "nan"], ["limit", "nan"]),
    (["cache", "limit", "99999999999999T"], ["limit", "99999999999999T"]),
    (["run", "missing.onnx"], ["missing.onnx", "no such file"]),
    (["run", "."], ["directory"]),
    (["run", "garbage.onnx"], ["garbage.onnx"]),
    (["run", "empty.onnx"], ["run"]),
    (["run", "a_file"], ["a_file"]),
    (["run", "m.onnx", "--repeat", "0"], ["--repeat"]),
    (["run", "m.onnx", "--repeat", "x"], ["--repeat"]),
    (["run", "m.onnx", "--seed", "-1"], ["--seed"]),
    (["run", "m.onnx", "--input", "x=wrong_shape.npy"], ["'x'", "[2, 2]"]),
    (["run", "m.onnx", "--input", "x=wrong_type.npy"], ["'x'", "int64"]),
    (["run", "m.onnx", "--input", "x=text.npy"], ["--input", "text.npy"]),
    (["run", "m.onnx", "--input", "x=."], ["--input"]),
    (["run", "m.onnx", "--input", "nosuch=wrong_shape.npy"], ["nosuch"]),
    (["run", "m.onnx", "--input", "x"], ["--input", "NAME=FILE"]),
    (["run", "m.onnx", "--option", "bogus=1"], ["--option", "bogus"]),
    (["run", "m.onnx", "--option", "engine=nope"], ["--option engine", "nope"]),
    (["run", "m.onnx", "--option", "device=cuda:0"], ["--option device", "cuda:0"]),
    (["run", "m.onnx", "--device", "cuda:0"], ["--device", "cuda:0"]),
    (["run", "m.onnx", "--device", "npu"], ["--device", "npu"]),
    (["tune", "show", "--graph-key", "nope"], ["nope"]),
    (["bogus"], ["bogus"]),
    (["tune"], ["tune"]),
    (["cache"], ["cache"]),
    (["run"], ["model"]),
]


def _gpu_usable() -> bool:
    from fusegraph.commands._checks import device_problem

    return device_problem("cuda:0") is None


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_argument_is_one_line_naming_it(
    argv: list[str], words: list[str], files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if "cuda:0" in argv and _gpu_usable():
        pytest.skip("a usable GPU is here: cuda:0 is not a mistake on this machine")
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse and the commands end like this; anything else escaping is a traceback
        status = exc.code if isinstance(exc.code, int) else (print(exc.code, file=sys.stderr) or 1)
    err = capsys.readouterr().err
    assert status != 0, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


def _pipe(argv: str, files: Path) -> subprocess.CompletedProcess[str]:
    cmd = f"{sys.executable} -m fusegraph.cli {argv} | head -1"
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300, cwd=files,
                          stdin=subprocess.DEVNULL, check=False)


@pytest.mark.parametrize("argv", ["engines", "cache list", "tune show", "run m.onnx --report --repeat 2 --engine reference"])
def test_closed_stdin_and_a_closed_pipe_end_quietly(argv: str, files: Path) -> None:
    out = _pipe(argv, files)
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    assert len(out.stdout.splitlines()) == 1


def test_a_bad_argument_through_a_pipe_is_still_one_line(files: Path) -> None:
    out = _pipe("run missing.onnx", files)
    assert out.stdout == "" and out.stderr.strip().splitlines() == ["fusegraph run: model 'missing.onnx': no such file"]

"""`fusegraph bench` run on this CPU: a small case of every family with ``--verify`` (each
contender's output against the float64 reference on the same inputs), the CSV and JSON
schema, ``--from-file`` going on past a line it cannot build, ``--dump``, ``--tune`` and the
exit statuses (0 ran, 2 usage, 1 failed). Times are read, never asserted."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_fakes import FakeEngine, registry_with

import fusegraph as fg
from fusegraph.bench.report import CSV_FIELDS, FORMAT
from fusegraph.cli import main
from fusegraph.engines.registry import using
from fusegraph.select.autotune import TOLERANCE

pytestmark = pytest.mark.usefixtures("own_cache")
FAST = ["-i", "2", "--warmup", "0.05"]


def _bench(tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any], list[dict[str, str]]]:
    js, cs = tmp_path / "out.json", tmp_path / "out.csv"
    rc = main(["bench", *argv, *FAST, "--json", str(js), "--csv", str(cs)])
    doc = json.loads(js.read_text()) if js.exists() else {}
    rows = list(csv.DictReader(cs.open())) if cs.exists() else []
    return rc, doc, rows


def _verified(doc: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    tol = TOLERANCE[fg.DataType(dtype)] if dtype in {d.value for d in fg.DataType} else 1e-4
    ok = [r for c in doc["cases"] for r in c["rows"] if r["status"] == "ok"]
    assert ok, doc
    for r in ok:
        assert r["rel_error"] is not None and r["rel_error"] <= tol, r
        assert r["median_ms"] > 0 and r["samples_ms"] and r["steady"] in (True, False)
    return ok


@pytest.mark.parametrize(
    "line",
    [
        ["conv", "-n", "2", "-c", "4", "-H", "8", "-W", "8", "-k", "4", "-p", "1", "-q", "1", "-F", "0", "-b", "1",
         "--activation", "relu", "--in_layout", "NHWC", "--out_layout", "NHWC"],
        ["conv", "-m", "trans", "-n", "1", "-c", "4", "-H", "5", "-W", "5", "-k", "6", "-p", "1", "-q", "1", "-u", "2",
         "-v", "2", "-Y", "1", "-X", "1", "-g", "2", "-F", "1", "-b", "1", "--activation", "relu"],
        ["matmul", "-m", "16", "-n", "24", "-k", "8", "--transB", "T", "--bias", "--activation", "gelu"],
        ["layernorm", "-X", "4x6x16"],
        ["rmsnorm", "-X", "8x32", "--activation", "silu"],
        ["softmax", "-n", "2", "-c", "8", "-H", "3", "-W", "3", "-a", "2"],
        ["sdpa", "-b", "1", "--heads", "4", "--heads_kv", "2", "-s", "16", "-d", "16", "--causal", "--dtype", "f32"],
    ],
    ids=lambda a: a[0] + ("_trans" if "trans" in a else ""),
)
def test_each_family_runs_and_matches_the_reference(tmp_path: Path, line: list[str]) -> None:
    pytest.importorskip("torch", reason="the torch engine and the eager baseline need PyTorch")
    rc, doc, rows = _bench(tmp_path, *line, "--engine", "torch", "--compare", "eager", "--verify")
    assert rc == 0, doc
    assert doc["format"] == FORMAT and doc["environment"]["fusegraph"] == fg.__version__
    ok = _verified(doc, "float")
    assert {r["contender"] for r in ok} == {"fusegraph[torch]", "eager"}
    assert len(doc["cases"]) == (3 if line[0] == "conv" and "trans" not in line else 1)  # -F 0: fwd, bwd data, bwd weight
    assert list(rows[0]) == list(CSV_FIELDS)
    fg_rows = [r for r in rows if r["contender"] == "fusegraph[torch]"]
    assert fg_rows and all(float(r["speedup_vs_eager"]) > 0 for r in fg_rows)


def test_engine_all_names_every_refusal_and_compares_onnx_runtime(tmp_path: Path) -> None:
    rc, doc, rows = _bench(tmp_path, "conv", "-n", "1", "-c", "4", "-H", "6", "-W", "6", "-k", "4", "-F", "1",
                           "--engine", "all", "--compare", "ort,cudnn", "--verify")
    assert rc == 0
    ok = _verified(doc, "float")
    assert "ort" in {r["contender"] for r in ok}
    by = {r["contender"]: r for r in rows}
    # cuDNN's frontend is a GPU baseline: refused here, with the reason
    assert by["cudnn"]["status"] == "refused" and "NVIDIA" in by["cudnn"]["reason"]
    engines = {r["engine"] for r in rows if r["kind"] == "fusegraph"}
    assert {"iree", "torch"} <= engines or all(r["reason"] for r in rows if r["status"] == "refused")
    assert sum(r["picked"] == "True" for r in rows) == 1  # the row `--engine auto` would time


def test_a_serialized_graph_and_dump(tmp_path: Path) -> None:
    g = fg.Graph("chain_file", io_data_type=fg.DataType.FLOAT)
    x, b = g.tensor("x", [4, 8]), g.tensor("b", [1, 8])
    g.tanh(g.add(x, b)).set_name("y").set_output(True)
    path = tmp_path / "g.json"
    path.write_text(g.validate().to_json())
    dump = tmp_path / "dump"
    rc, doc, _ = _bench(tmp_path, "graph", str(path), "--engine", "reference", "--compare", "eager", "--verify",
                        "--dump", str(dump))
    assert rc == 0
    (case,) = doc["cases"]
    assert case["name"] == "chain_file"
    eager = next(r for r in case["rows"] if r["contender"] == "eager")
    assert eager["status"] == "refused" and "no PyTorch form" in eager["reason"]
    d = dump / "chain_file"
    assert fg.Graph.from_json((d / "graph.json").read_text()).key() == g.key()
    assert "fusegraph bench graph" in (d / "command.txt").read_text()
    with np.load(d / "inputs.npz") as z:
        assert set(z.files) == {"x", "b"}
    assert "fusegraph[reference]" in json.loads((d / "artifacts.json").read_text())["config"]


def test_from_file_names_the_bad_line_and_runs_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = tmp_path / "shapes.txt"
    lines.write_text(
        "# two shapes and a mistake\n"
        "MIOpenDriver conv -n 1 -c 4 -H 6 -W 6 -k 4 -p 1 -q 1 -F 1 -t 1\n"
        "conv -n 1 -c 6 -H 6 -W 6 -k 4 -g 4 -F 1\n"
        "softmax -n 1 -c 4 -H 2 -W 2 --engine reference\n"
    )
    rc, doc, rows = _bench(tmp_path, "--from-file", str(lines), "--engine", "reference", "--verify")
    err = capsys.readouterr().err
    assert rc == 2  # a line could not be built: a usage error, after the others ran
    assert f"{lines}:3: error: " in err and "-g 4" in err
    assert [c["name"].split("_")[0] for c in doc["cases"]] == ["conv2d", "softmax"]
    assert {r["command"] for r in rows} == {"MIOpenDriver conv -n 1 -c 4 -H 6 -W 6 -k 4 -p 1 -q 1 -F 1 -t 1",
                                            "softmax -n 1 -c 4 -H 2 -W 2 --engine reference"}
    _verified(doc, "float")


def test_tune_reports_untuned_and_tuned(tmp_path: Path) -> None:
    rc, doc, _ = _bench(tmp_path, "matmul", "-m", "8", "-n", "8", "-k", "8", "--tune", "--tune-budget", "4", "--verify")
    assert rc == 0
    labels = {r["contender"] for r in doc["cases"][0]["rows"] if r["status"] == "ok"}
    assert labels in ({"tuned=untuned"}, {"untuned", "tuned"}), labels
    assert [r["picked"] for r in doc["cases"][0]["rows"] if r["contender"].startswith("tuned")] == [True]


def test_exit_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "softmax", "--engine", "no_such_engine"]) == 2
    assert "unknown engine" in capsys.readouterr().err
    assert main(["bench", "softmax", "--device", "tpu:0"]) == 2
    assert main(["bench"]) == 2
    assert "name a family" in capsys.readouterr().err
    assert main(["bench", "conv", "-F", "2", "-m", "trans"]) == 2
    assert "-m trans -F 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own refusal
        main(["bench", "conv", "--no-such-flag"])
    assert e.value.code == 2
    # a contender whose numbers are wrong is a failed run
    wrong = FakeEngine("wrong", wrong=True)
    with using(registry_with(wrong)):
        assert main(["bench", "softmax", "-X", "4x8", "--engine", "wrong", "--verify", *FAST]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_conv_every_engine_and_baseline(tmp_path: Path) -> None:
    """On the GPU machine: a small fused conv on every engine beside eager, torch.compile and
    cuDNN's frontend, each checked against the float64 reference."""
    rc, doc, rows = _bench(tmp_path, "conv", "-n", "2", "-c", "16", "-H", "8", "-W", "8", "-k", "16", "-p", "1", "-q",
                           "1", "-F", "1", "-b", "1", "--activation", "relu", "--dtype", "f16", "--in_layout", "NHWC",
                           "--fil_layout", "NHWC", "--out_layout", "NHWC", "--device", "cuda:0", "--engine", "all",
                           "--compare", "eager,compile,cudnn,ort", "--verify")
    assert rc == 0, rows
    ok = _verified(doc, "half")
    assert {"fusegraph[cudnn]", "fusegraph[torch]", "eager", "cudnn"} <= {r["contender"] for r in ok}
    by = {r["contender"]: r for r in rows}
    assert by["ort"]["status"] == "refused"  # ONNX Runtime here is the CPU build
    assert all(r["device"].startswith("cuda[") for r in rows)


def test_json_stays_strict_with_an_infinite_error(tmp_path: Path) -> None:
    """A NaN output's error is infinite: the JSON names it instead of breaking the file."""
    from fusegraph.bench.cases import cases_of
    from fusegraph.bench.flags import parse_line
    from fusegraph.bench.report import write_json
    from fusegraph.bench.runner import CaseResult, Row

    (case,) = cases_of(parse_line(["softmax", "-X", "2x4"]), "softmax -X 2x4")
    res = CaseResult(case, "cpu", "cpu[test]", rows=[Row("fusegraph", "fusegraph", "x", status="mismatch",
                                                         reason="output 'y' has NaN", rel_error=float("inf"))])
    write_json(str(tmp_path / "o.json"), [res], ["fusegraph", "bench"])
    (row,) = json.loads((tmp_path / "o.json").read_text())["cases"][0]["rows"]
    assert row["rel_error"] == "inf" and row["status"] == "mismatch"


def test_plot_needs_matplotlib_or_draws_the_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    png = tmp_path / "r.png"
    rc = main(["bench", "softmax", "-X", "8x16", "--engine", "reference", "--compare", "ort", "--plot", str(png), *FAST])
    if importlib.util.find_spec("matplotlib") is None:  # said before anything runs
        assert rc == 2 and "--plot needs matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert rc == 0 and png.stat().st_size > 0

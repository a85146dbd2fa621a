"""Bounded builds (issue 16, item 3): an IREE compile past its memory or time ceiling is a
typed refusal naming the graph and the limit, the reproducer is kept, the process lives on,
and the default selection goes on to another engine."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.engines.registry import active_registry
from fusegraph.errors import CompileError

F32 = fg.DataType.FLOAT


def _graph(rng: np.random.Generator) -> fg.Graph:
    n = int(rng.integers(5, 4000))  # dims drawn per run: never a cached compile
    g = fg.Graph(f"bounded_{n}", io_data_type=F32)
    g.tanh(g.tensor("x", [3, n])).set_name("y").set_output(True)
    return g.validate()


def _iree_available() -> None:
    if "iree" not in [e.name for e in active_registry().available_engines()]:
        pytest.skip("the IREE engine is not available here: no compile to bound")


@pytest.mark.parametrize(("limits", "word"), [("48,", "memory"), (",0.05", "time")])
def test_compile_past_its_ceiling_is_refused_and_kept(
    limits: str, word: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    _iree_available()
    monkeypatch.setenv("FUSEGRAPH_IREE_COMPILE_LIMITS", limits)
    g = _graph(rng)
    with pytest.raises(fg.FusegraphError) as info:
        g.build(engine="iree")
    msg = str(info.value)
    assert g.name in msg and f"{word} ceiling" in msg, msg
    m = re.search(r"reproducer: (\S+)", msg)
    repro = getattr(info.value, "reproducer", None) or (m.group(1) if m else None)
    if repro is None:
        cause = info.value.__cause__ or info.value.__context__
        repro = cause.reproducer if isinstance(cause, CompileError) else None
    assert repro is not None, msg
    assert (Path(repro) / "repro.sh").exists() and (Path(repro) / "module.mlir").exists()
    # the process lives on, and without a pinned engine another engine runs the graph
    x = rng.standard_normal(g.tensor_by_name("x").shape).astype(np.float32)
    y = g.execute({"x": x})["y"]
    rel = np.linalg.norm(y - np.tanh(x.astype(np.float64))) / np.linalg.norm(np.tanh(x.astype(np.float64)))
    assert rel <= 1e-5


def test_generous_ceiling_compiles(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    _iree_available()
    monkeypatch.setenv("FUSEGRAPH_IREE_COMPILE_LIMITS", "16384,300")
    g = _graph(rng)
    x = rng.standard_normal(g.tensor_by_name("x").shape).astype(np.float32)
    y = g.execute({"x": x}, engine="iree")["y"]
    assert float(np.abs(y - np.tanh(x)).max()) <= 1e-5

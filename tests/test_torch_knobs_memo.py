"""The torch engine works a validated graph's knobs and support out once per handle (a
region build asks for each piece's several times): the same answers as worked out afresh, a
new knob list each ask, and worked out again once the graph changes or the cpu_compile
default's variable does."""

from __future__ import annotations

from typing import Any

import pytest

import fusegraph as fg
from fusegraph import DataType as DT

pytest.importorskip("torch", reason="the torch engine's knobs (fusegraph[torch])")

from fusegraph.engines.torch import engine as torch_engine
from fusegraph.engines.torch import frozen
from fusegraph.engines.torch.engine import TorchEngine

CPU = fg.Handle("cpu")
GPU = fg.Handle("cuda:0")  # a handle only: knobs never touch the device


def _count(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Counts the calls of ``owner.name`` (a function of a graph and a handle)."""
    calls = [0]
    inner = getattr(owner, name)

    def counted(graph: fg.Graph, handle: fg.Handle) -> Any:
        calls[0] += 1
        return inner(graph, handle)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _counting(monkeypatch: pytest.MonkeyPatch) -> tuple[TorchEngine, list[int]]:
    engine = TorchEngine()
    return engine, _count(monkeypatch, engine, "_knobs")


def _pointwise() -> tuple[fg.Graph, Any]:
    g = fg.Graph("pw", io_data_type=DT.FLOAT)
    x = g.tensor("x", [1, 4, 8, 8])
    y = g.relu(x).set_output(True)
    return g.validate(), y


@pytest.mark.parametrize("handle", [CPU, GPU], ids=["cpu", "cuda_handle"])
def test_asked_again_the_knobs_are_the_same_and_worked_out_once(monkeypatch: pytest.MonkeyPatch,
                                                              handle: fg.Handle) -> None:
    engine, calls = _counting(monkeypatch)
    g, _ = _pointwise()
    first = engine.knobs(g, handle)
    assert list(engine.knobs(g, handle)) == list(first) == TorchEngine()._knobs(g, handle)
    assert calls[0] == 1
    first.clear()  # type: ignore[attr-defined]  # a caller's own list
    assert list(engine.knobs(g, handle)) == TorchEngine()._knobs(g, handle) != []


def test_a_changed_graph_gets_its_knobs_worked_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, calls = _counting(monkeypatch)
    g, y = _pointwise()
    assert "memory_format" not in {k.name for k in engine.knobs(g, CPU)}
    w = g.tensor("w", [4, 4, 3, 3])
    g.conv_fprop(y, w, padding=[1, 1]).set_output(True)  # a convolution brings the layout knob
    g.validate()
    assert "memory_format" in {k.name for k in engine.knobs(g, CPU)}
    assert calls[0] == 2


def test_an_unvalidated_graph_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, calls = _counting(monkeypatch)
    g, _ = _pointwise()
    g.tensor("unused", [3])  # a change: the graph is no longer validated
    assert not g.is_validated
    engine.knobs(g, CPU)
    engine.knobs(g, CPU)
    assert calls[0] == 2 and not g.derived


def test_the_cpu_compile_default_follows_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = TorchEngine()
    if not engine.compile_support(CPU):
        pytest.skip("no C++ compiler: the cpu_compile knob is not offered")
    g, _ = _pointwise()

    def default() -> Any:
        return next(k.default for k in engine.knobs(g, CPU) if k.name == "cpu_compile")

    monkeypatch.setenv(frozen.ENV, "off")
    assert default() == "off"
    monkeypatch.setenv(frozen.ENV, "auto")
    assert default() == "auto"


def test_support_is_worked_out_once_and_again_after_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count(monkeypatch, torch_engine, "_nodes_supported")
    engine = TorchEngine()
    g = fg.Graph("cat", io_data_type=DT.FLOAT)
    a, b = g.tensor("a", [2, 3]), g.tensor("b", [2, 3])
    g.concatenate([a, b], axis=0).set_output(True)
    g.validate()
    assert engine.supports(g, CPU) and engine.supports(g, CPU)
    assert calls[0] == 1
    a.set_data_type(DT.FP8_E4M3)  # torch has no fp8 concatenation
    b.set_data_type(DT.FP8_E4M3)
    why = engine.supports(g, CPU)
    assert not why and "no fp8 kernels" in why.reason
    assert not engine.supports(g, CPU)
    assert calls[0] == 2

"""Work a region unit's build does once per region content instead of once per region (a
warm open's share, issue 24 item 6): the op-by-op configuration of a piece
(``plan_regions.RegionUnit._eager``'s ``key``) and the chooser's question whether a region
has a fallback candidate (``region_choice.per_content``). A model of repeated layers gets the
same pieces, configurations, report rows and outputs as when every region asks again."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_onnx_regions import _agree, _const, _fake_floor, _rows, _session

from fusegraph.engines.registry import REGISTRY
from fusegraph.onnx import plan_regions, region_choice

pytest.importorskip("torch", reason="the region path passes torch tensors (fusegraph[torch])")
pytestmark = pytest.mark.usefixtures("own_cache")


def repeated_blocks(rng: np.random.Generator, widths: tuple[int, ...]) -> onnx.ModelProto:
    """MatMul -> Add(bias) -> Relu blocks from width ``widths[k]`` to ``widths[k + 1]``: blocks
    of one shape are regions of one content (their weights are the regions' inputs)."""
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        inits += [_const(rng, f"w{k}", (a, b)), _const(rng, f"b{k}", (b,))]
        out = "y" if k == len(widths) - 2 else f"r{k}"
        nodes += [helper.make_node("MatMul", [prev, f"w{k}"], [f"m{k}"], name=f"mm{k}"),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"], name=f"bias{k}"),
                  helper.make_node("Relu", [f"a{k}"], [out], name=f"relu{k}")]
        prev = out
    g = helper.make_graph(nodes, "repeated_blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, widths[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, widths[-1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _warm_incumbent_session(monkeypatch: pytest.MonkeyPatch, model: onnx.ModelProto,
                            memo: bool) -> tuple[Any, list[str], list[tuple[str, Any]]]:
    """A second session (the verdicts stored by the first: every region lost to the
    incumbent), with the names of the graphs ``op_by_op_config`` was asked about and each
    torch-engine build's (graph name, config); ``memo`` False: every region asks again."""
    asked: list[str] = []
    built: list[tuple[str, Any]] = []
    real_config, engine = plan_regions.op_by_op_config, REGISTRY.get("torch")
    real_build, real_eager = engine.build, plan_regions.RegionUnit._eager

    def config(graph: Any, handle: Any, **kw: Any) -> Any:
        asked.append(graph.name)
        return real_config(graph, handle, **kw)

    def build(graph: Any, handle: Any, cfg: Any = None) -> Any:
        built.append((graph.name, cfg))
        return real_build(graph, handle, cfg)

    def eager(self: Any, graph: Any, **kw: Any) -> Any:
        return real_eager(self, graph, **{**kw, "key": None})

    with monkeypatch.context() as m:
        m.setattr(plan_regions, "op_by_op_config", config)
        m.setattr(engine, "build", build)
        if not memo:
            m.setattr(plan_regions.RegionUnit, "_eager", eager)
        sess = _session(model, floor="on")
    return sess, asked, built


@pytest.mark.parametrize("widths", [(16, 16, 16, 16), (16, 16, 16, 8)], ids=["one_content", "two_contents"])
def test_repeated_regions_ask_for_their_op_by_op_configuration_once(
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator, widths: tuple[int, ...]) -> None:
    measured: list[str] = []
    _fake_floor(monkeypatch, lambda r: 1.0, 2.0, measured)  # the incumbent wins every region
    model = repeated_blocks(rng, widths)
    _session(model, floor="on")  # the verdicts stored
    assert measured, "the first session measured nothing"
    measured.clear()
    sess, asked, built = _warm_incumbent_session(monkeypatch, model, memo=True)
    again, asked_again, built_again = _warm_incumbent_session(monkeypatch, model, memo=False)
    assert measured == [], "a warm session measured again"
    rows = _rows(sess.partition_report())
    assert len(rows) == 3 and all(r.source == "cached" and r.where == "fake" for r in rows), rows
    contents = len(set(itertools.pairwise(widths)))
    assert len(asked_again) == 3 and len(asked) == contents, (asked, asked_again)
    # the same pieces, built with the same configurations, the same report
    assert built == built_again
    assert rows == _rows(again.partition_report())
    _agree(sess, model, (4, widths[0]), rng)


def test_per_content_asks_once_per_content_key() -> None:
    calls: list[str] = []

    class R:
        def __init__(self, key: str) -> None:
            self.key = key

    def ask(region: Any) -> bool:
        calls.append(region.key)
        return region.key.startswith("a")

    asked = region_choice.per_content(ask)
    answers = [asked(R(k)) for k in ("a1", "a1", "b1", "a1", "b1", "a2")]  # type: ignore[arg-type]
    assert answers == [True, True, False, True, False, True]
    assert calls == ["a1", "b1", "a2"]
    # each chooser its own memory: another one asks again
    other = region_choice.per_content(ask)
    assert other(R("b1")) is False and calls[-1] == "b1"  # type: ignore[arg-type]

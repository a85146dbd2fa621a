"""The partitioner's cycle check stops at the target's place in a topological order of the
units (issue 24 item 6: the unbounded search, repeated per merge, was 0.14 s of a warm
ViT-B/16 setup). The check is exact either way, so the partitions must be the same: random
DAGs (hypothesis) and a transformer-shaped DAG with residual edges and scattered unsupported
nodes are partitioned with the ordered search and with the plain one, and compared."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_onnx_partition import dags

from fusegraph.onnx import partition as part_mod
from fusegraph.onnx.partition import Partitioning, PNode, partition


class _Plain(part_mod._Units):
    """The units without the order: the cycle check searches everything downstream."""

    def _reset(self, nodes: Iterable[int]) -> None:
        super()._reset(nodes)
        self._ordered = False

    def _order_afresh(self) -> None:
        self._ordered = False


def _both(nodes: list[PNode], reasons: dict[str, str | None], min_size: int,
          monkeypatch: pytest.MonkeyPatch) -> tuple[Partitioning, Partitioning]:
    fast = partition(nodes, reasons, min_size=min_size)
    with monkeypatch.context() as m:
        m.setattr(part_mod, "_Units", _Plain)
        plain = partition(nodes, reasons, min_size=min_size)
    return fast, plain


def _same(a: Partitioning, b: Partitioning) -> None:
    assert [(g.nodes, g.claimed) for g in a.groups] == [(g.nodes, g.claimed) for g in b.groups]
    assert a.reasons == b.reasons




@settings(max_examples=300, deadline=None)
@given(dags(max_nodes=40), st.integers(1, 4))
def test_random_dags_partition_alike(dag: tuple[list[PNode], dict[str, str | None]], min_size: int) -> None:
    nodes, reasons = dag
    with pytest.MonkeyPatch.context() as mp:
        fast, plain = _both(nodes, reasons, min_size, mp)
    _same(fast, plain)


def _encoder(layers: int, rng: np.random.Generator) -> tuple[list[PNode], dict[str, str | None]]:
    """A transformer encoder's node graph: norm, Q/K/V, scores, softmax, context, projection,
    residual add, norm, MLP, residual add; a few nodes per layer unsupported at random (the
    partition then has many units and long residual edges across them)."""
    nodes: list[PNode] = []
    reasons: dict[str, str | None] = {}

    def node(op: str, *ins: str) -> str:
        name = f"{op}_{len(nodes)}"
        nodes.append(PNode(name, op, ins, (name + ":0",)))
        reasons[name] = "unsupported" if rng.random() < 0.08 else None
        return name + ":0"

    x = "input"
    for _ in range(layers):
        h = node("LayerNorm", x)
        q, k, v = node("MatMul", h), node("MatMul", h), node("MatMul", h)
        q, k, v = node("Reshape", q), node("Reshape", k), node("Reshape", v)
        s = node("Softmax", node("Div", node("MatMul", q, node("Transpose", k))))
        c = node("Reshape", node("Transpose", node("MatMul", s, v)))
        x = node("Add", x, node("Add", node("MatMul", c)))
        h = node("LayerNorm", x)
        x = node("Add", x, node("MatMul", node("Gelu", node("MatMul", h))))
    return nodes, reasons


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("min_size", [1, 3])
def test_encoder_partitions_alike(seed: int, min_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, reasons = _encoder(12, np.random.default_rng(seed))
    fast, plain = _both(nodes, reasons, min_size, monkeypatch)
    _same(fast, plain)
    assert len(fast.groups) > 3  # the unsupported nodes split it: the order was exercised

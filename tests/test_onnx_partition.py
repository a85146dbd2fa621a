"""Partition invariants: on hand-made and random DAGs (hypothesis), units never form a cycle,
every node is in exactly one unit, claimed units respect min_subgraph_size and are maximal,
and a session over random ONNX DAGs returns what ONNX Runtime returns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import fusegraph.onnx as fgo
from fusegraph.onnx.partition import Partitioning, PNode, partition


# ---- helpers -------------------------------------------------------------------------------------
def _unit_edges(nodes: Sequence[PNode], unit_of: dict[str, int]) -> set[tuple[int, int]]:
    producer = {o: n.name for n in nodes for o in n.outputs}
    edges = set()
    for n in nodes:
        for i in n.inputs:
            p = producer.get(i)
            if p is not None and unit_of[p] != unit_of[n.name]:
                edges.add((unit_of[p], unit_of[n.name]))
    return edges


def _acyclic(n_units: int, edges: set[tuple[int, int]]) -> bool:
    succ: dict[int, set[int]] = {u: set() for u in range(n_units)}
    indeg = dict.fromkeys(range(n_units), 0)
    for a, b in edges:
        if b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    ready = [u for u, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    return seen == n_units


def _check_invariants(nodes: Sequence[PNode], reasons: dict[str, str | None], part: Partitioning, min_size: int) -> None:
    names = [n.name for n in nodes]
    placed = [name for g in part.groups for name in g.nodes]
    assert sorted(placed) == sorted(names), "every node in exactly one unit"
    unit_of = {name: k for k, g in enumerate(part.groups) for name in g.nodes}
    edges = _unit_edges(nodes, unit_of)
    assert _acyclic(len(part.groups), edges), "no cycle between units"
    # the order of units is an order that runs: producers first
    assert all(a < b for a, b in edges), "units are listed producers first"
    for g in part.groups:
        if g.claimed:
            assert len(g.nodes) >= min_size, "min_subgraph_size honoured"
            assert all(reasons.get(n) is None for n in g.nodes), "only supported nodes are claimed"
        else:
            assert all(n in part.reasons for n in g.nodes), "every unclaimed node has a reason"
    # maximal: two claimed units joined by an edge cannot merge without a cycle
    claimed = {k for k, g in enumerate(part.groups) if g.claimed}
    for a, b in edges:
        if a in claimed and b in claimed:
            merged = {(x if x != b else a, y if y != b else a) for x, y in edges}
            merged = {(x, y) for x, y in merged if x != y}
            assert not _acyclic(len(part.groups), _relabel(merged, b)), f"units {a} and {b} could merge"


def _relabel(edges: set[tuple[int, int]], gone: int) -> set[tuple[int, int]]:
    """Unit ids without ``gone`` (after a merge), compacted for _acyclic."""
    def f(u: int) -> int:
        return u if u < gone else u - 1

    return {(f(a), f(b)) for a, b in edges}


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 24) -> tuple[list[PNode], dict[str, str | None]]:
    """Random DAGs of one-output nodes over two graph inputs, three in four claimable."""
    n = draw(st.integers(1, max_nodes))
    nodes: list[PNode] = []
    values = ["x0", "x1"]
    reasons: dict[str, str | None] = {}
    for i in range(n):
        k = draw(st.integers(1, min(3, len(values))))
        ins = tuple(draw(st.lists(st.sampled_from(values), min_size=k, max_size=k)))
        nodes.append(PNode(f"n{i}", "Op", ins, (f"v{i}",)))
        values.append(f"v{i}")
        reasons[f"n{i}"] = None if draw(st.booleans()) or draw(st.booleans()) else "unsupported"
    return nodes, reasons


# ---- the partitioner alone ---------------------------------------------------------------------
def test_diamond_with_unsupported_middle() -> None:
    # a -> b (unsupported) -> d and a -> c -> d: {a, c, d} as one unit would need b both
    # after and before it.
    nodes = [
        PNode("a", "A", ("x",), ("va",)),
        PNode("b", "B", ("va",), ("vb",)),
        PNode("c", "C", ("va",), ("vc",)),
        PNode("d", "D", ("vb", "vc"), ("vd",)),
    ]
    reasons = {"a": None, "b": "no", "c": None, "d": None}
    part = partition(nodes, reasons)
    _check_invariants(nodes, reasons, part, 1)
    claimed = [sorted(g.nodes) for g in part.claimed]
    assert ["a", "c"] in claimed and ["d"] in claimed


def test_min_size_releases_small_units() -> None:
    nodes = [PNode("a", "A", ("x",), ("va",)), PNode("b", "B", ("va",), ("vb",)), PNode("c", "C", ("vb",), ("vc",))]
    reasons = {"a": None, "b": "no", "c": None}
    part = partition(nodes, reasons, min_size=2)
    assert not part.claimed
    assert "min_subgraph_size=2" in part.reasons["a"]
    _check_invariants(nodes, reasons, part, 2)


def test_deterministic() -> None:
    nodes = [PNode(f"n{i}", "Op", (f"v{i - 1}" if i else "x", f"v{i - 2}" if i > 1 else "x"), (f"v{i}",)) for i in range(12)]
    reasons = {f"n{i}": (None if i % 3 else "no") for i in range(12)}
    first = partition(nodes, reasons)
    for _ in range(3):
        again = partition(nodes, reasons)
        assert [g.nodes for g in again.groups] == [g.nodes for g in first.groups]


def test_not_topological_is_refused() -> None:
    nodes = [PNode("b", "B", ("va",), ("vb",)), PNode("a", "A", ("x",), ("va",))]
    with pytest.raises(ValueError, match="topological"):
        partition(nodes, {"a": None, "b": None})


@settings(max_examples=300, deadline=None)
@given(dags(), st.integers(1, 4))
def test_partition_invariants_random_dags(dag: tuple[list[PNode], dict[str, str | None]], min_size: int) -> None:
    nodes, reasons = dag
    part = partition(nodes, reasons, min_size=min_size)
    _check_invariants(nodes, reasons, part, min_size)


# ---- whole sessions on random ONNX DAGs, against ONNX Runtime ----------------------------------
_UNARY = ["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Softsign"]
_BINARY = ["Add", "Mul", "Sub", "Max"]
_EXCLUDED = ("Tanh", "Max")  # stand-ins for "ops fusegraph cannot run"


@st.composite
def onnx_dags(draw: st.DrawFn) -> onnx.ModelProto:
    n = draw(st.integers(1, 16))
    values = ["x", "y"]
    nodes = []
    read: set[str] = set()
    for i in range(n):
        if draw(st.booleans()):
            op = draw(st.sampled_from(_UNARY))
            ins = [draw(st.sampled_from(values))]
        else:
            op = draw(st.sampled_from(_BINARY))
            ins = [draw(st.sampled_from(values)), draw(st.sampled_from(values))]
        out = f"v{i}"
        nodes.append(helper.make_node(op, ins, [out], name=f"n{i}"))
        read.update(ins)
        values.append(out)
    produced = values[2:]
    outs = [v for v in produced if v not in read] or [produced[-1]]
    extra = draw(st.lists(st.sampled_from(produced), max_size=2, unique=True))
    outs = list(dict.fromkeys(outs + extra))
    shape = [2, 3, 4]
    graph = helper.make_graph(
        nodes, "random",
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in ("x", "y")],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in outs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(onnx_dags(), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_session_on_random_dags_matches_onnxruntime(model: onnx.ModelProto, min_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opts = {"engine": "reference", "min_subgraph_size": min_size, "op_types_to_exclude": ",".join(_EXCLUDED),
            "torch_mlir_tier": "off"}
    sess = fgo.InferenceSession(model.SerializeToString(), providers=[(fgo.PROVIDER, opts)])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {v: rng.standard_normal((2, 3, 4)).astype(np.float32) for v in ("x", "y")}
    for got, want in zip(sess.run(None, feed), ref.run(None, feed), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rep = sess.partition_report()
    op_of = {n.name: n.op_type for n in model.graph.node}
    seen = [n for s in rep.subgraphs for n in s.nodes]
    assert sorted(seen) == sorted(op_of), "every node in exactly one place"
    unit_of = {n: k for k, s in enumerate(rep.subgraphs) for n in s.nodes}
    pnodes = [PNode(n.name, n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node]
    edges = _unit_edges(pnodes, unit_of)
    assert _acyclic(len(rep.subgraphs), edges)
    for s in rep.subgraphs:
        if s.kind == "fusegraph":
            assert len(s.nodes) >= min_size
            assert not any(op_of[n] in _EXCLUDED for n in s.nodes)
    for u in rep.unclaimed:
        assert u.reason
        if op_of[u.node] in _EXCLUDED:
            assert "op_types_to_exclude" in u.reason

"""Cutting a graph's pieces with the parent serialized and indexed once (subgraph.Whole,
issue 24 item 6) gives the same standalone graphs as cutting from the plain dict form, nodes
in the parent's order; the attribute type hints resolved once per class give the same
graphs from JSON."""

from __future__ import annotations

from test_regions import _model

import fusegraph as fg
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict
from fusegraph.regions import split
from fusegraph.regions.subgraph import Whole, cut


def _block() -> fg.Graph:
    g = fg.Graph("block", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [8, 32])
    h, _, _ = g.layernorm(x, g.tensor("g", [1, 32]), g.tensor("beta", [1, 32]), 1e-5)
    qkv = g.add(g.matmul(h, g.tensor("wqkv", [32, 96])), g.tensor("bqkv", [1, 96]))
    q = g.reshape(g.slice(qkv, [0, 0], [8, 32], [1, 1]), [1, 2, 8, 16])
    k = g.reshape(g.slice(qkv, [0, 32], [8, 64], [1, 1]), [1, 2, 8, 16])
    v = g.reshape(g.slice(qkv, [0, 64], [8, 96], [1, 1]), [1, 2, 8, 16])
    o = g.reshape(g.sdpa(q, k, v, causal=True), [8, 32])
    g.add(g.mul(o, g.scalar(0.5)), x).set_output(True).set_name("y")
    return g.validate()


def test_pieces_cut_alike_from_the_index_and_the_dict() -> None:
    for g in (_model(), _block()):
        whole, d = Whole(g), graph_to_dict(g)
        by_name = {n.name: n for n in g.nodes}
        found = split(g)
        assert found.regions
        for r in found.regions:
            nodes = [by_name[n] for n in r.nodes]
            keep = set(r.outputs)
            a = cut(g, nodes, keep, "piece", whole)
            b = cut(g, nodes, keep, "piece", d)
            c = cut(g, nodes, keep, "piece")
            assert graph_to_dict(a.graph) == graph_to_dict(b.graph) == graph_to_dict(c.graph)
            assert a.inputs == r.inputs and a.outputs == r.outputs
            assert a.graph.key() == r.key
            ops = [e["op"] for e in graph_to_dict(a.graph)["nodes"]]
            assert ops == [e["op"] for e in d["nodes"] if e["name"] in set(r.nodes)]  # the parent's order


def test_graphs_round_trip_through_dicts_twice() -> None:
    for g in (_model(), _block()):
        d = graph_to_dict(g)
        once = graph_from_dict(d)
        twice = graph_from_dict(graph_to_dict(once))  # the second read takes the cached hints
        assert graph_to_dict(once) == graph_to_dict(twice) == d

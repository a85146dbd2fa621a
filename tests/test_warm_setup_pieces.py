"""Cutting a graph's pieces with the parent serialized and indexed once (subgraph.Whole,
issue 24 item 6) gives the same standalone graphs as cutting from the plain dict form, nodes
in the parent's order; the attribute type hints resolved once per class give the same
graphs from JSON."""

from __future__ import annotations

from test_regions import _model, transformer_block

import fusegraph as fg
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict
from fusegraph.regions import split
from fusegraph.regions.subgraph import Whole, cut


def _block() -> fg.Graph:
    return transformer_block(scale=0.5)


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

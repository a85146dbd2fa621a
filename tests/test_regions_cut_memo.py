"""A model's repeated layers cut the same contents again and again (Swin-T: 177 cuts, 85
contents): a ``Whole`` validates each content once and gives a repeat the state validating
it would have left (subgraph._build, issue 24 item 6). The graphs, their keys and what
``validate`` inferred must be those of cutting each piece on its own."""

from __future__ import annotations

from typing import Any

import pytest
from test_regions import transformer_block

import fusegraph as fg
from fusegraph.graph.serialize import graph_to_dict
from fusegraph.onnx import region_pieces
from fusegraph.regions import split
from fusegraph.regions.subgraph import Whole, cut


def _layers(n: int = 3) -> fg.Graph:
    """``n`` identical layers (a reshape there and back, GEMM + bias + ReLU, a scaled
    residual add), each with weights of its own: the same contents at different places."""
    g = fg.Graph("layers", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [8, 32])
    for i in range(n):
        h = g.reshape(g.reshape(x, [2, 4, 32]), [8, 32])  # movement alone: a cut of its own
        h = g.relu(g.add(g.matmul(h, g.tensor(f"w{i}", [32, 32])), g.tensor(f"b{i}", [1, 32])))
        x = g.add(g.mul(h, g.scalar(0.5)), x)
    x.set_output(True).set_name("y")
    return g.validate()


def _branches() -> fg.Graph:
    """The same ops on two widths (and two types): contents a memo must keep apart."""
    g = fg.Graph("branches", io_data_type=fg.DataType.FLOAT)
    for i, (width, dt) in enumerate([(32, None), (16, None), (16, fg.DataType.HALF)]):
        x = g.tensor(f"x{i}", [8, width], data_type=dt)
        w, b = g.tensor(f"w{i}", [width, width], data_type=dt), g.tensor(f"b{i}", [1, width], data_type=dt)
        g.relu(g.add(g.matmul(x, w), b)).set_output(True).set_name(f"y{i}")
    return g.validate()


def _state(g: fg.Graph) -> list[Any]:
    return [(t.name, t._dim, t._stride, t._data_type, t.dim_set, t.stride_set, t.dtype_set, t.is_virtual,
             t.is_output) for t in g.tensors]


def _same(a: fg.Graph, b: fg.Graph) -> None:
    assert a.is_validated and b.is_validated
    assert graph_to_dict(a) == graph_to_dict(b)
    assert _state(a) == _state(b)
    assert a.key() == b.key()


def test_repeated_contents_cut_as_if_each_were_validated_alone() -> None:
    for g in (_layers(), _branches(), transformer_block(scale=0.5)):
        by_name = {n.name: n for n in g.nodes}
        whole = Whole(g)
        found = split(g, whole=whole)
        keys = [r.key for r in found.regions]
        if g.name == "layers":
            assert len(set(keys)) < len(keys)  # the layers repeat: the memo is taken
            assert whole.seen
        if g.name == "branches":
            assert len(set(keys)) == len(keys) == 3
        for r in found.regions:
            alone = cut(g, [by_name[n] for n in r.nodes], set(r.outputs), r.graph.name)  # no Whole: validated
            _same(r.graph, alone.graph)
            assert r.graph.name == alone.graph.name and (r.inputs, r.outputs) == (alone.inputs, alone.outputs)
            assert r.graph is not alone.graph
        names = [r.graph.name for r in found.regions]
        assert len(set(names)) == len(names)  # each region its own graph and name


def test_a_shared_whole_splits_and_cuts_as_separate_ones() -> None:
    g = _layers(4)
    plain = split(g)
    whole = Whole(g)
    shared = split(g, whole=whole)
    assert [(r.nodes, r.key, r.inputs, r.outputs) for r in plain.regions] == \
        [(r.nodes, r.key, r.inputs, r.outputs) for r in shared.regions]
    for a, b in zip(plain.regions, shared.regions, strict=True):
        _same(a.graph, b.graph)
    one, two = region_pieces.cuts(g, plain.rejected), region_pieces.cuts(g, shared.rejected, whole)
    assert one and len(one) == len(two)
    for c, d in zip(one, two, strict=True):
        assert (c.nodes, c.inputs, c.outputs, c.reason, c.movement) == (d.nodes, d.inputs, d.outputs, d.reason,
                                                                          d.movement)
        _same(c.graph, d.graph)


def test_a_repeat_does_not_take_a_changed_first_graphs_state() -> None:
    g = _layers(3)
    by_name = {n.name: n for n in g.nodes}
    found = split(g)
    r0 = found.regions[0]
    twin = next(r for r in found.regions[1:] if r.key == r0.key)
    whole = Whole(g)
    first = cut(g, [by_name[n] for n in r0.nodes], set(r0.outputs), "first", whole).graph
    first.key()
    first.tensor("extra", [3, 3])  # changed after its cut: its key is dropped, its state no longer the cut's
    again = cut(g, [by_name[n] for n in twin.nodes], set(twin.outputs), "again", whole).graph
    alone = cut(g, [by_name[n] for n in twin.nodes], set(twin.outputs), "again").graph
    _same(again, alone)
    assert again.key() == r0.key


def test_a_graph_adopts_the_state_validating_it_would_leave() -> None:
    """``Graph.adopt_validated`` gives a fresh graph of the same contents what ``validate``
    infers, key included; a graph of other contents (another tensor count) is refused."""
    from fusegraph.graph.serialize import graph_from_dict

    first = _layers()
    state = first.validated_state()
    fresh = graph_from_dict(graph_to_dict(first))
    assert not fresh.is_validated
    fresh.adopt_validated(state)
    again = graph_from_dict(graph_to_dict(first)).validate()
    assert fresh.is_validated and fresh.key() == again.key() == first.key()
    assert [(t.dim, t.stride, t.data_type) for t in fresh.tensors] == [(t.dim, t.stride, t.data_type)
                                                                      for t in again.tensors]
    with pytest.raises(ValueError, match="tensors"):
        graph_from_dict(graph_to_dict(_layers(2))).adopt_validated(state)

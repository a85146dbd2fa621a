"""Graph.topological_order is walked once per validation and reused: the same order the
uncached walk gives, a new list each call, and never a stale one after the graph changes."""

from __future__ import annotations

import random

import pytest

import fusegraph as fg
from fusegraph.errors import ValidationError
from fusegraph.graph.node import Node

F32 = fg.DataType.FLOAT


def _reference_order(g: fg.Graph) -> list[Node]:
    """The walk as it was before the cache (a node's producers recomputed on every visit)."""
    producer = {id(t): n for n in g.nodes for t in n.outputs.values()}
    state: dict[int, int] = {}
    order: list[Node] = []
    for root in g.nodes:
        if id(root) in state:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        state[id(root)] = 1
        while stack:
            node, i = stack.pop()
            deps = [producer[id(t)] for t in node.inputs.values() if id(t) in producer]
            if i < len(deps):
                stack.append((node, i + 1))
                dep = deps[i]
                s = state.get(id(dep))
                assert s != 1, "cycle"
                if s is None:
                    state[id(dep)] = 1
                    stack.append((dep, 0))
            else:
                state[id(node)] = 2
                order.append(node)
    return order


def _random_graph(rng: random.Random, n_nodes: int) -> fg.Graph:
    """Pointwise nodes over random earlier values, declared in a shuffled order so the walk
    has producers to visit before the nodes that read them."""
    g = fg.Graph(io_data_type=F32)
    values = [g.tensor(f"x{i}", [2, 3]) for i in range(3)]
    for _ in range(n_nodes):
        a, b = rng.choice(values), rng.choice(values)
        values.append(rng.choice([g.add, g.mul, g.sub])(a, b) if rng.random() < 0.7 else g.exp(a))
    for t in values[3:]:
        if rng.random() < 0.2:
            t.set_output(True)
    values[-1].set_output(True)
    rng.shuffle(g.nodes)
    return g


@pytest.mark.parametrize("seed", range(20))
def test_the_order_is_the_uncached_walks(seed: int) -> None:
    rng = random.Random(seed * 7919 + random.randrange(1 << 30))
    g = _random_graph(rng, rng.randrange(1, 40)).validate()
    expected = _reference_order(g)
    assert g.topological_order() == expected
    assert g.topological_order() == expected  # from the cache
    # producers first, every node once
    seen: set[int] = set()
    produced = {id(t) for n in g.nodes for t in n.outputs.values()}
    for n in g.topological_order():
        assert all(id(t) in seen for t in n.inputs.values() if id(t) in produced)
        seen.update(id(t) for t in n.outputs.values())
    assert len(g.topological_order()) == len(g.nodes)


def test_each_call_returns_a_new_list() -> None:
    g = _random_graph(random.Random(), 10).validate()
    first = g.topological_order()
    first.reverse()
    first.append(first[0])
    assert g.topological_order() == _reference_order(g)


def test_a_node_added_after_validation_is_in_the_order() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4])
    y = g.exp(x).set_output(True)
    g.validate()
    assert [n.name for n in g.topological_order()] == ["pointwise_0"]
    z = g.relu(y)
    assert [n.name for n in g.topological_order()] == ["pointwise_0", "pointwise_1"]
    z.set_output(True)
    g.validate()
    assert g.topological_order() == _reference_order(g)


def test_edits_to_the_node_list_behind_the_builder_are_seen() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4])
    y = g.exp(x)
    g.relu(y).set_output(True)
    g.validate()
    g.topological_order()
    last = g.nodes.pop()  # a pass pruning in place
    assert [n.name for n in g.topological_order()] == ["pointwise_0"]
    g.nodes.append(last)
    assert [n.name for n in g.topological_order()] == ["pointwise_0", "pointwise_1"]
    g.nodes = [last, g.nodes[0]]  # a new list of the same length, declared reversed
    assert [n.name for n in g.topological_order()] == ["pointwise_0", "pointwise_1"]
    assert g.topological_order() == _reference_order(g)


def test_a_setter_after_validation_drops_the_order() -> None:
    g = fg.Graph(io_data_type=F32)
    a, b = g.tensor("a", [4]), g.tensor("b", [4])
    s = g.add(a, b)
    g.exp(s).set_output(True)
    g.validate()
    before = g.topological_order()
    assert g._order is not None
    s.set_name("renamed")  # any change: the graph is no longer validated, nor its order kept
    assert g._order is None and not g.is_validated
    assert g.topological_order() == before


def test_a_cycle_still_raises() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4])
    y = g.exp(x)
    z = g.relu(y).set_output(True)
    g.validate()
    g.topological_order()
    g.nodes[0].inputs["a"] = z  # rewired behind the builder: a change must be announced
    g._touch()
    with pytest.raises(ValidationError, match="cycle"):
        g.topological_order()
    with pytest.raises(ValidationError, match="cycle"):
        g.validate()

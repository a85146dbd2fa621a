"""Generated names: the graph keeps its taken names as it grows (Graph._unique is O(1)) and
gives exactly the names the old scan of every tensor and node gave, through user-given names
that collide with generated ones, renames, and lists edited behind the graph's back."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.graph.graph import Graph
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict


def _scan_unique(self: Graph, base: str) -> str:
    """The former quadratic _unique: a fresh set of every name on each call."""
    taken = {t.name for t in self.tensors} | {n.name for n in self.nodes}
    while True:
        i = self._counters.get(base, 0)
        self._counters[base] = i + 1
        name = f"{base}_{i}"
        if name not in taken:
            return name


def _chain() -> Graph:
    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [2, 8])
    w = g.tensor("w", [8, 8])
    y = x
    for _ in range(6):
        y = g.relu(g.add(g.matmul(y, w), g.scalar(0.5)))
    y.set_output(True)
    return g


def _collisions() -> Graph:
    """User names that generated names would take next, given before and after them."""
    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    x = g.tensor("relu_1", [4, 4])  # a tensor named like the second ReLU node
    a = g.relu(x, name="relu_0")  # a user node named like the first generated one
    b = g.relu(a)  # must skip relu_0 and relu_1
    c = g.add(b, g.scalar(1.0), name="scalar_1")  # a node named like the next scalar
    d = g.mul(c, g.scalar(2.0))
    e = g.relu(d)
    g.tensor_like(np.zeros((4, 4), np.float32))  # generated tensor name
    g.tensor("tensor_1", [4, 4])
    g.tensor_like(np.zeros((4, 4), np.float32))
    g.relu(e).set_name("relu_4").set_output(True)  # a rename to a name a later node would take
    g.relu(e).set_output(True)
    return g


def _renames() -> Graph:
    """A rename frees a name that generated names then take; renames to duplicates count twice."""
    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [3, 5])
    s = g.scalar(1.5)  # scalar_0
    s2 = g.scalar(2.5)  # scalar_1
    s.set_name("keep")  # frees scalar_0 (the counter has moved on, so it is not reused)
    y = g.add(x, s)
    t = g.tensor("exp_0", [3, 5])
    t.set_name("exp_1")  # frees exp_0, takes exp_1
    z = g.exp(g.add(y, s2))  # exp_0 is free again
    z2 = g.exp(g.add(z, t))  # exp_1 is taken
    u = g.tensor("mul_0", [3, 5])
    v = g.tensor("mul_0_dup", [3, 5]).set_name("mul_0")  # two tensors named mul_0
    u.set_name("free")  # mul_0 is still taken by v
    g.mul(g.mul(z2, u), v).set_output(True)
    return g


def _pruned() -> Graph:
    """Nodes and tensors removed by editing the lists directly (as the torch import does)."""
    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [2, 6])
    a = g.relu(x)
    before = len(g.nodes)
    g.relu(g.relu(a))  # relu_1, relu_2: about to be dropped
    del g.nodes[before:]
    used = {t.name for n in g.nodes for t in (*n.inputs.values(), *n.outputs.values())}
    g.tensors[:] = [t for t in g.tensors if t.name in used]
    b = g.relu(a)  # the counter continues: relu_3
    g._counters["relu"] = 1  # a counter wound back: relu_1 and relu_2 are free again
    c = g.relu(g.relu(b))
    g.tensors = list(g.tensors)  # a new list object
    g.tanh(c).set_output(True)
    return g


def _restored() -> Graph:
    """A graph read back from its dict form, then grown further."""
    g = graph_from_dict(graph_to_dict(_collisions()))
    y = g.tensor_by_name("relu_4")
    y.set_output(False)
    g.sigmoid(g.relu(g.add(y, g.scalar(3.0)))).set_output(True)
    return g


BUILDERS: dict[str, Callable[[], Graph]] = {
    "chain": _chain,
    "collisions": _collisions,
    "renames": _renames,
    "pruned": _pruned,
    "restored": _restored,
}


@pytest.mark.parametrize("which", sorted(BUILDERS))
def test_names_equal_the_scanning_version(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = BUILDERS[which]()
    with monkeypatch.context() as m:
        m.setattr(Graph, "_unique", _scan_unique)
        slow = BUILDERS[which]()
    assert graph_to_dict(fast) == graph_to_dict(slow)
    names = [t.name for t in fast.tensors] + [n.name for n in fast.nodes]
    assert len(names) > 8
    fast.validate()  # no duplicate names came out


def test_kept_names_match_the_lists_after_building() -> None:
    for build in BUILDERS.values():
        g = build()
        g._unique("probe")  # syncs the kept names
        expected: dict[str, int] = {}
        for name in [t.name for t in g.tensors] + [n.name for n in g.nodes]:
            expected[name] = expected.get(name, 0) + 1
        assert g._names == expected


def test_building_does_not_rescan_the_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The taken names are built once, then kept as nodes are added (was a scan per name)."""
    scans = 0
    real = Graph._taken_names

    def counting(self: Graph) -> dict[str, int]:
        nonlocal scans
        if self._names is None or self._names_sync != self._lists_fingerprint():
            scans += 1
        return real(self)

    monkeypatch.setattr(Graph, "_taken_names", counting)
    g = fg.Graph(io_data_type=fg.DataType.FLOAT)
    y = g.tensor("x", [2, 2])
    for _ in range(300):
        y = g.add(g.relu(y), g.scalar(1.0))
    assert len(g.nodes) == 600
    assert scans == 1
    del g.nodes[-1]  # an edit behind the graph's back: one rescan, then kept again
    for _ in range(50):
        y = g.relu(y)
    assert scans == 2

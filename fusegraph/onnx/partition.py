"""Capability partitioning: which nodes run on fusegraph, grouped so that nothing deadlocks.

Nodes are grouped into units. A claimed unit is a connected set of supported nodes; the
unclaimed nodes are grouped the same way into units that run on ONNX Runtime. The rule
(ONNX Runtime's): merging two units must not create a cycle between units, i.e. no
node outside both may lie on a path from one to the other. Units then run in a
topological order of the unit graph.

Greedy in topological order: each node joins the units of its producers when that keeps
the unit graph acyclic; then merges across remaining edges are retried until nothing
changes. Claimed units with fewer nodes than ``min_size`` are released. Everything is
ordered by node position, so the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PNode:
    """What the partitioner needs of a node: its name and the values it reads and writes."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class Group:
    nodes: list[str]  # in the order of the input
    claimed: bool


@dataclass
class Partitioning:
    groups: list[Group]  # in an order that runs (producers first)
    reasons: dict[str, str] = field(default_factory=dict)  # unclaimed node -> why

    @property
    def claimed(self) -> list[Group]:
        return [g for g in self.groups if g.claimed]

    @property
    def unclaimed(self) -> list[Group]:
        return [g for g in self.groups if not g.claimed]


class _Units:
    """Union of nodes into units, with the unit graph kept current for the cycle check.

    The units also keep a topological order (``pos``: unit -> slot, ``slots``: slot -> unit
    or None): a unit can only reach units after it, so the cycle check's search stops at
    the target's slot instead of walking everything downstream of the source (that walk,
    repeated per merge, was 0.14 s of a warm ViT-B/16 session's setup on an H200 host). A
    merge keeps the order valid by moving, inside the window between the two units, those
    reachable from the first one behind the merged unit."""

    def __init__(self, preds: list[set[int]], succs: list[set[int]], label: list[bool]) -> None:
        self.preds, self.succs = preds, succs
        self.label = label
        self._reset(range(len(preds)))

    def _reset(self, nodes: Iterable[int]) -> None:
        n = len(self.preds)
        self.unit = list(range(n))
        self.members: dict[int, list[int]] = {i: [i] for i in range(n)}
        self.lo = list(range(n))
        self.out: dict[int, set[int]] = {i: set(self.succs[i]) for i in range(n)}
        self.inn: dict[int, set[int]] = {i: set(self.preds[i]) for i in range(n)}
        # the nodes come in topological order (_edges checks it): so do the one-node units
        self.pos: dict[int, int] = {i: i for i in range(n)}
        self.slots: list[int | None] = list(range(n))
        self._ordered = True

    def succ_units(self, u: int) -> set[int]:
        return self.out[u]

    def _reaches_indirectly(self, src: int, dst: int) -> bool:
        """A path src -> X -> ... -> dst through at least one other unit X."""
        limit = self.pos[dst]
        if self._ordered and self.pos[src] > limit:
            return False  # dst comes first: nothing after src reaches it
        stack = [u for u in self.out[src] if u != dst]
        seen = set(stack)
        while stack:
            u = stack.pop()
            if self._ordered and self.pos[u] > limit:
                continue  # after dst in the order: reaches nothing before it
            for v in self.out[u]:
                if v == dst:
                    return True
                if v != src and v not in seen:
                    seen.add(v)
                    stack.append(v)
        return False

    def can_merge(self, a: int, b: int) -> bool:
        if a == b or self.label[a] != self.label[b]:
            return False
        return not self._reaches_indirectly(a, b) and not self._reaches_indirectly(b, a)

    def merge(self, a: int, b: int) -> int:
        """Merges two units; the caller makes sure that no path between them passes another
        unit (``can_merge``), or calls ``split`` (which orders the units afresh)."""
        keep, gone = (a, b) if a < b else (b, a)
        if self._ordered:
            self._reorder(a, b, keep)
        for i in self.members[gone]:
            self.unit[i] = keep
        self.members[keep] = sorted(self.members[keep] + self.members.pop(gone))
        self.lo[keep] = min(self.lo[keep], self.lo[gone])
        for w in self.out.pop(gone):
            self.inn[w].discard(gone)
            if w != keep:
                self.inn[w].add(keep)
                self.out[keep].add(w)
        for w in self.inn.pop(gone):
            self.out[w].discard(gone)
            if w != keep:
                self.out[w].add(keep)
                self.inn[keep].add(w)
        self.out[keep].discard(keep)
        self.inn[keep].discard(keep)
        self.out[keep].discard(gone)
        self.inn[keep].discard(gone)
        return keep

    def _reorder(self, a: int, b: int, keep: int) -> None:
        """The order after merging ``a`` and ``b`` into ``keep``: in the window between the
        two, the units reachable from the earlier one go behind the merged unit, the rest
        (the later one's ancestors among them) before it, each side in its old order."""
        first, last = (a, b) if self.pos[a] < self.pos[b] else (b, a)
        lo, hi = self.pos[first], self.pos[last]
        below: set[int] = set()  # reachable from ``first`` inside the window
        stack = [u for u in self.out[first] if self.pos[u] < hi]
        below.update(stack)
        while stack:
            for v in self.out[stack.pop()]:
                if v not in below and self.pos[v] < hi:
                    below.add(v)
                    stack.append(v)
        window = [u for u in self.slots[lo + 1:hi] if u is not None]
        new = [u for u in window if u not in below] + [keep] + [u for u in window if u in below]
        for k in range(lo, hi + 1):
            self.slots[k] = None
        for k, u in enumerate(new):
            self.slots[lo + k] = u
            self.pos[u] = lo + k
        del self.pos[keep ^ a ^ b]  # the unit merged away

    def _order_afresh(self) -> None:
        """A topological order of the current unit graph (after merges that did not keep one)."""
        from fusegraph.graph.order import ranked_order

        ids = list(self.members)
        at = {u: k for k, u in enumerate(ids)}
        order = ranked_order([[at[v] for v in self.out[u]] for u in ids], [self.lo[u] for u in ids])
        if len(order) != len(ids):
            raise AssertionError("partitioning produced a cycle between units (a bug)")
        self.slots = [ids[k] for k in order]
        self.pos = {ids[j]: k for k, j in enumerate(order)}
        self._ordered = True

    def split(self, u: int) -> None:
        """Releases a unit's nodes back to single-node units (rebuilding the unit graph)."""
        groups = [m for k, m in self.members.items() if k != u]
        self._reset(range(len(self.preds)))
        self._ordered = False  # the groups are merged back in node order, not along edges
        for m in groups:
            for i in m[1:]:
                self.merge(self.unit[m[0]], self.unit[i])
        self._order_afresh()


def _edges(nodes: Sequence[PNode]) -> tuple[list[set[int]], list[set[int]]]:
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.outputs:
            if o:
                producer[o] = i
    preds: list[set[int]] = [set() for _ in nodes]
    succs: list[set[int]] = [set() for _ in nodes]
    for i, n in enumerate(nodes):
        for v in n.inputs:
            p = producer.get(v)
            if p is not None and p != i:
                if p > i:
                    raise ValueError(f"nodes are not in topological order: '{nodes[p].name}' feeds '{n.name}'")
                preds[i].add(p)
                succs[p].add(i)
    return preds, succs


def _grow(units: _Units, eligible: Sequence[int]) -> None:
    """Each eligible node joins its producers' units (same label) where no cycle arises."""
    for i in eligible:
        for p in sorted(units.preds[i]):
            a, b = units.unit[i], units.unit[p]
            if units.label[b] == units.label[a] and a != b and units.can_merge(a, b):
                units.merge(a, b)


def _close(units: _Units, members: Sequence[int]) -> None:
    """Retries merges across every remaining edge until none applies (maximality)."""
    changed = True
    while changed:
        changed = False
        for i in members:
            for s in sorted(units.succs[i]):
                a, b = units.unit[i], units.unit[s]
                if a != b and units.label[a] == units.label[b] and units.can_merge(a, b):
                    units.merge(a, b)
                    changed = True


def partition(
    nodes: Sequence[PNode],
    reasons: Mapping[str, str | None],
    *,
    min_size: int = 1,
) -> Partitioning:
    """Groups ``nodes`` (topologically ordered); ``reasons[name]`` is None for a node that
    fusegraph can run, else why not."""
    preds, succs = _edges(nodes)
    supported = [reasons.get(n.name) is None for n in nodes]
    units = _Units(preds, succs, supported)
    claimed_idx = [i for i, ok in enumerate(supported) if ok]
    _grow(units, claimed_idx)
    _close(units, claimed_idx)
    why: dict[str, str] = {n.name: r for n, r in zip(nodes, (reasons.get(n.name) for n in nodes), strict=True) if r}
    for u in sorted({units.unit[i] for i in claimed_idx}):
        size = len(units.members[u])
        if size < min_size:
            for i in units.members[u]:
                units.label[i] = False
                why[nodes[i].name] = (
                    f"its claimed subgraph has {size} node(s), fewer than min_subgraph_size={min_size}"
                )
            units.split(u)
    # Unclaimed nodes are grouped too, so each ONNX Runtime sub-model is as large as it can be.
    units.label = [units.label[units.unit[i]] if supported[i] else False for i in range(len(nodes))]
    rest = [i for i in range(len(nodes)) if not units.label[i]]
    _grow(units, rest)
    _close(units, rest)
    order = _unit_order(units)
    groups = [
        Group([nodes[i].name for i in units.members[u]], bool(units.label[u])) for u in order
    ]
    return Partitioning(groups, why)


def _unit_order(units: _Units) -> list[int]:
    """The units in dependency order, lowest first node first."""
    from fusegraph.graph.order import ranked_order

    ids = list(units.members)
    at = {u: k for k, u in enumerate(ids)}
    order = ranked_order([[at[v] for v in units.succ_units(u)] for u in ids], [units.lo[u] for u in ids])
    if len(order) != len(ids):
        raise AssertionError("partitioning produced a cycle between units (a bug)")
    return [ids[k] for k in order]

"""A graph into candidate regions along what the engines fuse (regions/pattern.py):
each anchor (convolution, matmul, attention, norm, softmax, a backward op) with the
pointwise epilogue that follows it, then the pointwise / reduction chains no anchor
took. Deterministic (nodes visited in one topological order, ordered containers only)
and cycle-safe: a node joins a region only if no path leaves the region and comes back
through it, counting paths through code outside fusegraph's graph (``opaque``), so
every region can run as one step between the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusegraph.errors import ValidationError
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.order import ranked_order
from fusegraph.regions import pattern
from fusegraph.regions.subgraph import Whole, cut


@dataclass(frozen=True)
class Region:
    """One candidate region: its nodes (names in the parent, topological order), the
    standalone subgraph and its content key, and the pattern it matches."""

    index: int
    nodes: tuple[str, ...]
    pattern: str
    graph: Graph
    key: str
    inputs: tuple[str, ...]  # parent tensors the subgraph's in0, in1, ... stand for
    outputs: tuple[str, ...]  # parent tensors its out0, out1, ... stand for


@dataclass(frozen=True)
class Rejection:
    """Nodes no region can take, and why."""

    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Split:
    regions: tuple[Region, ...]
    rejected: tuple[Rejection, ...]


class _Dag:
    """Node dependencies as ancestor bitsets over one topological order. Code outside the
    graph (``opaque``) is one pseudo node per graph input it computes: never in a region,
    so a path through it splits regions like a path through any other outside node."""

    def __init__(self, graph: Graph, opaque: Mapping[str, Sequence[str]]) -> None:
        nodes = list(graph.nodes)
        producer = {t.name: k for k, n in enumerate(nodes) for t in n.outputs.values()}
        # vertices: real nodes 0..len(nodes)-1, then one per opaque input
        pseudo = [name for name in opaque if name not in producer]
        index = {name: len(nodes) + j for j, name in enumerate(pseudo)}
        preds: list[dict[int, None]] = [{} for _ in range(len(nodes) + len(pseudo))]
        rank: list[float] = [float(k) for k in range(len(nodes))] + [float("inf")] * len(pseudo)
        for k, n in enumerate(nodes):
            for t in n.inputs.values():
                if t.name in producer:
                    preds[k].setdefault(producer[t.name])
                if t.name in index:
                    v = index[t.name]
                    preds[k].setdefault(v)
                    rank[v] = min(rank[v], k - 0.5)
        for name, v in index.items():
            for src in opaque[name]:
                if src in producer:
                    preds[v].setdefault(producer[src])
        order = _kahn(preds, rank)
        self.real = len(nodes)
        self.vertex = order  # position -> vertex
        at = {v: i for i, v in enumerate(order)}
        self.order = [nodes[v] if v < len(nodes) else None for v in order]
        self.preds: list[list[int]] = [[at[p] for p in preds[v]] for v in order]
        self.anc: list[int] = []
        self.consumers: list[list[int]] = [[] for _ in order]
        for i, ps in enumerate(self.preds):
            bits = 0
            for p in ps:
                bits |= self.anc[p] | (1 << p)
                self.consumers[p].append(i)
            self.anc.append(bits)

    def can_join(self, members: int, i: int) -> bool:
        """Whether node ``i`` may join the region ``members`` (a bitset) without a path
        from the region to ``i`` (or from ``i`` to the region) through a node outside it."""
        for p in self.preds[i]:
            if not (members >> p) & 1 and self.anc[p] & members:
                return False  # region -> p -> i, p outside
        bit = 1 << i
        m = members
        while m:
            low = m & -m
            r = low.bit_length() - 1
            m ^= low
            if self.anc[r] & bit:
                # i -> ... -> r: allowed only when every path stays inside region + {i}
                for p in self.preds[r]:
                    if not (members >> p) & 1 and p != i and self.anc[p] & bit:
                        return False
        return True


def _kahn(preds: Sequence[dict[int, None]], rank: Sequence[float]) -> list[int]:
    """A topological order, ties broken by ``rank`` then vertex number: deterministic."""
    succ: list[list[int]] = [[] for _ in preds]
    for v, ps in enumerate(preds):
        for p in ps:
            succ[p].append(v)
    order = ranked_order(succ, rank)
    if len(order) != len(preds):
        raise ValidationError("the graph and the code outside it (opaque) depend on each other in a cycle")
    return order


def split(
    graph: Graph, *, opaque: Mapping[str, Sequence[str]] | None = None, atoms: Mapping[str, str] | None = None,
    movement: bool = True, whole: Whole | None = None,
) -> Split:
    """Candidate regions of the validated ``graph``. ``opaque`` maps a graph input that
    code outside the graph computes to the graph tensors that code reads (directly or
    not): the torch front door passes the ATen nodes fusegraph does not convert this way.
    ``atoms`` names, for nodes that must stay together (the graph nodes one ATen node
    became), a group: a node joins or starts a region with its whole group, or not at all.
    ``movement=False`` leaves reshapes and transposes out of every region, for a front door
    whose engines take none (cuDNN and the Triton row kernel): around them the caller's own
    code moves the data, a view costing nothing there, and the regions keep their compute.
    ``whole``: the graph's :class:`Whole`, where the caller cuts more pieces of it afterwards
    (``region_pieces.cuts``): serialized once, and contents validated once for both."""
    graph.ensure_valid()
    graph.topological_order()  # raises on a cycle inside the graph
    dag = _Dag(graph, opaque or {})
    owner: dict[int, int] = {}  # node position -> region number
    members: list[int] = []  # region number -> bitset of node positions
    kinds: list[str] = []  # "anchor" or "chain"

    group_of: dict[str, list[int]] = {}
    for i, n in enumerate(dag.order):
        if n is not None and atoms and n.name in atoms:
            group_of.setdefault(atoms[n.name], []).append(i)

    def group(i: int) -> list[int]:
        n = dag.order[i]
        assert n is not None
        mates = group_of.get(atoms[n.name], [i]) if atoms and n.name in atoms else [i]
        return [j for j in mates if j not in owner]

    def new_region(i: int, kind: str) -> None:
        members.append(0)
        kinds.append(kind)
        for j in group(i):
            owner[j] = len(members) - 1
            members[-1] |= 1 << j

    def join(r: int, i: int) -> bool:
        """Adds ``i`` and its group to region ``r`` if the region stays convex."""
        bits = members[r]
        todo = group(i)
        if len(todo) > 1 and any(pattern.is_anchor(dag.order[j]) for j in todo):  # type: ignore[arg-type]
            return False  # a group holding an anchor starts its own region
        for j in todo:
            if not dag.can_join(bits, j):
                return False
            bits |= 1 << j
        for j in todo:
            owner[j] = r
        members[r] = bits
        return True

    # 1. anchors and their epilogues
    for i, n in enumerate(dag.order):
        if n is None or i in owner or not pattern.is_anchor(n):
            continue
        new_region(i, "anchor")
        if n.kind not in pattern.EPILOGUE_ANCHORS:
            continue
        r = owner[i]
        frontier = _bits(members[r])
        while frontier:
            j = frontier.pop(0)
            for c in dag.consumers[j]:
                node = dag.order[c]
                if node is None or c in owner or not pattern.joins_epilogue(node):
                    continue
                if not movement and pattern.is_movement(node):
                    continue
                before = members[r]
                if join(r, c):
                    frontier += _bits(members[r] & ~before)
    # 2. what is left: pointwise / reduction / movement chains
    for i, n in enumerate(dag.order):
        if n is None or i in owner or not pattern.joins_chain(n) or (not movement and pattern.is_movement(n)):
            continue
        placed = False
        for p in dag.preds[i]:
            home = owner.get(p)
            if home is not None and kinds[home] == "chain" and join(home, i):
                placed = True
                break
        if not placed:
            new_region(i, "chain")
    keep = frozenset(t.name for t in graph.outputs())
    opaque_reads = {src for srcs in (opaque or {}).values() for src in srcs}
    regions: list[Region] = []
    rejected: list[Rejection] = []
    real = [(i, n) for i, n in enumerate(dag.order) if n is not None]
    readers: dict[str, set[int | None]] = {}  # tensor -> the regions of the nodes reading it
    for i, n in real:
        for t in _reads(n):
            readers.setdefault(t, set()).add(owner.get(i))
    if whole is None:
        whole = Whole(graph)  # serialized and indexed once: every piece is cut from it
    in_region: dict[int, list[Node]] = {}
    for i, n in real:
        if i in owner:
            in_region.setdefault(owner[i], []).append(n)
    for r in range(len(members)):
        nodes = in_region.get(r, [])
        names = tuple(n.name for n in nodes)
        name = pattern.pattern_name(nodes)
        if name == pattern.MOVEMENT_ONLY:
            rejected.append(Rejection(names, "data movement only (reshape/transpose): nothing to compute or fuse"))
            continue
        written = [t.name for n in nodes for t in n.outputs.values()]
        leaves = {t for t in written if t in keep or t in opaque_reads or readers.get(t, set()) - {r}}
        piece = cut(graph, nodes, leaves, f"{graph.name}.r{len(regions)}", whole)
        regions.append(Region(len(regions), names, name, piece.graph, piece.graph.key(), piece.inputs, piece.outputs))
    left = [n for i, n in real if i not in owner]
    moved = tuple(n.name for n in left if not movement and pattern.is_movement(n))
    if moved:
        rejected.append(Rejection(moved, "data movement stays outside regions here (no engine of this front door takes it)"))
    leftover = tuple(n.name for n in left if n.name not in moved)
    if leftover:
        rejected.append(Rejection(leftover, "no pattern takes these ops"))
    return Split(tuple(regions), tuple(rejected))


def _bits(m: int) -> list[int]:
    """The positions set in the bitset ``m``, lowest first (without a scan of every node)."""
    out = []
    while m:
        low = m & -m
        out.append(low.bit_length() - 1)
        m ^= low
    return out


def _reads(n: Node) -> list[str]:
    return [t.name for t in n.inputs.values()]

"""A claimed unit's graph as the pieces that run it (plan_regions.py): the regions the
region layer split off, each a ``Piece`` once chosen, and the nodes no region took, cut out
as graphs of their own (``Cut``, run op by op); ``run_order`` puts the pieces in an order
that runs, or says there is none (``NoRegions``: the unit is then built whole).

Why a module: what a piece is and how pieces are cut and ordered is graph bookkeeping,
apart from choosing, building and running them (plan_regions.py); tests replace
``run_order`` here to force a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.order import ranked_order
from fusegraph.regions.subgraph import Whole, cut


class NoRegions(Exception):
    """The unit cannot run region by region (its steps would depend on each other in a
    cycle, a piece failed to cut): it is built whole, as without regions."""


@dataclass
class Piece:
    """A step to be: nodes of the unit's graph, their standalone graph, what runs it."""

    nodes: tuple[str, ...]  # graph node names
    graph: Graph
    inputs: tuple[str, ...]  # parent tensors of in0, in1, ...
    outputs: tuple[str, ...]  # parent tensors of out0, out1, ...
    plan: ExecutionPlan
    where: str
    pattern: str
    why: str
    source: str = ""
    fusegraph_ms: float | None = None
    incumbent_ms: float | None = None
    movement: bool = False  # reshapes / transposes alone


@dataclass(frozen=True)
class Cut:
    """Nodes no region took, cut out as a graph of their own (run op by op)."""

    nodes: tuple[str, ...]
    graph: Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reason: str
    movement: bool


def cuts(graph: Graph, rejected: Sequence[Any], whole: Whole | None = None) -> list[Cut]:
    """The nodes of ``graph`` no region took (``rejected``: split's rejections), as graphs: data
    movement together, the rest one by one. ``whole``: the graph's ``Whole`` the split cut its
    regions from, where the caller has it (serialized once)."""
    out: list[Cut] = []
    whole = whole if whole is not None else Whole(graph)
    outputs = {t.name for t in graph.outputs()}
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        for t in n.inputs.values():
            readers.setdefault(t.name, set()).add(n.name)
    by_name = {n.name: n for n in graph.nodes}
    for rej in rejected:
        movement = rej.reason.startswith("data movement only")
        groups = [list(rej.nodes)] if movement else [[n] for n in rej.nodes]
        for names in groups:
            nodes = [by_name[n] for n in names]
            keep = _leaves(nodes, readers, outputs)
            try:
                piece = cut(graph, nodes, keep, f"{graph.name}.x{len(out)}", whole)
            except Exception as exc:
                raise NoRegions(f"nodes {names} could not be cut out: {type(exc).__name__}: {exc}") from exc
            out.append(Cut(tuple(names), piece.graph, tuple(piece.inputs), tuple(piece.outputs), rej.reason,
                           movement))
    return out


def _leaves(nodes: Sequence[Node], readers: Mapping[str, set[str]], outputs: set[str]) -> set[str]:
    """Tensors ``nodes`` write that the graph returns or other nodes read."""
    inside = {n.name for n in nodes}
    return {t.name for n in nodes for t in n.outputs.values()
            if t.name in outputs or readers.get(t.name, set()) - inside}


def run_order(pieces: Sequence[Piece], graph: Graph) -> list[int]:
    """The pieces in an order that runs (producers first; ties by the graph's node order).
    A cycle between pieces -- each convex, together not -- means no region plan."""
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    producer = {t: i for i, p in enumerate(pieces) for t in p.outputs}
    succ: list[set[int]] = [set() for _ in pieces]
    for i, p in enumerate(pieces):
        for t in p.inputs:
            j = producer.get(t)
            if j is not None and j != i:
                succ[j].add(i)
    order = ranked_order([sorted(s) for s in succ], [min(position[n] for n in p.nodes) for p in pieces])
    if len(order) != len(pieces):
        raise NoRegions("its regions depend on each other in a cycle")
    return order


__all__ = ["Cut", "NoRegions", "Piece", "cuts", "run_order"]

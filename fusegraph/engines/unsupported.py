"""What each built-in engine declares it cannot run, with the reason: the other half of the
op table's coverage.

Every ``OpKind`` and every ``PointwiseMode`` of graph/ops.py is either implemented by an
engine (a row in its lowering table: ``reference.ops.REFERENCE`` / ``POINTWISE_FNS``,
``engines.iree.emit.LOWER`` / ``lower_pointwise.POINTWISE_LOWER``, the torch engine's
``LOWER`` and pointwise table) or listed here for that engine with the reason.
tests/test_layers.py names every (engine, op) that is neither. Selection refuses a graph
holding a declared op on that engine with the reason given here (select/api.py), before
the engine is asked, so an engine need not repeat the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusegraph.graph.ops import OpKind, PointwiseAttrs, PointwiseMode

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

Op = OpKind | PointwiseMode

# engine -> op or pointwise mode -> why the engine does not run it. Empty today: the three
# built-in engines implement the whole table.
UNSUPPORTED: dict[str, dict[Op, str]] = {
    "reference": {},
    "iree": {},
    "torch": {},
}


def declared_unsupported(engine: str, graph: Graph) -> str | None:
    """The first node of ``graph`` that ``engine`` declares it cannot run, as a reason."""
    table = UNSUPPORTED.get(engine)
    if not table:
        return None
    for node in graph.nodes:
        op: Op = node.attrs.mode if isinstance(node.attrs, PointwiseAttrs) else node.kind
        why = table.get(op)
        if why is not None:
            return f"node '{node.name}' ({op.value}): {why}"
    return None

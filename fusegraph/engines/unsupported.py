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

_ROW_KERNEL_ONLY = (
    "the triton engine generates row kernels (pointwise ops around softmax, norms and trailing "
    "reductions); other ops go to cudnn or torch"
)

# engine -> op or pointwise mode -> why the engine does not run it. The reference, IREE and
# torch engines implement the whole table; the cudnn engine answers from cuDNN itself
# (engines/cudnn/lower.py); triton is a row-kernel generator by design.
UNSUPPORTED: dict[str, dict[Op, str]] = {
    "reference": {},
    "iree": {},
    "torch": {},
    "triton": {
        k: _ROW_KERNEL_ONLY
        for k in OpKind
        if k not in (OpKind.POINTWISE, OpKind.SOFTMAX, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.REDUCTION)
    },
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

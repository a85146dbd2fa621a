"""Matmul: batch-broadcasting ``torch.aten.matmul`` in the compute type."""

from __future__ import annotations

from fusegraph.engines.iree.lower_base import Lowering, identity
from fusegraph.graph.node import Node


def lower_matmul(ctx: Lowering, node: Node) -> None:
    at, bt, ct_ = node.inputs["a"], node.inputs["b"], node.outputs["c"]
    ct = ctx.compute_type(node, at.dtype, bt.dtype)
    # Operands in logical order: a transposed operand (column-major B...) becomes a
    # transpose that IREE folds into the contraction's indexing maps.
    a = ctx.cast(ctx.get(at, identity(len(at.shape)), full=True), ct)
    b = ctx.cast(ctx.get(bt, identity(len(bt.shape)), full=True), ct)
    c = ctx.b.aten("matmul", [a, b], ct_.shape, ct, identity(len(ct_.shape)))
    ctx.set(ct_, c)

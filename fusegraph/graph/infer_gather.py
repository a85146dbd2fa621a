"""Shape and dtype inference of the indexing ops (gather and its backward), with checks
that name the culprit.

Index values are data, so only what the graph can see is checked here: the index type,
the axis, the dims, and the values of a constant index (``g.scalar``), which must lie in
``[-n, n)``. Values fed at run time are checked by the engines (reference/ops.py raises
ExecutionError naming the indices).
"""

from __future__ import annotations

from collections.abc import Callable

from fusegraph.dtypes import DataType
from fusegraph.graph.infer_base import Proposal, fail
from fusegraph.graph.node import Node
from fusegraph.graph.ops import GatherAttrs, GatherBackwardAttrs, OpKind
from fusegraph.graph.tensor import TensorAttr

INDEX_TYPES = frozenset({DataType.INT32, DataType.INT64})


def _indices(node: Node, rows: int, what: str) -> TensorAttr:
    """The node's ``indices``: INT32 or INT64, and a constant one in ``[-rows, rows)``."""
    idx = node.inputs["indices"]
    if idx.dtype not in INDEX_TYPES:
        raise fail(node, f"indices must be INT32 or INT64, got {idx.dtype.name}", idx)
    if idx.is_scalar and isinstance(idx.value, int) and not -rows <= idx.value < rows:
        raise fail(node, f"constant index {idx.value} is out of range for {what} of {rows} rows ([-{rows}, {rows}))", idx)
    return idx


def infer_gather(node: Node) -> Proposal:
    data = node.inputs["data"]
    attrs = node.attrs
    assert isinstance(attrs, GatherAttrs)
    rank = len(data.shape)
    if not -rank <= attrs.axis < rank:
        raise fail(node, f"gather axis {attrs.axis} is out of range for data of rank {rank} ([-{rank}, {rank}))", data)
    axis = attrs.axis % rank
    idx = _indices(node, data.shape[axis], f"axis {axis} of '{data.name}'")
    return {"y": ((*data.shape[:axis], *idx.shape, *data.shape[axis + 1:]), data.dtype)}


def infer_gather_backward(node: Node) -> Proposal:
    dy = node.inputs["dy"]
    attrs = node.attrs
    assert isinstance(attrs, GatherBackwardAttrs)
    if attrs.axis != 0:
        raise fail(node, f"gather_backward supports axis 0 only (an embedding's rows), got axis {attrs.axis}")
    if attrs.num_rows < 1:
        raise fail(node, f"num_rows must be >= 1, got {attrs.num_rows}")
    n = attrs.num_rows
    if attrs.padding_idx is not None and not -n <= attrs.padding_idx < n:
        raise fail(node, f"padding_idx {attrs.padding_idx} is out of range for {n} rows ([-{n}, {n}))")
    idx = _indices(node, n, "the gradient's axis 0")
    if not dy.dtype.is_float:
        raise fail(node, f"dy must be floating-point, got {dy.dtype.name}", dy)
    k = len(idx.shape)
    if len(dy.shape) <= k or tuple(dy.shape[:k]) != tuple(idx.shape):
        raise fail(
            node,
            f"dy dims {list(dy.shape)} must start with the indices' dims {list(idx.shape)} and have at least "
            "one more (the gathered row)",
            dy,
        )
    return {"d_data": ((n, *dy.shape[k:]), dy.dtype)}


GATHER_INFER: dict[OpKind, Callable[[Node], Proposal]] = {
    OpKind.GATHER: infer_gather,
    OpKind.GATHER_BACKWARD: infer_gather_backward,
}

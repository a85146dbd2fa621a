"""What every op's shape and dtype inference shares: the error naming the node and tensor,
NumPy broadcasting, and the rules for operand types (stated types must agree, inferred ones
are promoted)."""

from __future__ import annotations

from collections.abc import Sequence

from fusegraph.dtypes import DataType, family, promote
from fusegraph.errors import ValidationError
from fusegraph.graph.node import Node
from fusegraph.graph.tensor import TensorAttr

Dims = tuple[int, ...]
Proposal = dict[str, tuple[Dims, DataType]]


def fail(node: Node, msg: str, tensor: TensorAttr | None = None) -> ValidationError:
    return ValidationError(msg, node=node.name, tensor=tensor.name if tensor else None)


def broadcast_dims(shapes: Sequence[Sequence[int]]) -> Dims | None:
    """NumPy broadcasting of several shapes, or None when they do not broadcast."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s):
            j = rank - len(s) + i
            if d == 1:
                continue
            if out[j] not in (1, d):
                return None
            out[j] = d
    return tuple(out)


def stated_type(t: TensorAttr) -> bool:
    """False for a node's output whose type was inferred (the graph's intermediate or I/O
    type): engines convert those, so they never clash with a type the user stated."""
    return t.producer is None or t.dtype_set


def same_type(node: Node, *tensors: TensorAttr) -> DataType:
    """The operands' common type: stated types must agree; inferred ones are promoted."""
    stated = [t for t in tensors if stated_type(t)]
    first = stated[0] if stated else tensors[0]
    for t in stated:
        if t.dtype != first.dtype:
            raise fail(
                node,
                f"data type mismatch: {t.dtype.name} here but {first.dtype.name} on "
                f"'{first.name}'",
                t,
            )
    dt = first.dtype
    for t in tensors:
        if family(t.dtype) != family(dt):
            raise fail(node, f"data type mismatch: {t.dtype.name} with {dt.name} on '{first.name}'", t)
        dt = promote(dt, t.dtype)
    return dt


def same_float_type(node: Node, *tensors: TensorAttr) -> DataType:
    for t in tensors:
        if not t.dtype.is_float:
            raise fail(node, f"expected a floating-point tensor, got {t.dtype.name}", t)
    return same_type(node, *tensors)



def stats_dtype(x: DataType) -> DataType:
    """Saved statistics (means, inverse variances, softmax statistics) are float32, float64 for float64."""
    return DataType.DOUBLE if x == DataType.DOUBLE else DataType.FLOAT

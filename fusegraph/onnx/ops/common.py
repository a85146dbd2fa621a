"""Helpers every lowering family uses: element types, attribute lists, reshapes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from fusegraph.dtypes import DataType
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.table import Unmappable

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


_ELEM_TO_DT: dict[int, DataType] = {
    onnx.TensorProto.FLOAT: DataType.FLOAT,
    onnx.TensorProto.FLOAT16: DataType.HALF,
    onnx.TensorProto.BFLOAT16: DataType.BFLOAT16,
    onnx.TensorProto.DOUBLE: DataType.DOUBLE,
    onnx.TensorProto.INT8: DataType.INT8,
    onnx.TensorProto.UINT8: DataType.UINT8,
    onnx.TensorProto.INT16: DataType.INT16,
    onnx.TensorProto.INT32: DataType.INT32,
    onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.BOOL: DataType.BOOLEAN,
}


def data_type_of(elem: int, what: str) -> DataType:
    dt = _ELEM_TO_DT.get(elem)
    if dt is None:
        name = onnx.TensorProto.DataType.Name(elem) if elem else "unknown"
        raise Unmappable(f"{what} has element type {name}, which fusegraph does not run")
    return dt


def text_attr(node: ONode, name: str, default: str) -> str:
    v = node.attr(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def ints(v: Any) -> list[int]:
    return [int(x) for x in v]


def spatial_attrs(imp: Importer, node: ONode, in_sp: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """(stride, pre_padding, post_padding) from strides/pads/auto_pad."""
    nsp = len(in_sp)
    stride = ints(node.attr("strides", [1] * nsp))
    pads = ints(node.attr("pads", [0] * (2 * nsp)))
    if len(stride) != nsp or len(pads) != 2 * nsp:
        raise Unmappable(f"{node.op_type}: strides={stride} / pads={pads} do not fit {nsp} spatial axes")
    auto = node.attr("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto == "VALID":
        pads = [0] * (2 * nsp)
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        pre, post = [], []
        for x, k, s, d in zip(in_sp, kernel, stride, dilation, strict=True):
            out = -(-x // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - x, 0)
            small, big = total // 2, total - total // 2
            pre.append(small if auto == "SAME_UPPER" else big)
            post.append(big if auto == "SAME_UPPER" else small)
        pads = pre + post
    elif auto != "NOTSET":
        raise Unmappable(f"{node.op_type}: auto_pad={auto!r} is not an ONNX value")
    return stride, pads[:nsp], pads[nsp:]


def per_channel(arr: np.ndarray, rank: int) -> np.ndarray:
    """A [C] vector as [1, C, 1, ...] for a rank-``rank`` activation."""
    return arr.reshape((1, -1) + (1,) * (rank - 2))


def reshape(imp: Importer, t: TensorAttr, dims: Sequence[int]) -> TensorAttr:
    if tuple(t.dim) == tuple(dims):
        return t
    return imp.g.reshape(t, list(dims))


def channel_vector(imp: Importer, name: str, rank: int) -> TensorAttr:
    if imp.is_const(name):
        return imp.constant(per_channel(imp.og.constants[name], rank), name)
    t = imp.tensor(name, "plain")
    return reshape(imp, t, (1, t.dim[0]) + (1,) * (rank - 2))


def is_read(imp: Importer, name: str) -> bool:
    return name in imp.og.outputs or any(name in n.all_inputs() for n in imp.og.nodes)


def rows(imp: Importer, x: TensorAttr, axis: int) -> tuple[TensorAttr, int, int]:
    dims = x.dim
    outer, inner = math.prod(dims[:axis]), math.prod(dims[axis:])
    return reshape(imp, x, (outer, inner)), outer, inner


def out_rank(imp: Importer, node: ONode) -> int:
    return max(len(imp.shape(i)) for i in node.inputs if i)


def out_dims(imp: Importer, node: ONode) -> tuple[int, ...]:
    return imp.shape(node.outputs[0])


def broadcast_to(imp: Importer, x: TensorAttr, out: Sequence[int]) -> TensorAttr:
    """``x`` broadcast to dims ``out``: x times a constant 1 (and with true, for booleans)
    whose dims are the expanded axes only, so it is as small as the broadcast allows; exact
    for every value (NaN, inf, -0.0)."""
    aligned = (1,) * (len(out) - len(x.dim)) + tuple(x.dim)
    grow = tuple(o if a == 1 and o != 1 else 1 for a, o in zip(aligned, out, strict=True))
    if all(g == 1 for g in grow):
        return reshape(imp, x, out)
    one = imp.constant(np.ones(grow, dtype=x.dtype.numpy), "broadcast_one")
    return imp.g.logical_and(x, one) if x.dtype == DataType.BOOLEAN else imp.g.mul(x, one)

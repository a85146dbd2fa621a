"""Pooling, channels-last as linalg named ops (``pooling_n*c_max`` / ``_sum``).

Asymmetric padding is an explicit ``tensor.pad`` (with -inf for max); average pooling
divides the window sum by the window size, or (AVG_EXCLUDE_PAD) by a constant tensor of
per-position counts of real elements, computed here since shapes are static.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.iree.lower_base import Lowering, Val, float_literal, tensor_type
from fusegraph.engines.iree.lower_conv import channels_last, trim_unit_windows
from fusegraph.graph.node import Node
from fusegraph.graph.ops import PoolingAttrs, PoolingMode

_SPATIAL = {1: "w", 2: "hw", 3: "dhw"}


def _dense(values: tuple[int, ...]) -> str:
    return f"dense<[{', '.join(map(str, values))}]> : tensor<{len(values)}xi64>"


def valid_counts(attrs: PoolingAttrs, in_sp: tuple[int, ...], out_sp: tuple[int, ...]) -> np.ndarray:
    """How many real (unpadded) elements each output position's window covers."""
    valid = np.pad(np.ones(in_sp), list(zip(attrs.pre_padding, attrs.post_padding, strict=True)))
    count = np.zeros(out_sp)
    for kpos in itertools.product(*(range(w) for w in attrs.window)):
        sl = tuple(slice(k, k + s * (o - 1) + 1, s) for k, s, o in zip(kpos, attrs.stride, out_sp, strict=True))
        count += valid[sl]
    return count


def _count_literal(ctx: Lowering, counts: np.ndarray, dtype: DataType, shape: tuple[int, ...]) -> Val:
    """A dense constant tensor (channels-last [1, spatial..., 1]) of the counts."""
    flat = ", ".join(float_literal(float(v), dtype) for v in counts.reshape(-1))
    name = ctx.b.fresh("counts")
    ctx.b.line(
        f"{name} = torch.vtensor.literal(dense<[{flat}]> : tensor<{counts.size}x{dtype.mlir}>)"
        f" : !torch.vtensor<[{counts.size}],{dtype.mlir}>"
    )
    flat_val = Val(name, (counts.size,), dtype, (0,))
    return ctx.reshape(flat_val, shape, channels_last(len(shape)))


def lower_pooling(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    xt, yt = node.inputs["x"], node.outputs["y"]
    rank = len(xt.shape)
    nsp = rank - 2
    ct = ctx.compute_type(node, xt.dtype)
    if not ct.is_float:
        ct = ctx.compute_type(node, DataType.FLOAT)
    cl = channels_last(rank)
    x = ctx.cast(ctx.get(xt, cl, full=True), ct)
    is_max = attrs.mode == PoolingMode.MAX
    fill = -math.inf if is_max else 0.0
    low, high = (0, *attrs.pre_padding, 0), (0, *attrs.post_padding, 0)
    xb, padded = ctx.pad_builtin(ctx.to_builtin(x), x.shape, ct, low, high, fill)
    out_shape = tuple(yt.shape[a] for a in cl)
    xb, padded = trim_unit_windows(ctx, xb, padded, ct, out_shape[1:-1], tuple(attrs.window), (1,) * nsp)
    acc = ctx.filled(out_shape, ct, fill)
    b = ctx.b
    window = b.fresh("window")
    win_ty = tensor_type(attrs.window, ct)
    b.line(f"{window} = tensor.empty() : {win_ty}")
    op = f"pooling_n{_SPATIAL[nsp]}c_{'max' if is_max else 'sum'}"
    res = b.fresh("pool")
    ty_out = tensor_type(out_shape, ct)
    dil = (1,) * nsp
    b.line(
        f"{res} = linalg.{op} {{dilations = {_dense(dil)}, strides = {_dense(attrs.stride)}}}"
        f" ins({xb}, {window} : {tensor_type(padded, ct)}, {win_ty}) outs({acc} : {ty_out}) -> {ty_out}"
    )
    y = ctx.from_builtin(res, out_shape, ct, cl)
    if attrs.mode == PoolingMode.AVG_INCLUDE_PAD:
        size = ctx.b.literal(float(math.prod(attrs.window)), ct)
        y = b.aten("div.Tensor", [y, size], y.shape, ct, cl)
    elif attrs.mode == PoolingMode.AVG_EXCLUDE_PAD:
        counts = valid_counts(attrs, tuple(xt.shape[2:]), tuple(yt.shape[2:]))
        cshape = (1, *counts.shape, 1)
        y = b.aten("div.Tensor", [y, _count_literal(ctx, counts, ct, cshape)], y.shape, ct, cl)
    ctx.set(yt, y)

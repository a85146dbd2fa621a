"""Reductions and softmax: layout-agnostic, they reduce the value axes that hold the
reduced logical axes, so a channels-last tensor is never transposed for them."""

from __future__ import annotations

from collections.abc import Sequence

from fusegraph.dtypes import DataType
from fusegraph.engines.iree.lower_base import Lowering, Val
from fusegraph.graph.node import Node
from fusegraph.graph.ops import ReductionAttrs, ReductionMode, SoftmaxAttrs

_LIST = "!torch.list<int>"
R = ReductionMode


def reduce_dims(ctx: Lowering, name: str, x: Val, axes: Sequence[int], *, dtype_arg: bool = True) -> Val:
    """``torch.aten.<name>`` over value axes ``axes`` with keepdim (sum/mean/amax/amin)."""
    b = ctx.b
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    extra = [(b.const_none(), "!torch.none")] if dtype_arg else []
    return b.aten(
        name,
        [x, (b.int_list(axes), _LIST), (b.const_bool(True), "!torch.bool"), *extra],
        shape,
        x.dtype,
        x.perm,
    )


def unary(ctx: Lowering, name: str, x: Val) -> Val:
    return ctx.b.aten(name, [x], x.shape, x.dtype, x.perm)


def binary(ctx: Lowering, name: str, x: Val, y: Val) -> Val:
    alpha = [(ctx.b.const_int(1), "!torch.int")] if name in ("add.Tensor", "sub.Tensor") else []
    shape = tuple(max(a, c) for a, c in zip(x.shape, y.shape, strict=True)) if y.rank else x.shape
    return ctx.b.aten(name, [x, y, *alpha], shape, x.dtype, x.perm)


def mean(ctx: Lowering, x: Val, axes: Sequence[int]) -> Val:
    return reduce_dims(ctx, "mean.dim", x, axes)


def _reduce(ctx: Lowering, mode: ReductionMode, x: Val, axes: list[int]) -> Val:
    if mode == R.SUM:
        return reduce_dims(ctx, "sum.dim_IntList", x, axes)
    if mode == R.AVG:
        return mean(ctx, x, axes)
    if mode == R.MAX:
        return reduce_dims(ctx, "amax", x, axes, dtype_arg=False)
    if mode == R.MIN:
        return reduce_dims(ctx, "amin", x, axes, dtype_arg=False)
    if mode == R.AMAX:
        return reduce_dims(ctx, "amax", unary(ctx, "abs", x), axes, dtype_arg=False)
    if mode == R.NORM1:
        return reduce_dims(ctx, "sum.dim_IntList", unary(ctx, "abs", x), axes)
    if mode == R.NORM2:
        sq = binary(ctx, "mul.Tensor", x, x)
        return unary(ctx, "sqrt", reduce_dims(ctx, "sum.dim_IntList", sq, axes))
    # R.MUL: torch's prod reduces one axis at a time.
    b = ctx.b
    for ax in axes:
        shape = tuple(1 if i == ax else d for i, d in enumerate(x.shape))
        x = b.aten(
            "prod.dim_int",
            [x, (b.const_int(ax), "!torch.int"), (b.const_bool(True), "!torch.bool"), (b.const_none(), "!torch.none")],
            shape,
            x.dtype,
            x.perm,
        )
    return x


_NEEDS_FLOAT = frozenset({R.AVG, R.NORM2})


def lower_reduction(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, ReductionAttrs)
    xt, yt = node.inputs["x"], node.outputs["y"]
    x = ctx.get(xt, full=True)
    summed = [a for a in range(len(xt.shape)) if xt.shape[a] != yt.shape[a]]
    if ctx.broadcast_product(xt, summed):
        x = ctx.fence(x)
    ct = ctx.compute_type(node, xt.dtype)
    if not ct.is_float and attrs.mode in _NEEDS_FLOAT:
        ct = ctx.compute_type(node, DataType.FLOAT)
    x = ctx.cast(x, ct)
    if summed and ctx.shares_a_packed_operand(xt, [a for a in range(len(xt.shape)) if a not in summed]):
        x = ctx.fence(x)  # after the cast: an f16 input's cast is the shared producer
    axes = [i for i, a in enumerate(x.perm) if xt.shape[a] != yt.shape[a]]
    if not axes:  # nothing reduced: the mode's elementwise part only
        y = unary(ctx, "abs", x) if attrs.mode in (R.AMAX, R.NORM1, R.NORM2) else x
    else:
        y = _reduce(ctx, attrs.mode, x, axes)
    ctx.set(yt, y)


def lower_softmax(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, SoftmaxAttrs)
    xt, yt = node.inputs["x"], node.outputs["y"]
    x = ctx.cast(ctx.get(xt, full=True), ctx.compute_type(node, xt.dtype))
    axis = x.perm.index(attrs.axis % len(xt.shape))
    b = ctx.b
    name = "log_softmax.int" if attrs.log else "softmax.int"
    y = b.aten(name, [x, (b.const_int(axis), "!torch.int"), (b.const_none(), "!torch.none")], x.shape, x.dtype, x.perm)
    ctx.set(yt, y)

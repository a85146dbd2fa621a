"""Batch, layer and RMS normalization, written out as reductions and pointwise math in
the compute type (IREE fuses them; statistics use the two-pass variance)."""

from __future__ import annotations

from fusegraph.engines.iree.lower_base import Lowering, Val
from fusegraph.engines.iree.lower_reduce import binary, mean, unary
from fusegraph.graph.node import Node
from fusegraph.graph.tensor import TensorAttr


def _epsilon(ctx: Lowering, t: TensorAttr, x: Val) -> Val:
    if t.is_scalar:
        assert t.value is not None
        return ctx.b.literal(float(t.value), x.dtype)
    v = ctx.cast(ctx.get(t, full=True), x.dtype)
    return ctx.reshape(v, (1,) * x.rank, x.perm)


def _per_channel(ctx: Lowering, t: TensorAttr, x: Val) -> Val:
    """A [C] or [1, C, 1...] parameter shaped to broadcast against ``x`` (any order)."""
    v = ctx.cast(ctx.get(t, full=True), x.dtype)
    pos = x.perm.index(1)
    shape = tuple(x.shape[pos] if i == pos else 1 for i in range(x.rank))
    return ctx.reshape(v, shape, x.perm)  # one non-unit axis: any order reshapes alike


def _feature(ctx: Lowering, t: TensorAttr, x: Val) -> Val:
    return ctx.align(ctx.cast(ctx.get(t), x.dtype), x.perm)


def _normalize(ctx: Lowering, x: Val, axes: list[int], eps: Val) -> tuple[Val, Val, Val]:
    """(x - mean) * inv_std, mean, inv_std over value axes ``axes``.

    "two_pass" variance is E[(x - E[x])^2]; "one_pass" is E[x^2] - E[x]^2, whose two
    reductions IREE fuses into one dispatch (faster, but loses precision when the mean
    is large against the spread)."""
    mu = mean(ctx, x, axes)
    centered = binary(ctx, "sub.Tensor", x, mu)
    if ctx.options.norm_variance == "one_pass":
        ex2 = mean(ctx, binary(ctx, "mul.Tensor", x, x), axes)
        var = binary(ctx, "sub.Tensor", ex2, binary(ctx, "mul.Tensor", mu, mu))
    else:
        var = mean(ctx, binary(ctx, "mul.Tensor", centered, centered), axes)
    inv = unary(ctx, "rsqrt", binary(ctx, "add.Tensor", var, eps))
    return binary(ctx, "mul.Tensor", centered, inv), mu, inv


def _input(ctx: Lowering, node: Node, kept: int | None = None) -> Val:
    """The normalized input in the compute type; fenced where its statistics (a mean over
    every axis but ``kept``) would fuse a broadcast product IREE cannot compile
    (Lowering.broadcast_product), or a producer shared with a matmul's or convolution's
    packed operand into one single-valued reduction (Lowering.shares_a_packed_operand)."""
    xt = node.inputs["x"]
    x = ctx.get(xt, full=True)
    if kept is not None and ctx.broadcast_product(xt, [a for a in range(len(xt.shape)) if a != kept]):
        x = ctx.fence(x)
    x = ctx.cast(x, ctx.compute_type(node, xt.dtype))
    if kept is not None and ctx.shares_a_packed_operand(xt, [kept]):
        x = ctx.fence(x)  # after the cast: an f16 input's cast is the shared producer
    return x


def lower_batchnorm_inference(ctx: Lowering, node: Node) -> None:
    x = _input(ctx, node)
    eps = _epsilon(ctx, node.inputs["epsilon"], x)
    mu = _per_channel(ctx, node.inputs["mean"], x)
    var = _per_channel(ctx, node.inputs["var"], x)
    inv = unary(ctx, "rsqrt", binary(ctx, "add.Tensor", var, eps))
    # Fold scale into the per-channel factor first: one multiply-add per element.
    factor = binary(ctx, "mul.Tensor", inv, _per_channel(ctx, node.inputs["scale"], x))
    y = binary(ctx, "mul.Tensor", binary(ctx, "sub.Tensor", x, mu), factor)
    y = binary(ctx, "add.Tensor", y, _per_channel(ctx, node.inputs["bias"], x))
    ctx.set(node.outputs["y"], y)


def lower_batchnorm(ctx: Lowering, node: Node) -> None:
    x = _input(ctx, node, kept=1)
    # as for a layer norm: where a batch norm's groups are a softmax's rows (N = H = 1, the
    # softmax over W: fuzz seed 31895), its statistics' stores failed iree-compile 3.13
    stats_out = node.outputs["mean"].is_output or node.outputs["inv_var"].is_output
    after, before = ctx.beside_a_softmax(node.inputs["x"], node.outputs["y"]) if stats_out else (False, False)
    if after:
        x = ctx.fence(x)
    eps = _epsilon(ctx, node.inputs["epsilon"], x)
    axes = [i for i, a in enumerate(x.perm) if a != 1]
    normed, mu, inv = _normalize(ctx, x, axes, eps)
    y = binary(ctx, "mul.Tensor", normed, _per_channel(ctx, node.inputs["scale"], x))
    y = binary(ctx, "add.Tensor", y, _per_channel(ctx, node.inputs["bias"], x))
    if before or ctx.one_group_into_a_contraction(node.inputs["x"], node.outputs["y"], 1):
        y = ctx.fence(y)
    ctx.set(node.outputs["y"], y)
    ctx.set(node.outputs["mean"], mu)
    ctx.set(node.outputs["inv_var"], inv)


def lower_layernorm(ctx: Lowering, node: Node) -> None:
    x = _input(ctx, node, kept=0)
    stats_out = any(node.outputs[k].is_output for k in ("mean", "inv_var") if k in node.outputs)
    after, before = ctx.beside_a_softmax(node.inputs["x"], node.outputs["y"]) if stats_out else (False, False)
    if after:  # statistics stored from a softmax's dispatch (Lowering.beside_a_softmax)
        x = ctx.fence(x)
    eps = _epsilon(ctx, node.inputs["epsilon"], x)
    axes = [i for i, a in enumerate(x.perm) if a != 0]
    normed, mu, inv = _normalize(ctx, x, axes, eps)
    y = binary(ctx, "mul.Tensor", normed, _feature(ctx, node.inputs["scale"], x))
    y = binary(ctx, "add.Tensor", y, _feature(ctx, node.inputs["bias"], x))
    if before or ctx.one_group_into_a_contraction(node.inputs["x"], node.outputs["y"], 0):
        y = ctx.fence(y)
    ctx.set(node.outputs["y"], y)
    if "mean" in node.outputs:
        ctx.set(node.outputs["mean"], mu)
    if "inv_var" in node.outputs:
        ctx.set(node.outputs["inv_var"], inv)


def lower_rmsnorm(ctx: Lowering, node: Node) -> None:
    x = _input(ctx, node, kept=0)
    eps = _epsilon(ctx, node.inputs["epsilon"], x)
    axes = [i for i, a in enumerate(x.perm) if a != 0]
    ms = mean(ctx, binary(ctx, "mul.Tensor", x, x), axes)
    inv = unary(ctx, "rsqrt", binary(ctx, "add.Tensor", ms, eps))
    y = binary(ctx, "mul.Tensor", binary(ctx, "mul.Tensor", x, inv), _feature(ctx, node.inputs["scale"], x))
    if "bias" in node.inputs:
        y = binary(ctx, "add.Tensor", y, _feature(ctx, node.inputs["bias"], x))
    if ctx.one_group_into_a_contraction(node.inputs["x"], node.outputs["y"], 0):
        y = ctx.fence(y)
    ctx.set(node.outputs["y"], y)
    if "inv_rms" in node.outputs:
        ctx.set(node.outputs["inv_rms"], inv)

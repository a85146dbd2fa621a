"""Scaled dot-product attention.

"fused" (default) emits ``torch.aten.scaled_dot_product_attention``, which IREE turns into
its online-softmax attention op; "decomposed" writes matmul / mask / softmax / matmul.
Grouped-query attention repeats k and v heads (each by its own factor: h_k and h_v may differ) (IREE fuses the broadcast into the reads);
causal masking combined with an explicit mask is folded into one additive mask.
"""

from __future__ import annotations

import math

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.iree.lower_base import (
    Lowering,
    Val,
    builtin_elem,
    float_literal,
    identity,
    vtensor,
)
from fusegraph.graph.node import Node
from fusegraph.graph.ops import SdpaAttrs

_LIST = "!torch.list<int>"


def _repeat_heads(ctx: Lowering, v: Val, rep: int) -> Val:
    """[B, Hk, S, D] -> [B, Hk*rep, S, D] with each head repeated ``rep`` times in place."""
    if rep == 1:
        return v
    bsz, hk, s, d = v.shape
    u = ctx.reshape(v, (bsz, hk, 1, s, d))
    e = ctx.broadcast(u, (bsz, hk, rep, s, d), identity(5))
    return ctx.reshape(e, (bsz, hk * rep, s, d))


def _causal_bias(ctx: Lowering, sq: int, skv: int, ct: DataType) -> Val:
    """A constant additive [1, 1, Sq, Skv] mask in ``ct``: 0 on and below the diagonal
    (top-left aligned), -inf above. Additive rather than a boolean keep: IREE 3.13 cannot
    data-tile a matmul whose consumer reads an i1 tensor from memory (a constant is one)."""
    keep = np.tril(np.ones((sq, skv), dtype=bool))
    zero, neg = float_literal(0.0, ct), float_literal(-math.inf, ct)
    flat = ", ".join(zero if k else neg for k in keep.reshape(-1))
    name = ctx.b.fresh("causal")
    n = sq * skv
    ctx.b.line(
        f"{name} = torch.vtensor.literal(dense<[{flat}]> : tensor<{n}x{builtin_elem(ct)}>) : {vtensor((n,), ct)}"
    )
    return ctx.reshape(Val(name, (n,), ct, (0,)), (1, 1, sq, skv))


def _mask(ctx: Lowering, node: Node, ct: DataType, sq: int, skv: int) -> Val | None:
    """The combined mask: boolean (keep) or additive float in ``ct``; None when absent."""
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    mask: Val | None = None
    if "mask" in node.inputs:
        mt = node.inputs["mask"]
        mask = ctx.align(ctx.get(mt), identity(4))
        if mt.dtype != DataType.BOOLEAN:
            mask = ctx.cast(mask, ct)
    if attrs.causal and mask is not None:
        bias = _causal_bias(ctx, sq, skv, ct)
        if mask.dtype == DataType.BOOLEAN:  # keep -> additive, then one mask
            zero, neg = ctx.b.literal(0.0, ct), ctx.b.literal(-math.inf, ct)
            mask = ctx.b.aten("where.self", [mask, zero, neg], mask.shape, ct, identity(4))
        shape = tuple(max(a, c) for a, c in zip(mask.shape, bias.shape, strict=True))
        mask = ctx.b.aten("add.Tensor", [mask, bias, (ctx.b.const_int(1), "!torch.int")], shape, ct, identity(4))
    return mask


def _fused(ctx: Lowering, q: Val, k: Val, v: Val, mask: Val | None, causal: bool, scale: float, out: tuple[int, ...]) -> Val:
    b = ctx.b
    m = (mask.name, mask.type) if mask is not None else (b.const_none(), "!torch.none")
    return b.aten(
        "scaled_dot_product_attention",
        [
            q,
            k,
            v,
            m,
            (b.const_float(0.0), "!torch.float"),
            (b.const_bool(causal), "!torch.bool"),
            (b.const_float(scale), "!torch.float"),
            (b.const_bool(False), "!torch.bool"),
        ],
        out,
        q.dtype,
        identity(4),
    )


def _decomposed(ctx: Lowering, q: Val, k: Val, v: Val, mask: Val | None, causal: bool, scale: float, out: tuple[int, ...]) -> Val:
    b = ctx.b
    ct = q.dtype
    bsz, h, sq, _ = q.shape
    skv = k.shape[2]
    kt = ctx.b.aten("transpose.int", [k, (b.const_int(2), "!torch.int"), (b.const_int(3), "!torch.int")],
                    (bsz, h, k.shape[3], skv), ct, identity(4))
    s = b.aten("matmul", [q, kt], (bsz, h, sq, skv), ct, identity(4))
    s = b.aten("mul.Tensor", [s, b.literal(scale, ct)], s.shape, ct, identity(4))
    if causal and mask is None:
        mask = _causal_bias(ctx, sq, skv, ct)
    if mask is not None:
        if mask.dtype == DataType.BOOLEAN:
            s = b.aten("where.self", [mask, s, b.literal(-math.inf, ct)], s.shape, ct, identity(4))
        else:
            s = b.aten("add.Tensor", [s, mask, (b.const_int(1), "!torch.int")], s.shape, ct, identity(4))
    p = b.aten("softmax.int", [s, (b.const_int(3), "!torch.int"), (b.const_none(), "!torch.none")], s.shape, ct, identity(4))
    return b.aten("matmul", [p, v], out, ct, identity(4))


def lower_sdpa(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    qt, kt, vt, ot = node.inputs["q"], node.inputs["k"], node.inputs["v"], node.outputs["o"]
    ct = ctx.compute_type(node, qt.dtype)
    q, k, v = (ctx.cast(ctx.get(t, identity(4), full=True), ct) for t in (qt, kt, vt))
    # a query or key computed by a matmul came out wrong unfenced (FusionGuards says when)
    q, k = (ctx.fence(x) if ctx.attention_operand_from_a_contraction(t) else x for t, x in ((qt, q), (kt, k)))
    # h_k and h_v each divide h_q (cuDNN keeps them separate): each is repeated on its own
    k = _repeat_heads(ctx, k, qt.shape[1] // kt.shape[1])
    v = _repeat_heads(ctx, v, qt.shape[1] // vt.shape[1])
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(qt.shape[3])
    sq, skv = qt.shape[2], kt.shape[2]
    mask = _mask(ctx, node, ct, sq, skv)
    causal = attrs.causal and mask is None
    lower = _fused if ctx.options.attention == "fused" else _decomposed
    ctx.set(ot, lower(ctx, q, k, v, mask, causal, scale, tuple(ot.shape)))

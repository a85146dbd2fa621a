"""The torch lowerings of the backward (training) ops -- layer, RMS and batch norm backward
and attention backward -- and of attention with statistics or dropout. Written with
device-agnostic torch ops (CPU and CUDA alike), computing in the node's compute type."""

from __future__ import annotations

import math

from fusegraph.engines.torch.context import _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.engines.torch.lower_dropout import keep_mask
from fusegraph.graph.node import Node
from fusegraph.graph.ops import SdpaAttrs


def _sum_to(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``a`` summed over the axes along which a tensor of ``shape`` broadcasts to it."""
    if a.dim() < len(shape):
        a = a.reshape((1,) * (len(shape) - a.dim()) + tuple(a.shape))
    lead = a.dim() - len(shape)
    axes = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and a.shape[lead + i] != 1]
    return (a.sum(dim=axes, keepdim=True) if axes else a).reshape(shape)


def _floats(ctx: _Ctx, node: Node, ins: dict[str, Tensor], ports: tuple[str, ...]) -> list[Tensor]:
    """Operands in the node's compute type (all of one type: saved statistics are f32)."""
    vals = [ctx.cast_in(node, ins[p]) for p in ports]
    dt = vals[0].dtype
    return [v if v.dtype == dt else v.to(dt) for v in vals]


def _lower_layernorm_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    dy, x, scale, mean, inv = _floats(ctx, node, ins, ("dy", "x", "scale", "mean", "inv_var"))
    feat = tuple(x.shape[1:])
    w = scale.reshape(scale.shape[1:] if scale.dim() == x.dim() else scale.shape).expand(feat).contiguous()
    # the bias argument only asks for dbias (its values are not read)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy.contiguous(), x.contiguous(), list(feat), mean.contiguous(), inv.contiguous(), w, w, [True, True, True]
    )
    shape = node.inputs["scale"].shape
    return {"dx": dx, "dscale": _sum_to(dw, shape), "dbias": _sum_to(db, shape)}


def _lower_rmsnorm_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    dy, x, scale, inv = _floats(ctx, node, ins, ("dy", "x", "scale", "inv_rms"))
    axes = list(range(1, x.dim()))
    xhat = x * inv
    g = dy * scale
    dx = inv * (g - xhat * (g * xhat).mean(dim=axes, keepdim=True))
    shape = node.inputs["scale"].shape
    out = {"dx": dx, "dscale": _sum_to(dy * xhat, shape)}
    if "dbias" in node.outputs:
        out["dbias"] = _sum_to(dy, shape)
    return out


def _lower_batchnorm_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    dy, x, scale, mean, inv = _floats(ctx, node, ins, ("dy", "x", "scale", "mean", "inv_var"))
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(
        dy, x, scale.reshape(-1), None, None, mean.reshape(-1), inv.reshape(-1), True, 0.0, [True, True, True]
    )
    shape = node.inputs["scale"].shape
    return {"dx": dx, "dscale": dw.reshape(shape), "dbias": db.reshape(shape)}


# ---- attention ----------------------------------------------------------------------------
def _qkv(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, float]:
    """(q, k and v repeated to q's heads, scale) in the compute type."""
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    q, k, v = _floats(ctx, node, ins, ("q", "k", "v"))
    hq = q.shape[1]
    k = k.repeat_interleave(hq // k.shape[1], dim=1) if k.shape[1] != hq else k
    v = v.repeat_interleave(hq // v.shape[1], dim=1) if v.shape[1] != hq else v
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return q, k, v, scale


def _scores(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """(q, k and v repeated to q's heads, scaled masked scores, scale) in the compute type."""
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    q, k, v, scale = _qkv(ctx, node, ins)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = ins.get("mask")
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    if attrs.causal:
        sq, skv = s.shape[-2:]
        keep = torch.ones((sq, skv), dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    return q, k, v, s, scale


def _dropout_factor(node: Node, ins: dict[str, Tensor], like: Tensor) -> Tensor | None:
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    p = attrs.dropout_probability
    if p <= 0.0 or "seed" not in ins:
        return None
    keep = keep_mask(tuple(like.shape), p, ins["seed"], ins["offset"])
    return keep.to(like.dtype) * (1.0 / (1.0 - p))


def _cpu_fused(ctx: _Ctx, node: Node) -> bool:
    """Whether torch's fused CPU attention (flash attention for the CPU, which returns the
    log-sum-exp and has a backward taking it) runs this node: on the CPU, without dropout
    (its dropout is its own stream, not reference/dropout.py's), v's head dim q's. Its causal
    mask is top-left aligned, as fusegraph's."""
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    same_dim = node.inputs["v"].shape[3] == node.inputs["q"].shape[3]
    return not ctx.gpu and attrs.dropout_probability <= 0.0 and same_dim


def _fused_mask(node: Node, ins: dict[str, Tensor], like: Tensor) -> tuple[Tensor | None, bool]:
    """The mask and causal flag for torch's fused kernel: with a mask, causality joins it."""
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    mask = ins.get("mask")
    if mask is None:
        return None, attrs.causal
    if mask.dtype == torch.bool:  # the fused CPU kernel takes additive masks of q's type only
        mask = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, -math.inf)
    mask = mask.to(like.dtype)
    if attrs.causal:
        sq, skv = like.shape[-2], ins["k"].shape[-2]
        keep = torch.ones((sq, skv), dtype=torch.bool, device=like.device).tril()
        mask = mask.masked_fill(~keep, -math.inf)
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)), False  # of the scores' rank


def lower_sdpa_explicit(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    """Attention where the statistics or dropout are asked for: torch's fused CPU kernel
    where it applies (_cpu_fused), else its matmuls and a softmax (torch's fused GPU kernels
    return neither through a public, device-agnostic call)."""
    torch = _torch()
    if _cpu_fused(ctx, node):
        q, k, v, scale = _qkv(ctx, node, ins)
        mask, causal = _fused_mask(node, ins, q)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        out = {"o": o}
        if "stats" in node.outputs:
            out["stats"] = lse.unsqueeze(-1)
        return out
    _, _, v, s, _ = _scores(ctx, node, ins)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    z = _dropout_factor(node, ins, p)
    out = {"o": torch.matmul(p if z is None else p * z, v)}
    if "stats" in node.outputs:
        out["stats"] = lse
    return out


def _group_sum(g: Tensor, heads: int) -> Tensor:
    b, hq = g.shape[:2]
    return g if heads == hq else g.reshape(b, heads, hq // heads, *g.shape[2:]).sum(dim=2)


def _lower_sdpa_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    """dq, dk, dv with the probabilities rebuilt from the saved log-sum-exp (P = exp(S - lse))
    and the row term from the saved output (rowsum(dO * O)), as flash attention does."""
    torch = _torch()
    hk, hv = node.inputs["k"].shape[1], node.inputs["v"].shape[1]
    if _cpu_fused(ctx, node):
        q, k, v, scale = _qkv(ctx, node, ins)
        do, o, stats = _floats(ctx, node, ins, ("do", "o", "stats"))
        mask, causal = _fused_mask(node, ins, q)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, stats.reshape(stats.shape[:-1]), 0.0, causal, attn_mask=mask, scale=scale
        )
        return {"dq": dq, "dk": _group_sum(dk, hk), "dv": _group_sum(dv, hv)}
    q, k, v, s, scale = _scores(ctx, node, ins)
    do, o, stats = _floats(ctx, node, ins, ("do", "o", "stats"))
    p = torch.exp(s - stats.to(s.dtype))
    z = _dropout_factor(node, ins, p)
    pd = p if z is None else p * z
    dv = torch.matmul(pd.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    if z is not None:
        dp = dp * z
    ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return {"dq": dq, "dk": _group_sum(dk, hk), "dv": _group_sum(dv, hv)}

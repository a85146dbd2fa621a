"""The torch lowerings of the network layers: batch, layer and RMS norms, pooling,
attention, softmax."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusegraph.engines.torch.context import _F, _Ctx, _operands, _pad_list
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.engines.torch.lower_backward import lower_sdpa_explicit
from fusegraph.graph.node import Node
from fusegraph.graph.ops import PoolingAttrs, PoolingMode, SdpaAttrs, SoftmaxAttrs


def _channel_vec(t: Tensor) -> Tensor:
    return t.reshape(-1)


def _eps_value(node: Node, ins: dict[str, Tensor]) -> float:
    e = node.inputs["epsilon"]
    if e.is_scalar:
        return float(e.value)  # type: ignore[arg-type]
    return float(ins["epsilon"].reshape(-1)[0].item())  # a runtime tensor (a graph break if compiled)


def _lower_bn_inference(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    x = ctx.cast_in(node, ins["x"])
    p = {k: _channel_vec(ctx.cast_in(node, ins[k])).to(x.dtype) for k in ("scale", "bias", "mean", "var")}
    y = _F().batch_norm(x, p["mean"], p["var"], p["scale"], p["bias"], False, 0.0, _eps_value(node, ins))
    return {"y": y}


def _lower_bn_training(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = _channel_vec(ctx.cast_in(node, ins["scale"])).to(x.dtype)
    bias = _channel_vec(ctx.cast_in(node, ins["bias"])).to(x.dtype)
    y, mean, inv = torch.native_batch_norm(x, scale, bias, None, None, True, 0.0, _eps_value(node, ins))
    stats = node.outputs["mean"].shape
    out = {"y": y, "mean": mean.reshape(stats), "inv_var": inv.reshape(stats)}
    if "in_running_mean" in ins:
        # (1 - m) * running + m * batch, the batch variance unbiased (reference/ops.py)
        m = ctx.cast_in(node, ins["momentum"]).reshape(())
        var = x.var(dim=[0, *range(2, x.dim())], correction=1)  # not from inv_var: eps would cancel
        for src, dst, batch in (("in_running_mean", "next_running_mean", mean), ("in_running_var", "next_running_var", var)):
            r = ctx.cast_in(node, ins[src])
            out[dst] = (1.0 - m) * r + m * batch.to(r.dtype).reshape(r.shape)
    return out


def _feature(t: Tensor, x: Tensor) -> Tensor:
    """A per-feature parameter, broadcast to x's non-batch dims (what F.layer_norm takes)."""
    target = x.shape[1:]
    while t.dim() > len(target) and t.shape[0] == 1:
        t = t.squeeze(0)
    return t.expand(target)


def _lower_layernorm(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = _feature(ctx.cast_in(node, ins["scale"]).to(x.dtype), x)
    bias = _feature(ctx.cast_in(node, ins["bias"]).to(x.dtype), x)
    eps = _eps_value(node, ins)
    if "mean" not in node.outputs:
        return {"y": _F().layer_norm(x, tuple(x.shape[1:]), scale.contiguous(), bias.contiguous(), eps)}
    y, mean, rstd = torch.native_layer_norm(x, list(x.shape[1:]), scale.contiguous(), bias.contiguous(), eps)
    stats = node.outputs["mean"].shape
    return {"y": y, "mean": mean.reshape(stats), "inv_var": rstd.reshape(stats)}


def _lower_rmsnorm(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    x = ctx.cast_in(node, ins["x"])
    scale = ctx.cast_in(node, ins["scale"]).to(x.dtype)
    eps = _eps_value(node, ins)
    axes = list(range(1, x.dim()))
    out: dict[str, Tensor] = {}
    if "inv_rms" in node.outputs:
        inv = torch.rsqrt(torch.mean(x * x, dim=axes, keepdim=True) + eps)
        y = x * inv * scale
        out["inv_rms"] = inv
    else:
        y = _F().rms_norm(x, tuple(x.shape[1:]), _feature(scale, x).contiguous(), eps)
    if "bias" in ins:
        y = y + ctx.cast_in(node, ins["bias"]).to(x.dtype)
    out["y"] = y
    return out


def _native_padding(attrs: PoolingAttrs, size: tuple[int, ...], want: Sequence[int]) -> bool | None:
    """The ceil_mode with which torch's own pooling padding (``pre`` on both sides, extra
    windows only where they overlap the input) yields exactly the graph's windows -- each
    starts at ``i * stride - pre`` either way, and padding never wins a max nor counts in an
    exclude-pad average -- or None when neither does (then the input is padded first, a copy)."""
    if any(2 * p > k for p, k in zip(attrs.pre_padding, attrs.window, strict=True)):
        return None
    if any(a > b for a, b in zip(attrs.pre_padding, attrs.post_padding, strict=True)):
        return None
    for ceil in (False, True):
        dims = []
        for n, k, s, p in zip(size, attrs.window, attrs.stride, attrs.pre_padding, strict=True):
            span = n + 2 * p - k
            out = (-(-span // s) if ceil else span // s) + 1
            if ceil and (out - 1) * s >= n + p:
                out -= 1  # torch drops a last window that starts in the right padding
            dims.append(out)
        if dims == list(want):
            return ceil
    return None


def _lower_pooling(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    F = _F()
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    x = ctx.cast_in(node, ins["x"])
    nsp = x.dim() - 2
    win, stride = list(attrs.window), list(attrs.stride)
    padded = any(attrs.pre_padding) or any(attrs.post_padding)
    pads = _pad_list(attrs.pre_padding, attrs.post_padding)
    if attrs.mode == PoolingMode.MAX:
        pool = getattr(F, f"max_pool{nsp}d")
        if padded:
            native = _native_padding(attrs, tuple(x.shape[2:]), node.outputs["y"].shape[2:])
            if native is not None:
                return {"y": pool(x, win, stride, padding=list(attrs.pre_padding), ceil_mode=native)}
            x = F.pad(x, pads, value=-math.inf)
        return {"y": pool(x, win, stride)}
    avg = getattr(F, f"avg_pool{nsp}d")
    if not padded:
        return {"y": avg(x, win, stride)}
    if attrs.mode != PoolingMode.AVG_INCLUDE_PAD:  # divisor = real elements: as for max
        native = _native_padding(attrs, tuple(x.shape[2:]), node.outputs["y"].shape[2:])
        if native is not None:
            return {"y": avg(x, win, stride, padding=list(attrs.pre_padding), ceil_mode=native, count_include_pad=False)}
    xp = F.pad(x, pads)
    if attrs.mode == PoolingMode.AVG_INCLUDE_PAD:
        return {"y": avg(xp, win, stride)}
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    count = avg(F.pad(ones, pads), win, stride)  # fraction of real elements per window
    return {"y": avg(xp, win, stride) / count}


def _lower_sdpa(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    if "stats" in node.outputs or attrs.dropout_probability > 0.0:
        return lower_sdpa_explicit(ctx, node, ins)
    q, k, v = _operands(ctx, node, ins, ("q", "k", "v"))
    mask = ins.get("mask")
    sq, skv = q.shape[-2], k.shape[-2]
    causal = attrs.causal
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if causal and mask is not None:
        keep = torch.ones((sq, skv), dtype=torch.bool, device=q.device).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, -math.inf)
        causal = False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if hk != hv:  # cuDNN's separate h_k and h_v: torch's GQA wants them equal, so repeat both
        k = k.repeat_interleave(hq // hk, dim=1) if hk != hq else k
        v = v.repeat_interleave(hq // hv, dim=1) if hv != hq else v
    gqa = q.shape[1] != k.shape[1]
    o = _F().scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=attrs.attn_scale, enable_gqa=gqa
    )
    return {"o": o}


def _lower_softmax(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, SoftmaxAttrs)
    x = ctx.cast_in(node, ins["x"])
    fn = _F().log_softmax if attrs.log else _F().softmax
    return {"y": fn(x, dim=attrs.axis)}


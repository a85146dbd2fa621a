"""Autograd functions for the fused patterns -- convolution + bias + activation, linear +
bias + activation, layernorm / rmsnorm, attention -- whose forward and backward are
fusegraph graphs (fusegraph/torch/graphs.py), their plans built once per signature
(fusegraph/torch/plans.py). The public functions take what ``torch.nn.functional`` takes.

Under ``torch.autocast`` the convolution, linear and attention run in the autocast type
and the norms in float32, as PyTorch's own autocast policy has them; the plans
themselves run with autocast off (their dtypes are their graphs').
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fusegraph.torch import graphs
from fusegraph.torch.plans import PLANS, run, spec


def _autocast(*ts: torch.Tensor | None, low: bool) -> tuple[torch.Tensor | None, ...]:
    """Inputs cast as autocast would cast them for this op (``low``: to the autocast type,
    else to float32); unchanged outside autocast."""
    first = next(t for t in ts if t is not None)
    device = first.device.type
    if not torch.is_autocast_enabled(device):
        return ts
    target = torch.get_autocast_dtype(device) if low else torch.float32
    return tuple(t.to(target) if t is not None and t.is_floating_point() and t.dtype != target else t for t in ts)


def _d(t: torch.Tensor) -> torch.Tensor:
    """The plan's operand: no autograd history (the function records it), and the lean call."""
    return t.detach() if t.requires_grad else t


def _needs(ctx: Any, bias: bool) -> tuple[bool, bool, bool]:
    """Which of (dx, dw, db) autograd asks of a conv or linear backward."""
    return bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2]) and bias


def _backward_feed(dy: torch.Tensor, saved: torch.Tensor | None, w: torch.Tensor, x: torch.Tensor,
                   needs: tuple[bool, bool, bool]) -> dict[str, torch.Tensor]:
    """A conv or linear backward graph's inputs: dx reads w, dw reads x, the activation's
    backward reads what the forward saved."""
    feed = {"dy": dy}
    if saved is not None:
        feed["saved"] = saved
    if needs[0]:
        feed["w"] = w
    if needs[1]:
        feed["x"] = x
    return feed


def _ints(v: int | Sequence[int], n: int) -> tuple[int, ...]:
    return (int(v),) * n if isinstance(v, int) else tuple(int(x) for x in v)


# ---- convolution + bias + activation -------------------------------------------------------------
class ConvBiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], act: str) -> torch.Tensor:
        sig = graphs.ConvSig(spec(x), spec(w), b is not None, stride, padding, dilation, act)
        plan = PLANS.get(("conv.fwd", sig), x.device, lambda: graphs.conv_forward(sig))
        feed = {"x": _d(x), "w": _d(w)}
        if b is not None:
            feed["b"] = _d(b).reshape([1, -1] + [1] * (x.dim() - 2))
        out = run(plan, feed)
        y = out["y"]
        saved = out.get("z", y) if act != "none" else None
        ctx.sig = sig
        ctx.save_for_backward(_d(x), _d(w), saved)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w, saved = ctx.saved_tensors
        sig: graphs.ConvSig = ctx.sig
        needs = _needs(ctx, sig.bias)
        dys = spec(dy)
        ss = spec(saved) if saved is not None else dys
        plan = PLANS.get(("conv.bwd", sig, dys, ss, needs), dy.device,
                         lambda: graphs.conv_backward(sig, dys, ss, needs))
        out = run(plan, _backward_feed(dy, saved, w, x, needs))
        db = out["db"].reshape(-1) if needs[2] else None
        return out.get("dx"), out.get("dw"), db, None, None, None, None


def conv_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                  dilation: int | Sequence[int] = 1, act: str = "none") -> torch.Tensor:
    """``act(F.conv2d(x, weight, bias, stride, padding, dilation))`` (1-3 spatial dims;
    groups follow from the weight's shape); act in graphs.ACTIVATIONS."""
    if act not in graphs.ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {sorted(graphs.ACTIVATIONS)}")
    n = x.dim() - 2
    x, weight, bias = _autocast(x, weight, bias, low=True)  # type: ignore[assignment]
    assert x is not None and weight is not None
    y: torch.Tensor = ConvBiasAct.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, _ints(stride, n), _ints(padding, n), _ints(dilation, n), act)
    return y


# ---- linear + bias + activation -----------------------------------------------------------------------
class LinearBiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _d(x).reshape(-1, x.shape[-1])
        sig = graphs.LinearSig(spec(x2), spec(w), b is not None, act)
        plan = PLANS.get(("linear.fwd", sig), x.device, lambda: graphs.linear_forward(sig))
        feed = {"x": x2, "wt": _d(w).t()}
        if b is not None:
            feed["b"] = _d(b).reshape(1, -1)
        out = run(plan, feed)
        y = out["y"]
        saved = out.get("z", y) if act != "none" else None
        ctx.sig, ctx.lead = sig, lead
        ctx.save_for_backward(x2, _d(w), saved)
        return y.reshape(*lead, w.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, w, saved = ctx.saved_tensors
        sig: graphs.LinearSig = ctx.sig
        needs = _needs(ctx, sig.bias)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dys = spec(dy2)
        ss = spec(saved) if saved is not None else dys
        plan = PLANS.get(("linear.bwd", sig, dys, ss, needs), dy.device,
                         lambda: graphs.linear_backward(sig, dys, ss, needs))
        out = run(plan, _backward_feed(dy2, saved, w, x2, needs))
        dx = out["dx"].reshape(*ctx.lead, x2.shape[1]) if needs[0] else None
        db = out["db"].reshape(-1) if needs[2] else None
        return dx, out.get("dw"), db, None


def linear_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    act: str = "none") -> torch.Tensor:
    """``act(F.linear(x, weight, bias))``."""
    if act not in graphs.ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {sorted(graphs.ACTIVATIONS)}")
    x, weight, bias = _autocast(x, weight, bias, low=True)  # type: ignore[assignment]
    assert x is not None and weight is not None
    y: torch.Tensor = LinearBiasAct.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, act)
    return y


# ---- layernorm / rmsnorm ---------------------------------------------------------------------------------
class Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, features: int,
                eps: float, kind: str) -> torch.Tensor:
        x2 = _d(x).reshape(-1, features)
        sig = graphs.NormSig(kind, spec(x2), eps, bias is not None)
        plan = PLANS.get(("norm.fwd", sig), x.device, lambda: graphs.norm_forward(sig))
        feed = {"x": x2, "scale": _d(weight).reshape(1, -1)}
        if bias is not None:
            feed["bias"] = _d(bias).reshape(1, -1)
        out = run(plan, feed)
        ctx.sig, ctx.shape, ctx.wshape = sig, x.shape, weight.shape
        ctx.save_for_backward(x2, _d(weight).reshape(1, -1), out["inv"], out.get("mean"))
        return out["y"].reshape(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, scale, inv, mean = ctx.saved_tensors
        sig: graphs.NormSig = ctx.sig
        dy2 = dy.reshape(x2.shape)
        dys, ss = spec(dy2), spec(inv)
        plan = PLANS.get(("norm.bwd", sig, dys, ss), dy.device, lambda: graphs.norm_backward(sig, dys, ss))
        feed = {"dy": dy2, "x": x2, "scale": scale, "inv": inv}
        if mean is not None:
            feed["mean"] = mean
        out = run(plan, feed)
        dbias = out["dbias"].reshape(-1) if "dbias" in out and sig.bias else None
        return out["dx"].reshape(ctx.shape), out["dscale"].reshape(ctx.wshape), dbias, None, None, None


def _norm(kind: str, x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
          bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    features = math.prod(normalized_shape)
    x, weight, bias = _autocast(x, weight, bias, low=False)  # type: ignore[assignment]
    assert x is not None
    if weight is None:
        weight = torch.ones(tuple(normalized_shape), dtype=x.dtype, device=x.device)
    if bias is None and kind == "layernorm":
        bias = torch.zeros(tuple(normalized_shape), dtype=x.dtype, device=x.device)
    y: torch.Tensor = Norm.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, features, float(eps), kind)
    return y


def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm``."""
    return _norm("layernorm", x, normalized_shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` (eps None: the dtype's machine epsilon, as PyTorch takes it)."""
    return _norm("rmsnorm", x, normalized_shape, weight, None, torch.finfo(x.dtype).eps if eps is None else eps)


# ---- attention -----------------------------------------------------------------------------------------------
class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: bool) -> torch.Tensor:
        sig = graphs.AttentionSig(spec(q), spec(k), spec(v), scale, causal)
        plan = PLANS.get(("attention.fwd", sig), q.device, lambda: graphs.attention_forward(sig))
        out = run(plan, {"q": _d(q), "k": _d(k), "v": _d(v)})
        ctx.sig = sig
        ctx.save_for_backward(_d(q), _d(k), _d(v), out["o"], out["stats"])
        return out["o"]

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, o, stats = ctx.saved_tensors
        sig: graphs.AttentionSig = ctx.sig
        os_, dos, ss = spec(o), spec(do), spec(stats)
        plan = PLANS.get(("attention.bwd", sig, os_, dos, ss), do.device,
                         lambda: graphs.attention_backward(sig, os_, dos, ss))
        out = run(plan, {"q": q, "k": k, "v": v, "o": o, "do": do, "stats": stats})
        return out["dq"], out["dk"], out["dv"], None, None


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on [batch, heads, seq, dim] (key/value heads may
    divide the query's). A mask or dropout goes to PyTorch's own (not yet here)."""
    if attn_mask is not None or dropout_p:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1])
    q, k, v = _autocast(q, k, v, low=True)  # type: ignore[assignment]
    assert q is not None and k is not None and v is not None
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o: torch.Tensor = Attention.apply(  # type: ignore[no-untyped-call]
        q, k, v, s, bool(is_causal))
    return o

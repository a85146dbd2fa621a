"""Attention in float64, forward and backward, written from the definition.

sdpa: O = dropout(softmax(q kᵀ · scale + mask)) v, with the log-sum-exp of each row of the
scaled, masked scores as its statistics. sdpa_backward: the gradients of O with respect to
q, k and v for a given dO -- recomputed from q, k, v here (the reference is the exact
answer; engines may read the saved o and stats instead, which agree when they are the
forward's). The dropout mask is reference/dropout.py's.
"""

from __future__ import annotations

import math

import numpy as np

from fusegraph.graph.node import Node
from fusegraph.graph.ops import SdpaAttrs
from fusegraph.reference.dropout import keep_mask

Arr = np.ndarray
Arrays = dict[str, Arr]


def _softmax(s: Arr, axis: int) -> Arr:
    m = np.max(s, axis=axis, keepdims=True)
    e = np.exp(s - m)
    return e / e.sum(axis=axis, keepdims=True)  # type: ignore[no-any-return]


def attention_scores(node: Node, ins: Arrays) -> Arr:
    """The scaled, masked scores q kᵀ of an attention node (forward or backward), with the
    key heads repeated to the query heads: [b, h_q, s_q, s_kv]."""
    q, k = ins["q"], ins["k"]
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    # h_k and h_v each divide h_q: query head i reads key head i // (h_q / h_k) and value
    # head i // (h_q / h_v) (cuDNN's separate h_k, h_v; grouped-query attention)
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    scale = attn_scale(attrs, q.shape[-1])
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if "mask" in ins:
        m = ins["mask"]
        s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m
    if attrs.causal:
        sq, skv = s.shape[-2:]
        s = np.where(np.tril(np.ones((sq, skv), dtype=bool)), s, -np.inf)
    return s  # type: ignore[no-any-return]


def attn_scale(attrs: SdpaAttrs, head_dim: int) -> float:
    return attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(head_dim)


def dropout_factor(node: Node, ins: Arrays, shape: tuple[int, ...]) -> Arr | None:
    """keep / (1 - p) per probability, or None without dropout (reference/dropout.py)."""
    attrs = node.attrs
    assert isinstance(attrs, SdpaAttrs)
    p = attrs.dropout_probability
    if p <= 0.0 or "seed" not in ins:
        return None
    seed, offset = int(ins["seed"].reshape(-1)[0]), int(ins["offset"].reshape(-1)[0])
    return keep_mask(shape, p, seed, offset) / (1.0 - p)  # type: ignore[no-any-return]


def sdpa(node: Node, ins: Arrays) -> Arrays:
    q, v = ins["q"], ins["v"]
    v = np.repeat(v, q.shape[1] // v.shape[1], axis=1)
    s = attention_scores(node, ins)
    with np.errstate(invalid="ignore"):
        p = _softmax(s, -1)
        out = {}
        if "stats" in node.outputs:
            m = np.max(s, axis=-1, keepdims=True)
            out["stats"] = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    z = dropout_factor(node, ins, p.shape)
    out["o"] = np.matmul(p if z is None else p * z, v)
    return out


def _group_sum(g: Arr, heads: int) -> Arr:
    """Sums a per-query-head gradient over the query heads that share one k/v head."""
    b, hq = g.shape[:2]
    return g.reshape(b, heads, hq // heads, *g.shape[2:]).sum(axis=2)  # type: ignore[no-any-return]


def sdpa_backward(node: Node, ins: Arrays) -> Arrays:
    q, k, v, do = ins["q"], ins["k"], ins["v"], ins["do"]
    assert isinstance(node.attrs, SdpaAttrs)
    scale = attn_scale(node.attrs, q.shape[-1])
    kr = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    vr = np.repeat(v, q.shape[1] // v.shape[1], axis=1)
    s = attention_scores(node, ins)
    with np.errstate(invalid="ignore"):
        p = _softmax(s, -1)
    z = dropout_factor(node, ins, p.shape)
    pd = p if z is None else p * z  # what multiplied v
    dv = np.matmul(np.swapaxes(pd, -1, -2), do)
    dpd = np.matmul(do, np.swapaxes(vr, -1, -2))
    dp = dpd if z is None else dpd * z
    # softmax's Jacobian: dS = P * (dP - rowsum(dP * P))
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = np.matmul(ds, kr) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * scale
    return {"dq": dq, "dk": _group_sum(dk, k.shape[1]), "dv": _group_sum(dv, v.shape[1])}

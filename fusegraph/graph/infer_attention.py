"""Shape and dtype inference of scaled dot-product attention: the operands' heads and
grouped-query layout, the mask, dropout's seed and offset, and the statistics output; the
operand checks are shared with attention backward (infer_backward.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

from fusegraph.dtypes import DataType
from fusegraph.graph.infer_base import (
    Dims,
    Proposal,
    broadcast_dims,
    fail,
    same_float_type,
    stats_dtype,
)
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind, SdpaAttrs


def infer_sdpa(node: Node) -> Proposal:
    dims, dt = attention_operands(node)
    out: Proposal = {"o": (dims, dt)}
    if "stats" in node.outputs:
        q = node.inputs["q"]
        out["stats"] = ((*q.shape[:3], 1), stats_dtype(dt))
    return out


def _dropout(node: Node) -> None:
    """cuDNN's (probability, seed, offset): the seed and offset are one integer each, read
    by the host-independent Philox stream of reference/dropout.py, so they must be graph
    inputs or constants (a computed seed would make the mask depend on rounding)."""
    assert isinstance(node.attrs, SdpaAttrs)
    p = node.attrs.dropout_probability
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise fail(node, f"dropout probability must be in [0, 1), got {p}")
    ports = [x for x in ("seed", "offset") if x in node.inputs]
    if p > 0.0 and len(ports) != 2:
        raise fail(node, f"dropout probability {p} needs both a seed and an offset tensor (got {ports or 'neither'})")
    if ports and len(ports) != 2:
        raise fail(node, f"dropout needs both a seed and an offset tensor (got only {ports})")
    for x in ports:
        t = node.inputs[x]
        if math.prod(t.shape) != 1 or t.dtype not in (DataType.INT64, DataType.INT32):
            raise fail(node, f"dropout {x} must be one INT64 (or INT32) value, got {list(t.shape)} {t.dtype.name}", t)
        if t.producer is not None:
            raise fail(node, f"dropout {x} must be a graph input or a constant, not computed by '{t.producer}'", t)


def attention_operands(node: Node) -> tuple[Dims, DataType]:
    """Checks the q, k, v, mask and dropout of an attention node (forward or backward);
    returns the dims and type of its output ``o``."""
    q, k, v = node.inputs["q"], node.inputs["k"], node.inputs["v"]
    assert isinstance(node.attrs, SdpaAttrs)
    for t in (q, k, v):
        if len(t.shape) != 4:
            raise fail(node, f"sdpa needs rank-4 [batch, heads, seq, dim] tensors, got {list(t.shape)}", t)
    dt = same_float_type(node, q, k, v)
    b, h, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise fail(node, "batch sizes of q, k and v differ", k)
    # cuDNN's h_k and h_v are separate: each must divide h_q (grouped-query attention)
    for t in (k, v):
        if h % t.shape[1]:
            raise fail(
                node, f"heads of {t.name!r} ({t.shape[1]}) must divide q's {h} (k has {k.shape[1]}, v {v.shape[1]})", t
            )
    scale = node.attrs.attn_scale
    if scale is not None and not math.isfinite(scale):
        raise fail(node, f"attn_scale must be finite, got {scale}")
    if k.shape[3] != d:
        raise fail(node, f"head dim of k ({k.shape[3]}) differs from q's ({d})", k)
    if v.shape[2] != k.shape[2]:
        raise fail(node, f"sequence length of v ({v.shape[2]}) differs from k's ({k.shape[2]})", v)
    if "mask" in node.inputs:
        m = node.inputs["mask"]
        full = (b, h, sq, k.shape[2])
        if len(m.shape) > 4 or broadcast_dims([m.shape, full]) != full:
            raise fail(node, f"mask dims {list(m.shape)} do not broadcast to {list(full)}", m)
        if m.dtype != DataType.BOOLEAN and not m.dtype.is_float:
            raise fail(node, f"mask must be BOOLEAN (keep) or floating-point (additive), got {m.dtype.name}", m)
    _dropout(node)
    return (b, h, sq, v.shape[3]), dt


ATTENTION_INFER: dict[OpKind, Callable[[Node], Proposal]] = {OpKind.SDPA: infer_sdpa}

"""Matrix products: MatMul and Gemm. Constant B operands are "matrix" tensors, laid out
for the engine (``importer.MATRIX_COLUMN_MAJOR``); Gemm folds alpha and beta into them.

Attention, two products around a softmax, lowers to the graph API's ``sdpa``: the fused
node of ``patterns_attention`` and ONNX Runtime's contrib ``Attention`` and
``MultiHeadAttention`` (what its transformer optimizer emits). ``GroupQueryAttention`` lowers
in ``gqa``, ``RotaryEmbedding`` in ``rotary``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fusegraph.graph.ops import ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import ints, is_read, reshape
from fusegraph.onnx.ops.table import Unmappable, contrib, fused, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


@lowers("MatMul")
def lower_matmul(imp: Importer, node: ONode) -> None:
    a_s, b_s = imp.shape(node.inputs[0]), imp.shape(node.inputs[1])
    a = imp.tensor(node.inputs[0], "plain")
    b = imp.tensor(node.inputs[1], "matrix" if len(b_s) == 2 and imp.is_const(node.inputs[1]) else "plain")
    if len(a_s) == 1:
        a = reshape(imp, a, (1, a_s[0]))
    if len(b_s) == 1:
        b = reshape(imp, b, (b_s[0], 1))
    y = imp.g.matmul(a, b)
    out = imp.og.shape(node.outputs[0])
    if out is not None and (len(a_s) == 1 or len(b_s) == 1):
        y = reshape(imp, y, out) if out else y
    imp.set(node.outputs[0], y)


@lowers("Gemm")
def lower_gemm(imp: Importer, node: ONode) -> None:
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    for n in node.inputs[:2]:
        if len(imp.shape(n)) != 2:
            raise Unmappable(f"Gemm: input '{n}' is not 2-D {list(imp.shape(n))}")
    if imp.is_const(node.inputs[0]) and ta:
        a = imp.constant(np.ascontiguousarray(imp.og.constants[node.inputs[0]].T), node.inputs[0], "plain")
    else:
        a = imp.tensor(node.inputs[0], "plain")
        if ta:
            a = imp.g.transpose(a, [1, 0])
    folded_alpha = False
    if imp.is_const(node.inputs[1]):
        bw = imp.og.constants[node.inputs[1]]
        bw = bw.T if tb else bw
        if alpha != 1.0 and bw.dtype.kind == "f":
            bw = bw * np.asarray(alpha, dtype=bw.dtype)
            folded_alpha = True
        b = imp.constant(np.ascontiguousarray(bw), node.inputs[1], "matrix")
    else:
        b = imp.tensor(node.inputs[1], "plain")
        if tb:
            b = imp.g.transpose(b, [1, 0])
    y = imp.g.matmul(a, b)
    if alpha != 1.0 and not folded_alpha:
        y = imp.g.mul(y, imp.scalar(alpha, y.dtype))
    if len(node.inputs) > 2 and node.inputs[2] and beta != 0.0:
        cname = node.inputs[2]
        if imp.is_const(cname):
            c = imp.og.constants[cname]
            if beta != 1.0:
                c = c * np.asarray(beta, dtype=c.dtype)
            ct = imp.g.scalar(c.reshape(-1)[0].item(), y.dtype) if c.size == 1 else imp.constant(c, cname, "plain")
        else:
            ct = imp.tensor(cname, "plain")
            if beta != 1.0:
                ct = imp.g.mul(ct, imp.scalar(beta, ct.dtype))
        y = imp.g.add(y, ct)
    imp.set(node.outputs[0], y)


# ---- attention -------------------------------------------------------------------------------
def role(node: ONode, name: str) -> str:
    """The input a fused node's attribute ``name`` points at ("" when absent)."""
    i = node.attr(name)
    return node.inputs[int(i)] if i is not None else ""


def _tag(imp: Importer, t: TensorAttr, pattern: str) -> None:
    """Marks the node that made ``t`` for the report's fusion counts."""
    for n in reversed(imp.g.nodes):
        if any(o is t for o in n.outputs.values()):
            n.meta["pattern"] = pattern
            return


@lowers(fused("Attention"))
def lower_fused_attention(imp: Importer, node: ONode) -> None:
    """patterns_attention's match: q [b, h, sq, d], k read through ``k_perm``, v; rank-3
    scores ([b, sq, sk]) run as one head."""
    rank = int(node.attr("rank"))
    q = imp.tensor(role(node, "q"), "plain")
    k = imp.tensor(role(node, "k"), "plain")
    perm = ints(node.attr("k_perm"))
    if perm != list(range(rank)):
        k = imp.g.transpose(k, perm)
    v = imp.tensor(role(node, "v"), "plain")
    if rank == 3:
        q, k, v = (reshape(imp, t, (t.dim[0], 1, t.dim[1], t.dim[2])) for t in (q, k, v))
    mask = None
    name = role(node, "mask")
    if name:
        ms = imp.shape(name)
        aligned = (1,) * (rank - len(ms)) + tuple(ms)
        four = aligned if rank == 4 else (aligned[0], 1, aligned[1], aligned[2])
        if imp.is_const(name):
            mask = imp.constant(imp.og.constants[name].reshape(four), name, "plain")
        else:
            mask = reshape(imp, imp.tensor(name, "plain"), four)
    o = imp.g.sdpa(q, k, v, attn_scale=float(node.attr("scale")), causal=bool(node.attr("causal")), mask=mask)
    _tag(imp, o, "attention.sdpa")
    if int(node.attr("guard", 0)) and mask is not None:
        # ONNX's Where(IsNaN(p), 0, p): a row whose mask is -inf (or NaN) everywhere gives 0
        top = imp.g.reduction(mask, ReductionMode.MAX, axes=[3])
        live = imp.g.cmp_ge(top, imp.scalar(float(np.finfo(o.dtype.numpy).min), o.dtype))
        o = imp.g.binary_select(o, imp.scalar(0.0, o.dtype), live)
    if rank == 3:
        o = reshape(imp, o, (o.dim[0], o.dim[2], o.dim[3]))
    imp.set(node.outputs[0], o)


def _heads(imp: Importer, t: TensorAttr, heads: int, what: str) -> TensorAttr:
    """[b, s, h*d] -> [b, h, s, d]."""
    b, s, hidden = t.dim
    if hidden % heads:
        raise Unmappable(f"{imp.op}: {what} hidden size {hidden} is not a multiple of num_heads={heads}")
    return imp.g.transpose(reshape(imp, t, (b, s, heads, hidden // heads)), [0, 2, 1, 3])


def _merge(imp: Importer, o: TensorAttr) -> TensorAttr:
    """[b, h, s, d] -> [b, s, h*d]."""
    b, h, s, d = o.dim
    return reshape(imp, imp.g.transpose(o, [0, 2, 1, 3]), (b, s, h * d))


def _contrib_common(imp: Importer, node: ONode, unused_outputs: range) -> tuple[int, bool]:
    if int(node.attr("do_rotary", 0)):
        raise Unmappable(f"{node.op_type}: do_rotary=1 (rotary embedding inside attention is not lowered)")
    for k in unused_outputs:
        if k < len(node.outputs) and node.outputs[k] and is_read(imp, node.outputs[k]):
            raise Unmappable(f"{node.op_type}: output '{node.outputs[k]}' (the key/value cache) is read")
    heads = int(node.attr("num_heads", 0))
    if heads < 1:
        raise Unmappable(f"{node.op_type}: num_heads={heads}")
    return heads, bool(int(node.attr("unidirectional", 0)))


def _scale(node: ONode, head_dim: int) -> float:
    s = float(node.attr("scale", 0.0))
    return s if s != 0.0 else 1.0 / math.sqrt(head_dim)


def _bias4(imp: Importer, name: str) -> TensorAttr | None:
    """An attention_bias [b|1, h|1, sq, sk], added to the scaled scores."""
    if not name:
        return None
    if len(imp.shape(name)) != 4:
        raise Unmappable(f"{imp.op}: attention_bias '{name}' is not 4-D {list(imp.shape(name))}")
    return imp.tensor(name, "plain")


def _key_mask(imp: Importer, node: ONode, name: str, b: int, sk: int, what: str) -> TensorAttr | None:
    """ONNX Runtime's integer masks as an additive mask: 0 where kept, ``mask_filter_value``
    (default -10000) where not -- [b] (keys before each end position), [b, sk] and
    [b, sq, sk] (kept where > 0). Measured against ONNX Runtime's CPU kernels."""
    if not name:
        return None
    ms = tuple(imp.shape(name))
    if imp.dtype(name).name != "INT32":
        raise Unmappable(f"{node.op_type}: {what} '{name}' is {imp.dtype(name).name}, not int32")
    filt = float(node.attr("mask_filter_value", -10000.0))
    m = imp.tensor(name, "plain")
    i32 = m.dtype
    if ms == (b,):
        iota = imp.constant(np.arange(sk, dtype=np.int32).reshape(1, sk), f"{name}_positions", "plain")
        keep = imp.g.cmp_lt(iota, reshape(imp, m, (b, 1)))
        four: tuple[int, ...] = (b, 1, 1, sk)
    elif len(ms) == 2 and ms == (b, sk):
        keep, four = imp.g.cmp_gt(m, imp.scalar(0, i32)), (b, 1, 1, sk)
    elif len(ms) == 3 and ms[0] == b and ms[2] == sk:
        keep, four = imp.g.cmp_gt(m, imp.scalar(0, i32)), (b, 1, ms[1], sk)
    else:
        raise Unmappable(f"{node.op_type}: {what} '{name}' of shape {list(ms)} (only [b], [b, s_kv], [b, s_q, s_kv] are lowered)")
    dt = imp.dtype(node.inputs[0])
    zeros = imp.constant(np.zeros((1, 1), dtype=dt.numpy), f"{name}_keep", "plain")
    add = imp.g.binary_select(zeros, imp.scalar(filt, dt), keep)
    return reshape(imp, add, four)


def _both(imp: Importer, a: TensorAttr | None, b: TensorAttr | None) -> TensorAttr | None:
    if a is None or b is None:
        return a if b is None else b
    return imp.g.add(a, b)


def _absent(imp: Importer, node: ONode, positions: dict[int, str]) -> None:
    for k, what in positions.items():
        if k < len(node.inputs) and node.inputs[k]:
            raise Unmappable(f"{node.op_type}: input {what} ('{node.inputs[k]}') is given; only its absence is lowered")


@lowers(contrib("Attention"))
def lower_contrib_attention(imp: Importer, node: ONode) -> None:
    """input [b, s, in] @ weights [in, q+k+v] (+ bias), split, heads, sdpa, merged."""
    heads, causal = _contrib_common(imp, node, range(1, 2))
    _absent(imp, node, {4: "past", 6: "past_sequence_length"})
    if int(node.attr("past_present_share_buffer", 0)):
        raise Unmappable("Attention: past_present_share_buffer=1")
    xs = imp.shape(node.inputs[0])
    ws = imp.shape(node.inputs[1])
    if len(xs) != 3 or len(ws) != 2:
        raise Unmappable(f"Attention: input {list(xs)} / weights {list(ws)} are not 3-D / 2-D")
    sizes = ints(node.attr("qkv_hidden_sizes", []))
    if not sizes:
        if ws[1] % 3:
            raise Unmappable(f"Attention: weights {list(ws)} do not split in three equal parts")
        sizes = [ws[1] // 3] * 3
    if len(sizes) != 3 or sum(sizes) != ws[1] or sizes[0] != sizes[1]:
        raise Unmappable(f"Attention: qkv_hidden_sizes={sizes} do not fit weights {list(ws)}")
    x = imp.tensor(node.inputs[0], "plain")
    w = imp.tensor(node.inputs[1], "matrix" if imp.is_const(node.inputs[1]) else "plain")
    y = imp.g.matmul(x, w)
    if len(node.inputs) > 2 and node.inputs[2]:
        y = imp.g.add(y, imp.tensor(node.inputs[2], "plain"))
    b, s, _ = xs
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    q, k, v = (
        imp.g.slice(y, [0, 0, st], [b, s, st + n], [1, 1, 1]) for st, n in zip(starts, sizes, strict=True)
    )
    q4, k4, v4 = _heads(imp, q, heads, "Q"), _heads(imp, k, heads, "K"), _heads(imp, v, heads, "V")
    mask = _key_mask(imp, node, node.inputs[3] if len(node.inputs) > 3 else "", b, s, "mask_index")
    bias = _both(imp, mask, _bias4(imp, node.inputs[5] if len(node.inputs) > 5 else ""))
    o = imp.g.sdpa(q4, k4, v4, attn_scale=_scale(node, q4.dim[3]), causal=causal, mask=bias)
    _tag(imp, o, "attention.sdpa")
    imp.set(node.outputs[0], _merge(imp, o))


@lowers(contrib("MultiHeadAttention"))
def lower_contrib_mha(imp: Importer, node: ONode) -> None:
    """Separate 3-D query, key, value (+ bias over q|k|v), heads, sdpa, merged."""
    heads, causal = _contrib_common(imp, node, range(1, 3))
    _absent(imp, node, {6: "past_key", 7: "past_value", 8: "past_sequence_length", 9: "cache_indirection"})
    names = [node.inputs[k] if k < len(node.inputs) else "" for k in range(3)]
    if not names[1] or not names[2]:
        raise Unmappable("MultiHeadAttention: packed QKV / KV (key or value absent) is not lowered")
    for n in names:
        if len(imp.shape(n)) != 3:
            raise Unmappable(f"MultiHeadAttention: '{n}' {list(imp.shape(n))} is not [batch, seq, hidden] "
                             "(packed or BNSH key/value are not lowered)")
    q, k, v = (imp.tensor(n, "plain") for n in names)
    if len(node.inputs) > 3 and node.inputs[3]:
        hq, hk, hv = q.dim[2], k.dim[2], v.dim[2]
        bs = imp.shape(node.inputs[3])
        if list(bs) != [hq + hk + hv]:
            raise Unmappable(f"MultiHeadAttention: bias {list(bs)} is not [{hq + hk + hv}]")
        bias = imp.tensor(node.inputs[3], "plain")
        q = imp.g.add(q, imp.g.slice(bias, [0], [hq], [1]))
        k = imp.g.add(k, imp.g.slice(bias, [hq], [hq + hk], [1]))
        v = imp.g.add(v, imp.g.slice(bias, [hq + hk], [hq + hk + hv], [1]))
    q4, k4, v4 = _heads(imp, q, heads, "query"), _heads(imp, k, heads, "key"), _heads(imp, v, heads, "value")
    kpm = _key_mask(imp, node, node.inputs[4] if len(node.inputs) > 4 else "", q.dim[0], k.dim[1], "key_padding_mask")
    mask = _both(imp, kpm, _bias4(imp, node.inputs[5] if len(node.inputs) > 5 else ""))
    o = imp.g.sdpa(q4, k4, v4, attn_scale=_scale(node, q4.dim[3]), causal=causal, mask=mask)
    _tag(imp, o, "attention.sdpa")
    imp.set(node.outputs[0], _merge(imp, o))


"""ONNX Runtime's contrib ``GroupQueryAttention`` (com.microsoft), which its transformer
optimizer emits for LLM exports, lowered in its prefill form onto the graph API's ``sdpa``.

The op carries a key/value cache: ``seqlens_k`` (per batch row, its total length - 1) and
``total_sequence_length`` decide at run time which keys each query sees, and ``past_key`` /
``past_value`` are prepended to the new keys. fusegraph's sdpa has no run-time lengths, so
only the form whose key set is fixed by the model is lowered: no past (absent, or of
sequence length 0), every row full length (both length inputs constant, ``seqlens_k`` =
sequence_length - 1 in every row and ``total_sequence_length`` = sequence_length; values
computed from shapes alone are folded at import and count as constants). Then the op is
plain attention with kv_num_heads dividing num_heads -- which sdpa takes as is -- causal
(lower-right and upper-left alignment agree with no past) unless ``causal=0``.
``present_key`` / ``present_value`` are then the new keys/values in BNSH.

Everything else (rotary inside the op, local windows, softcap, smooth softmax, quantized
or windowed caches, the newer optional inputs) is refused with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import is_read, reshape
from fusegraph.onnx.ops.table import Unmappable, contrib, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode

OP = "GroupQueryAttention"

#: Optional inputs past total_sequence_length; only their absence is lowered.
_LATER_INPUTS = {
    7: "cos_cache", 8: "sin_cache", 9: "position_ids", 10: "attention_bias", 11: "head_sink",
    12: "k_scale", 13: "v_scale", 14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens",
}


@dataclass(frozen=True)
class Gqa:
    """The dims one GroupQueryAttention node works on."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head: int
    packed: bool  # query holds q|k|v (key and value absent)
    causal: bool


def _int(node: ONode, name: str, default: int = 0) -> int:
    return int(node.attr(name, default))


def _text(node: ONode, name: str) -> str:
    v = node.attr(name, b"NONE")
    return v.decode() if isinstance(v, bytes) else str(v)


def _input(node: ONode, k: int) -> str:
    return node.inputs[k] if k < len(node.inputs) else ""


def _check_attrs(node: ONode) -> bool:
    """Refuses the attributes that change the computation; returns ``causal``."""
    if _int(node, "do_rotary"):
        raise Unmappable(f"{OP}: do_rotary=1 (rotary embedding inside the op is not lowered; "
                         "a separate RotaryEmbedding node is)")
    window = _int(node, "local_window_size", -1)
    if window != -1:
        raise Unmappable(f"{OP}: local_window_size={window} (sliding-window attention is not lowered)")
    softcap = float(node.attr("softcap", 0.0))
    if softcap != 0.0:
        raise Unmappable(f"{OP}: softcap={softcap} (capped scores, softcap * tanh(s / softcap), are not lowered)")
    for name in ("smooth_softmax", "qk_output", "sliding_window_cache"):
        if _int(node, name):
            raise Unmappable(f"{OP}: {name}={_int(node, name)} is not lowered")
    for name in ("k_quant_type", "v_quant_type"):
        if _text(node, name) != "NONE":
            raise Unmappable(f"{OP}: {name}={_text(node, name)!r} (a quantized cache) is not lowered")
    causal = _int(node, "causal", 1)
    if causal not in (0, 1):
        raise Unmappable(f"{OP}: causal={causal} is not 0 or 1")
    return bool(causal)


def _geometry(imp: Importer, node: ONode, causal: bool) -> Gqa:
    heads, kv_heads = _int(node, "num_heads"), _int(node, "kv_num_heads")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise Unmappable(f"{OP}: num_heads={heads} is not a positive multiple of kv_num_heads={kv_heads}")
    q, k, v = (_input(node, i) for i in range(3))
    qs = imp.shape(q)
    if len(qs) != 3:
        raise Unmappable(f"{OP}: query '{q}' {list(qs)} is not [batch, seq, hidden]")
    b, s, width = qs
    packed = not k and not v
    if packed:
        parts = heads + 2 * kv_heads
        if width % parts:
            raise Unmappable(f"{OP}: packed QKV width {width} is not (num_heads + 2 * kv_num_heads) = {parts} heads")
        return Gqa(b, s, heads, kv_heads, width // parts, True, causal)
    if not k or not v:
        raise Unmappable(f"{OP}: only one of key ('{k}') and value ('{v}') is given")
    if width % heads:
        raise Unmappable(f"{OP}: query hidden size {width} is not a multiple of num_heads={heads}")
    head = width // heads
    for name in (k, v):
        if imp.shape(name) != (b, s, kv_heads * head):
            raise Unmappable(f"{OP}: '{name}' {list(imp.shape(name))} is not [batch={b}, seq={s}, "
                             f"kv_num_heads * head={kv_heads * head}]")
    return Gqa(b, s, heads, kv_heads, head, False, causal)


def _check_cache(imp: Importer, node: ONode, g: Gqa) -> None:
    """No past, constant full-length rows; else the reason."""
    for k, what in ((3, "past_key"), (4, "past_value")):
        name = _input(node, k)
        if name:
            ps = imp.shape(name)
            if len(ps) != 4 or ps[2] != 0:
                raise Unmappable(f"{OP}: {what} '{name}' {list(ps)} holds cached positions (only the prefill "
                                 "form without a past, or a past of length 0, is lowered)")
    for k, what in _LATER_INPUTS.items():
        if _input(node, k):
            raise Unmappable(f"{OP}: input {what} ('{_input(node, k)}') is given; only its absence is lowered")
    seqlens, total = _input(node, 5), _input(node, 6)
    if not seqlens or not total:
        raise Unmappable(f"{OP}: seqlens_k / total_sequence_length are missing")
    for name, what in ((seqlens, "seqlens_k"), (total, "total_sequence_length")):
        if not imp.is_const(name):
            raise Unmappable(
                f"{OP}: {what} '{name}' is a run-time value (not fixed by the model's shapes); its values decide "
                "which keys each query sees, and only constant full-length rows are lowered")
    lens = np.asarray(imp.og.constants[seqlens]).reshape(-1)
    if lens.shape != (g.batch,) or (lens != g.seq - 1).any():
        raise Unmappable(f"{OP}: seqlens_k {lens.tolist()} is not sequence_length - 1 = {g.seq - 1} in each of "
                         f"{g.batch} rows (padded or ragged rows are not lowered)")
    tot = np.asarray(imp.og.constants[total]).reshape(-1)
    if tot.size != 1 or int(tot[0]) != g.seq:
        raise Unmappable(f"{OP}: total_sequence_length {tot.tolist()} is not sequence_length = {g.seq}")


def _bnsh(imp: Importer, t: TensorAttr, heads: int, g: Gqa) -> TensorAttr:
    """[b, s, heads * head] -> [b, heads, s, head]."""
    return imp.g.transpose(reshape(imp, t, (g.batch, g.seq, heads, g.head)), [0, 2, 1, 3])


@lowers(contrib(OP))
def lower_contrib_gqa(imp: Importer, node: ONode) -> None:
    """q, k, v in heads (sliced from the packed query where key/value are absent), one sdpa
    whose key/value heads divide the query's, merged back to [b, s, num_heads * head]."""
    causal = _check_attrs(node)
    g = _geometry(imp, node, causal)
    _check_cache(imp, node, g)
    if len(node.outputs) > 3 and node.outputs[3] and is_read(imp, node.outputs[3]):
        raise Unmappable(f"{OP}: output_qk '{node.outputs[3]}' is read")
    x = imp.tensor(node.inputs[0], "plain")
    qw, kw = g.heads * g.head, g.kv_heads * g.head
    if g.packed:
        q, k, v = (imp.g.slice(x, [0, 0, a], [g.batch, g.seq, a + n], [1, 1, 1])
                   for a, n in ((0, qw), (qw, kw), (qw + kw, kw)))
    else:
        q, k, v = x, imp.tensor(node.inputs[1], "plain"), imp.tensor(node.inputs[2], "plain")
    q4, k4, v4 = _bnsh(imp, q, g.heads, g), _bnsh(imp, k, g.kv_heads, g), _bnsh(imp, v, g.kv_heads, g)
    scale = float(node.attr("scale", 0.0)) or 1.0 / math.sqrt(g.head)
    o = imp.g.sdpa(q4, k4, v4, attn_scale=scale, causal=g.causal)
    for n in reversed(imp.g.nodes):  # the report's fusion counts
        if any(t is o for t in n.outputs.values()):
            n.meta["pattern"] = "attention.sdpa"
            break
    y = reshape(imp, imp.g.transpose(o, [0, 2, 1, 3]), (g.batch, g.seq, qw))
    imp.set(node.outputs[0], y)
    for pos, t in ((1, k4), (2, v4)):  # the present cache: the new keys/values, nothing before them
        if pos < len(node.outputs) and node.outputs[pos] and is_read(imp, node.outputs[pos]):
            imp.set(node.outputs[pos], t)

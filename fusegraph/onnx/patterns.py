"""Rewrites done once at session creation, and the fusion patterns the report names.

ONNX-level rewrites (on the specialized graph, before partitioning):

* ``onnx.bn.affine``: a per-channel Mul/Add/Sub/Div by a constant after a
  BatchNormalization folds into its scale and bias (DenseNet's BN -> Mul -> Add).
* ``onnx.conv.bn``: BatchNormalization after a Conv folds into the conv's weights and
  bias (W' = W * s/sqrt(v+eps), b' = (b - mean) * s/sqrt(v+eps) + beta).
* ``onnx.conv.affine``: a per-channel Mul/Add/Sub/Div by a constant after a Conv folds into
  its weights and bias.

Each applies only when the intermediate value has no other reader and no op type
involved is excluded by the user. Fusion itself is not a rewrite: conv + bias + ReLU
(+ residual add) and GEMM + bias + activation are consecutive nodes of one fusegraph
Graph, which the engine fuses; :func:`label_fusions` names those chains for the report.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.patterns_attention import fuse_attention
from fusegraph.onnx.patterns_common import Ctx
from fusegraph.onnx.patterns_contrib_types import infer_contrib_types
from fusegraph.onnx.patterns_gelu import fuse_gelu_erf, fuse_gelu_tanh
from fusegraph.onnx.patterns_norms import fuse_layer, fuse_rms

_AFFINE_OPS = frozenset({"Mul", "Add", "Sub", "Div"})


_Ctx = Ctx  # the name the BN/conv folds below were written against


def _bn_ok(ctx: _Ctx, bn: ONode) -> list[np.ndarray] | None:
    if bn.op_type != "BatchNormalization" or int(bn.attr("training_mode", 0)):
        return None
    if ctx.og.opset < 9 and int(bn.attr("spatial", 1)) == 0:
        return None
    if any(o and (ctx.consumers.get(o) or o in ctx.og.outputs) for o in bn.outputs[1:]):
        return None
    params = ctx.consts(bn.inputs[1:5])
    if params is None or any(p.ndim != 1 or p.dtype.kind != "f" for p in params):
        return None
    return params


def _conv_ok(ctx: _Ctx, conv: ONode) -> tuple[np.ndarray, np.ndarray | None] | None:
    if conv.op_type != "Conv":
        return None
    w = ctx.consts(conv.inputs[1:2])
    if w is None or w[0].dtype.kind != "f":
        return None
    if len(conv.inputs) > 2 and conv.inputs[2]:
        b = ctx.consts(conv.inputs[2:3])
        if b is None:
            return None
        return w[0], b[0]
    return w[0], None


def _channel_vector(ctx: _Ctx, q: ONode, value: str) -> tuple[str, np.ndarray] | None:
    """(op, per-channel vector) when ``q`` is value (op) constant, per channel of ``value``."""
    if q.op_type not in _AFFINE_OPS or len(q.inputs) != 2:
        return None
    a, b = q.inputs
    if a == value and b in ctx.og.constants:
        c = ctx.og.constants[b]
    elif b == value and a in ctx.og.constants and q.op_type in ("Mul", "Add"):
        c = ctx.og.constants[a]
    else:
        return None
    shape = ctx.og.shape(value)
    if shape is None or len(shape) < 2 or c.ndim > len(shape) or c.dtype.kind != "f":
        return None
    full = (1,) * (len(shape) - c.ndim) + tuple(c.shape)
    if any(d != 1 for i, d in enumerate(full) if i != 1) or full[1] not in (1, shape[1]):
        return None
    vec = np.broadcast_to(c.reshape(-1).astype(np.float64), (shape[1],))
    return q.op_type, vec


def _rebuilt(base: ONode, inputs: tuple[str, ...], outputs: tuple[str, ...], extra: ONode) -> ONode:
    return ONode(
        base.name, base.op_type, base.domain, inputs, outputs, dict(base.attrs), None,
        sources=base.sources + extra.sources,
        source_ops=tuple(op for _, op in base.origin() + extra.origin()),
    )


def fold_affine_into_bn(ctx: _Ctx) -> int:
    count = 0
    for bn in list(ctx.og.nodes):
        params = _bn_ok(ctx, bn)
        q = ctx.sole_reader(bn.outputs[0]) if params is not None else None
        if q is None or params is None or not ctx.allowed(bn, q):
            continue
        cv = _channel_vector(ctx, q, bn.outputs[0])
        if cv is None:
            continue
        op, vec = cv
        scale, bias = params[0].astype(np.float64), params[1].astype(np.float64)
        if op == "Mul":
            scale, bias = scale * vec, bias * vec
        elif op == "Div":
            scale, bias = scale / vec, bias / vec
        elif op == "Add":
            bias = bias + vec
        else:
            bias = bias - vec
        dt = params[0].dtype
        s = ctx.new_const(f"{bn.inputs[1]}_affine", scale.astype(dt))
        b = ctx.new_const(f"{bn.inputs[2]}_affine", bias.astype(dt))
        new = _rebuilt(bn, (bn.inputs[0], s, b, *bn.inputs[3:5]), (q.outputs[0],), q)
        ctx.replace([bn, q], new)
        count += 1
    return count


def fold_bn_into_conv(ctx: _Ctx) -> int:
    count = 0
    for bn in list(ctx.og.nodes):
        params = _bn_ok(ctx, bn)
        conv = ctx.producer.get(bn.inputs[0]) if params is not None else None
        if conv is None or params is None or not ctx.allowed(conv, bn):
            continue
        wb = _conv_ok(ctx, conv)
        if wb is None or ctx.sole_reader(conv.outputs[0]) is not bn:
            continue
        w, b = wb
        scale, beta, mean, var = (p.astype(np.float64) for p in params)
        a = scale / np.sqrt(var + float(bn.attr("epsilon", 1e-5)))
        if a.shape[0] != w.shape[0]:
            continue
        b0 = b.astype(np.float64) if b is not None else np.zeros_like(a)
        w2 = (w.astype(np.float64) * a.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        b2 = ((b0 - mean) * a + beta).astype(w.dtype)
        wn = ctx.new_const(f"{conv.inputs[1]}_bn", w2)
        bnm = ctx.new_const(f"{conv.outputs[0]}_bias_bn", b2)
        new = _rebuilt(conv, (conv.inputs[0], wn, bnm), (bn.outputs[0],), bn)
        ctx.replace([conv, bn], new)
        count += 1
    return count


def fold_affine_into_conv(ctx: _Ctx) -> int:
    count = 0
    for conv in list(ctx.og.nodes):
        wb = _conv_ok(ctx, conv)
        q = ctx.sole_reader(conv.outputs[0]) if wb is not None else None
        if q is None or wb is None or not ctx.allowed(conv, q):
            continue
        cv = _channel_vector(ctx, q, conv.outputs[0])
        if cv is None:
            continue
        op, vec = cv
        w, b = wb
        w64 = w.astype(np.float64)
        b64 = b.astype(np.float64) if b is not None else np.zeros(w.shape[0])
        if vec.shape[0] != w.shape[0]:
            continue
        shape = (-1,) + (1,) * (w.ndim - 1)
        if op == "Mul":
            w64, b64 = w64 * vec.reshape(shape), b64 * vec
        elif op == "Div":
            w64, b64 = w64 / vec.reshape(shape), b64 / vec
        elif op == "Add":
            b64 = b64 + vec
        else:
            b64 = b64 - vec
        wn = ctx.new_const(f"{conv.inputs[1]}_affine", w64.astype(w.dtype))
        bn = ctx.new_const(f"{conv.outputs[0]}_bias_affine", b64.astype(w.dtype))
        new = _rebuilt(conv, (conv.inputs[0], wn, bn), (q.outputs[0],), q)
        ctx.replace([conv, q], new)
        count += 1
    return count


@dataclass(frozen=True)
class Rewrite:
    name: str
    fn: Callable[[_Ctx], int]


# Priority order. Affine ops first join their BatchNormalization, which then joins its conv.
# Transformer patterns (patterns_norms, patterns_gelu, patterns_attention) each replace the
# nodes they match by one fused node: norms and GELU first, as they never overlap an
# attention, whose match is the largest.
REWRITES: tuple[Rewrite, ...] = (
    Rewrite("onnx.bn.affine", fold_affine_into_bn),
    Rewrite("onnx.conv.bn", fold_bn_into_conv),
    Rewrite("onnx.conv.affine", fold_affine_into_conv),
    Rewrite("onnx.norm.layer", fuse_layer),
    Rewrite("onnx.norm.rms", fuse_rms),
    Rewrite("onnx.gelu.erf", fuse_gelu_erf),
    Rewrite("onnx.gelu.tanh", fuse_gelu_tanh),
    Rewrite("onnx.attention.sdpa", fuse_attention),
)


def apply_rewrites(
    og: OnnxGraph, exclude: Iterable[str] = (), refused: dict[str, str] | None = None
) -> dict[str, int]:
    """Runs every rewrite to a fixed point; returns how often each applied. ``refused``
    (anchor node -> "pattern at node: reason") receives the patterns whose anchor matched
    but the rest did not -- a wrong constant or axis, an intermediate read elsewhere."""
    infer_contrib_types(og)  # values after ONNX Runtime's contrib ops get shapes, so they can be claimed
    ctx = _Ctx(og, exclude)
    counts: dict[str, int] = collections.Counter()
    while True:
        changed = 0
        for rw in REWRITES:
            n = rw.fn(ctx)
            counts[rw.name] += n
            changed += n
        if not changed:
            if refused is not None:
                refused.update(ctx.refused)
            return dict(counts)


# ---- fusion labels ---------------------------------------------------------------------------
@dataclass(frozen=True)
class FusionPattern:
    name: str  # dotted: anchor, then the steps fused after it
    anchor: frozenset[OpKind]
    steps: tuple[str, ...]


# Priority order: the longest chain an anchor can take is named.
FUSIONS: tuple[FusionPattern, ...] = (
    FusionPattern("conv.bias.add.relu", frozenset({OpKind.CONV_FPROP}), ("bias", "add", "relu")),
    FusionPattern("conv.bias.relu", frozenset({OpKind.CONV_FPROP}), ("bias", "relu")),
    FusionPattern("conv.bias.act", frozenset({OpKind.CONV_FPROP}), ("bias", "act")),
    FusionPattern("conv.bias.add", frozenset({OpKind.CONV_FPROP}), ("bias", "add")),
    FusionPattern("conv.relu", frozenset({OpKind.CONV_FPROP}), ("relu",)),
    FusionPattern("conv.bias", frozenset({OpKind.CONV_FPROP}), ("bias",)),
    FusionPattern("gemm.bias.relu", frozenset({OpKind.MATMUL}), ("bias", "relu")),
    FusionPattern("gemm.bias.act", frozenset({OpKind.MATMUL}), ("bias", "act")),
    FusionPattern("gemm.bias", frozenset({OpKind.MATMUL}), ("bias",)),
    FusionPattern("gemm.act", frozenset({OpKind.MATMUL}), ("act",)),
)

_ACTS = frozenset(
    {
        PointwiseMode.SIGMOID_FWD, PointwiseMode.TANH_FWD, PointwiseMode.GELU_FWD,
        PointwiseMode.GELU_APPROX_TANH_FWD, PointwiseMode.ELU_FWD, PointwiseMode.SWISH_FWD,
        PointwiseMode.SOFTPLUS_FWD,
    }
)


def _step(node: Node, prev: str, weights: set[str]) -> str | None:
    if node.kind != OpKind.POINTWISE:
        return None
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    if attrs.mode == PointwiseMode.RELU_FWD:
        return "relu"
    if attrs.mode in _ACTS:
        return "act"
    if attrs.mode == PointwiseMode.ADD:
        other = [t for t in node.inputs.values() if t.name != prev]
        if other and (other[0].name in weights or other[0].is_scalar):
            return "bias"
        return "add"
    return None


def label_fusions(graph: Graph, weights: Iterable[str]) -> dict[str, int]:
    """Names each conv/matmul's chain of fused pointwise ops (stored in ``node.meta``)."""
    wset = set(weights)
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for t in n.inputs.values():
            readers.setdefault(id(t), []).append(n)
    counts: dict[str, int] = collections.Counter()
    for anchor in graph.nodes:
        if anchor.kind not in (OpKind.CONV_FPROP, OpKind.MATMUL):
            continue
        tags: list[str] = []
        out = next(iter(anchor.outputs.values()))
        while len(tags) < 3:
            rs = readers.get(id(out), [])
            if len(rs) != 1 or out.is_output:
                break
            tag = _step(rs[0], out.name, wset)
            if tag is None:
                break
            tags.append(tag)
            out = rs[0].outputs["y"]
        for pat in FUSIONS:
            if anchor.kind in pat.anchor and tuple(tags[: len(pat.steps)]) == pat.steps:
                anchor.meta["fusion"] = pat.name
                counts[pat.name] += 1
                break
    for n in graph.nodes:  # the nodes a transformer pattern's fused node lowered to
        pattern = n.meta.get("pattern")
        if isinstance(pattern, str):
            counts[pattern] += 1
    return dict(counts)

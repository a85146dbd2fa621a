"""Normalizations, softmax and reductions: BatchNormalization (folded to a per-channel
scale and shift when its statistics are constant), LayerNormalization, InstanceNormalization,
LRN, Softmax/LogSoftmax, Reduce*; the fused RMS / layer norms of ``patterns_norms`` and ONNX
Runtime's ``SimplifiedLayerNormalization``, ``SkipLayerNormalization`` and
``SkipSimplifiedLayerNormalization`` (what its transformer optimizer emits)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fusegraph.graph.ops import PoolingMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import channel_vector, ints, is_read, per_channel, reshape, rows
from fusegraph.onnx.ops.table import Unmappable, contrib, fused, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


@lowers("BatchNormalization")
def lower_batchnorm(imp: Importer, node: ONode) -> None:
    if int(node.attr("training_mode", 0)):
        raise Unmappable("BatchNormalization: training_mode=1 (inference only)")
    if imp.og.opset < 9 and int(node.attr("spatial", 1)) == 0:
        raise Unmappable("BatchNormalization: spatial=0")
    if imp.og.opset < 7 and not int(node.attr("is_test", 0)):
        raise Unmappable("BatchNormalization: is_test=0")
    for extra in node.outputs[1:]:
        if extra and is_read(imp, extra):
            raise Unmappable(f"BatchNormalization: statistics output '{extra}' is used (inference only)")
    eps = float(node.attr("epsilon", 1e-5))
    xs = imp.shape(node.inputs[0])
    x = imp.tensor(node.inputs[0])
    names = node.inputs[1:5]
    if all(imp.is_const(n) for n in names):
        scale, bias, mean, var = (imp.og.constants[n].astype(np.float64) for n in names)
        a = scale / np.sqrt(var + eps)
        b = bias - mean * a
        dt = x.dtype.numpy
        at = imp.constant(per_channel(a.astype(dt), len(xs)), f"{names[0]}_folded")
        bt = imp.constant(per_channel(b.astype(dt), len(xs)), f"{names[1]}_folded")
        imp.set(node.outputs[0], imp.g.add(imp.g.mul(x, at), bt))
        return
    ts, tb, tm, tv = (imp.tensor(n, "plain") for n in names)
    imp.set(node.outputs[0], imp.g.batchnorm_inference(x, ts, tb, tm, tv, epsilon=eps))


@lowers("LayerNormalization")
def lower_layernorm(imp: Importer, node: ONode) -> None:
    for extra in node.outputs[1:]:
        if extra and is_read(imp, extra):
            raise Unmappable(f"LayerNormalization: output '{extra}' (Mean/InvStdDev) is used")
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", -1)) % len(xs)
    if axis == 0:
        raise Unmappable("LayerNormalization: axis=0 (normalizing over the batch axis too)")
    eps = float(node.attr("epsilon", 1e-5))
    x = imp.tensor(node.inputs[0], "plain")
    x2, _, inner = rows(imp, x, axis)
    feat = tuple(xs[axis:])

    def param(name: str | None, fill: float) -> TensorAttr:
        if name and imp.is_const(name):
            arr = np.broadcast_to(imp.og.constants[name], feat).reshape(1, inner)
            return imp.constant(np.ascontiguousarray(arr), name, "plain")
        if name:
            t = imp.tensor(name, "plain")
            if tuple(t.dim) != feat:
                raise Unmappable(f"LayerNormalization: non-constant '{name}' {t.dim} must have dims {list(feat)}")
            return reshape(imp, t, (1, inner))
        return imp.constant(np.full((1, inner), fill, dtype=imp.dtype(node.inputs[0]).numpy), "ln_zero_bias", "plain")

    scale = param(node.inputs[1], 1.0)
    bias = param(node.inputs[2] if len(node.inputs) > 2 else None, 0.0)
    y, _, _ = imp.g.layernorm(x2, scale, bias, epsilon=eps)
    imp.set(node.outputs[0], reshape(imp, y, xs))


@lowers("InstanceNormalization")
def lower_instancenorm(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"InstanceNormalization: input rank {len(xs)} < 3")
    eps = float(node.attr("epsilon", 1e-5))
    x = imp.tensor(node.inputs[0], "plain")
    n, c, sp = xs[0], xs[1], math.prod(xs[2:])
    dt = imp.dtype(node.inputs[0]).numpy  # the model's type: a reshape's output may not have inferred it yet
    x2 = reshape(imp, x, (n * c, sp))
    ones = imp.constant(np.ones((1, sp), dtype=dt), "in_one", "plain")
    zeros = imp.constant(np.zeros((1, sp), dtype=dt), "in_zero", "plain")
    y, _, _ = imp.g.layernorm(x2, ones, zeros, epsilon=eps)
    y = reshape(imp, y, xs)
    y = imp.g.mul(y, channel_vector(imp, node.inputs[1], len(xs)))
    y = imp.g.add(y, channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


@lowers("LRN", spatial=True)
def lower_lrn(imp: Importer, node: ONode) -> None:
    """x / (bias + alpha/size * sum of squares over a channel window) ** beta.

    The channel-window sum is an average pool over a [N, 1, C, spatial] view of x².
    """
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"LRN: input rank {len(xs)} < 3")
    size = int(node.attr("size"))
    alpha, beta = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    if size < 1:
        raise Unmappable(f"LRN: size={size}")
    x = imp.tensor(node.inputs[0])
    n, c, sp = xs[0], xs[1], math.prod(xs[2:])
    sq = imp.g.mul(x, x)
    v = reshape(imp, sq, (n, 1, c, sp))
    pre, post = (size - 1) // 2, size - 1 - (size - 1) // 2
    if size == 1:
        avg = v
    else:
        avg = imp.g.pooling(
            v, PoolingMode.AVG_INCLUDE_PAD, window=(size, 1), stride=(1, 1),
            pre_padding=(pre, 0), post_padding=(post, 0),
        )
    avg = reshape(imp, avg, xs)
    t = imp.g.add(imp.g.mul(avg, imp.scalar(alpha, x.dtype)), imp.scalar(bias, x.dtype))
    den = imp.g.pow(t, imp.scalar(beta, x.dtype))
    imp.set(node.outputs[0], imp.g.div(x, den))


_REDUCE = {
    "ReduceSum": ReductionMode.SUM, "ReduceMean": ReductionMode.AVG, "ReduceMax": ReductionMode.MAX,
    "ReduceMin": ReductionMode.MIN, "ReduceProd": ReductionMode.MUL, "ReduceL1": ReductionMode.NORM1,
    "ReduceL2": ReductionMode.NORM2, "ReduceSumSquare": ReductionMode.SUM, "ReduceLogSum": ReductionMode.SUM,
}


@lowers(*_REDUCE)
def lower_reduce(imp: Importer, node: ONode) -> None:
    op = node.op_type
    xs = imp.shape(node.inputs[0])
    axes_as_input = imp.og.opset >= (13 if op == "ReduceSum" else 18)
    if axes_as_input:
        axes_v = imp.const(node.inputs[1], "axes") if len(node.inputs) > 1 and node.inputs[1] else None
        axes = ints(axes_v.reshape(-1)) if axes_v is not None else []
    else:
        axes = ints(node.attr("axes", []))
    keep = int(node.attr("keepdims", 1))
    x = imp.tensor(node.inputs[0], "plain")
    if not axes:
        if int(node.attr("noop_with_empty_axes", 0)):
            imp.set(node.outputs[0], imp.g.identity(x))
            return
        axes = list(range(len(xs)))
    axes = sorted({a % len(xs) for a in axes})
    if not keep and len(axes) == len(xs):
        raise Unmappable(f"{op}: keepdims=0 over every axis gives a rank-0 tensor")
    src = imp.g.mul(x, x) if op == "ReduceSumSquare" else x
    y = imp.g.reduction(src, _REDUCE[op], axes=axes)
    if op == "ReduceLogSum":
        y = imp.g.log(y)
    if not keep:
        y = reshape(imp, y, [d for i, d in enumerate(xs) if i not in axes])
    imp.set(node.outputs[0], y)


@lowers("Softmax", "LogSoftmax")
def lower_softmax(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    log = node.op_type == "LogSoftmax"
    x = imp.tensor(node.inputs[0], "plain")
    if imp.og.opset < 13:
        axis = int(node.attr("axis", 1)) % len(xs)
        if axis == len(xs) - 1:
            y = imp.g.softmax(x, axis=axis, log=log)
        else:
            x2, _, _ = rows(imp, x, axis)
            y = reshape(imp, imp.g.softmax(x2, axis=1, log=log), xs)
    else:
        axis = int(node.attr("axis", -1)) % len(xs)
        y = imp.g.softmax(x, axis=axis, log=log)
    imp.set(node.outputs[0], y)


# ---- transformer norms -------------------------------------------------------------------------
def _rows_norm(
    imp: Importer, x: TensorAttr, axis: int, scale: str, bias: str, eps: float, rms: bool
) -> TensorAttr:
    """x normalized over its axes from ``axis`` on (layer norm or RMS norm), times ``scale``
    (+ ``bias``), each broadcast over those axes; x's dims."""
    xs = tuple(x.dim)
    x2, _, inner = rows(imp, x, axis)
    feat = xs[axis:]

    def param(name: str, fill: float) -> TensorAttr:
        if name and imp.is_const(name):
            arr = np.broadcast_to(imp.og.constants[name], feat).reshape(1, inner)
            return imp.constant(np.ascontiguousarray(arr), name, "plain")
        if name:
            t = imp.tensor(name, "plain")
            if math.prod(t.dim) != inner:
                raise Unmappable(f"{imp.op}: non-constant '{name}' {t.dim} does not hold one value per normalized element {list(feat)}")
            return reshape(imp, t, (1, inner))
        return imp.constant(np.full((1, inner), fill, dtype=x.dtype.numpy), "norm_fill", "plain")

    if rms:
        y, _ = imp.g.rmsnorm(x2, param(scale, 1.0), epsilon=eps, bias=param(bias, 0.0) if bias else None)
    else:
        y, _, _ = imp.g.layernorm(x2, param(scale, 1.0), param(bias, 0.0), epsilon=eps)
    _pattern(imp, y, "norm.rms" if rms else "norm.layer")
    return reshape(imp, y, xs)


def _pattern(imp: Importer, t: TensorAttr, pattern: str) -> None:
    for n in reversed(imp.g.nodes):
        if any(o is t for o in n.outputs.values()):
            n.meta["pattern"] = pattern
            return


def _role(node: ONode, name: str) -> str:
    i = node.attr(name)
    return node.inputs[int(i)] if i is not None else ""


@lowers(fused("RmsNorm"))
def lower_fused_rms(imp: Importer, node: ONode) -> None:
    x = imp.tensor(_role(node, "x"), "plain")
    y = _rows_norm(imp, x, int(node.attr("axis")), _role(node, "scale"), "", float(node.attr("epsilon")), rms=True)
    imp.set(node.outputs[0], y)


@lowers(fused("LayerNorm"))
def lower_fused_layer(imp: Importer, node: ONode) -> None:
    x = imp.tensor(_role(node, "x"), "plain")
    y = _rows_norm(imp, x, int(node.attr("axis")), _role(node, "scale"), _role(node, "bias"),
                   float(node.attr("epsilon")), rms=False)
    imp.set(node.outputs[0], y)


def _unread(imp: Importer, node: ONode, positions: range, what: str) -> None:
    for k in positions:
        if k < len(node.outputs) and node.outputs[k] and is_read(imp, node.outputs[k]):
            raise Unmappable(f"{node.op_type}: output '{node.outputs[k]}' ({what}) is used")


@lowers("SimplifiedLayerNormalization")
def lower_simplified_layernorm(imp: Importer, node: ONode) -> None:
    """ONNX Runtime's RMS norm (default domain): x / sqrt(mean(x^2) + eps) * scale."""
    _unread(imp, node, range(1, 2), "the inverse RMS")
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", -1)) % len(xs)
    if axis == 0:
        raise Unmappable("SimplifiedLayerNormalization: axis=0 (normalizing over the batch axis too)")
    x = imp.tensor(node.inputs[0], "plain")
    y = _rows_norm(imp, x, axis, node.inputs[1], "", float(node.attr("epsilon", 1e-5)), rms=True)
    imp.set(node.outputs[0], y)


def _skip_sum(imp: Importer, node: ONode, bias_at: int) -> tuple[TensorAttr, float]:
    """input + skip (+ bias): what Skip*LayerNormalization normalizes; its 4th output."""
    if "epsilon" not in node.attrs:
        raise Unmappable(f"{node.op_type}: no epsilon attribute (fusegraph does not assume ONNX Runtime's default)")
    xs = imp.shape(node.inputs[0])
    if len(xs) != 3:
        raise Unmappable(f"{node.op_type}: input {list(xs)} is not 3-D")
    x = imp.tensor(node.inputs[0], "plain")
    s = imp.g.add(x, imp.tensor(node.inputs[1], "plain"))
    if tuple(s.dim) != xs:
        raise Unmappable(f"{node.op_type}: skip {list(imp.shape(node.inputs[1]))} broadcasts input {list(xs)} up")
    if len(node.inputs) > bias_at and node.inputs[bias_at]:
        s = imp.g.add(s, imp.tensor(node.inputs[bias_at], "plain"))
    if len(node.outputs) > 3 and node.outputs[3]:
        imp.set(node.outputs[3], s)
    return s, float(node.attr("epsilon"))


@lowers(contrib("SkipLayerNormalization"))
def lower_skip_layernorm(imp: Importer, node: ONode) -> None:
    """LayerNorm(input + skip + bias) * gamma + beta over the last axis."""
    _unread(imp, node, range(1, 3), "mean / inverse std")
    s, eps = _skip_sum(imp, node, 4)
    beta = node.inputs[3] if len(node.inputs) > 3 else ""
    imp.set(node.outputs[0], _rows_norm(imp, s, 2, node.inputs[2], beta, eps, rms=False))


@lowers(contrib("SkipSimplifiedLayerNormalization"))
def lower_skip_simplified_layernorm(imp: Importer, node: ONode) -> None:
    """RMSNorm(input + skip + bias) * gamma over the last axis."""
    _unread(imp, node, range(1, 3), "mean / inverse std")
    s, eps = _skip_sum(imp, node, 3)
    imp.set(node.outputs[0], _rows_norm(imp, s, 2, node.inputs[2], "", eps, rms=True))

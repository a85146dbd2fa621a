"""Float64 NumPy implementations of every op, each written from the op's definition.

This module is the living specification: every other engine is tested against it. Speed
is not a goal; clarity is. Inputs arrive in logical layout (dims order) as float64 (bool
stays bool); results are float64 (or bool) and the executor casts them to output dtypes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
from scipy import special

from fusegraph.errors import ExecutionError
from fusegraph.graph.infer import conv_groups
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    ConcatAttrs,
    ConvAttrs,
    GatherAttrs,
    GatherBackwardAttrs,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
    PoolingAttrs,
    PoolingMode,
    ReductionAttrs,
    ReductionMode,
    SliceAttrs,
    SoftmaxAttrs,
    TransposeAttrs,
)
from fusegraph.reference.attention import _softmax, sdpa, sdpa_backward
from fusegraph.reference.backward import NORM_BACKWARD

Arr = np.ndarray
Arrays = dict[str, Arr]
M = PointwiseMode


# ---- convolutions --------------------------------------------------------------------------
def _windows(attrs: ConvAttrs, kernel: tuple[int, ...], out: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """(kernel position, slices into the padded input) for every kernel tap."""
    for kpos in itertools.product(*(range(k) for k in kernel)):
        sl = tuple(
            slice(kp * d, kp * d + s * (o - 1) + 1, s)
            for kp, d, s, o in zip(kpos, attrs.dilation, attrs.stride, out, strict=True)
        )
        yield kpos, sl


def _pad(x: Arr, attrs: ConvAttrs) -> Arr:
    pads = [(0, 0), (0, 0), *zip(attrs.pre_padding, attrs.post_padding, strict=True)]
    return np.pad(x, pads)


def conv_fprop(node: Node, ins: Arrays) -> Arrays:
    x, w = ins["x"], ins["w"]
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    g = conv_groups(node)
    n, c = x.shape[:2]
    k = w.shape[0]
    out_sp = tuple(node.outputs["y"].shape[2:])
    xp = _pad(x, attrs).reshape(n, g, c // g, *(np.array(x.shape[2:]) + attrs.pre_padding + attrs.post_padding))
    wg = w.reshape(g, k // g, c // g, *w.shape[2:])
    y = np.zeros((n, g, k // g, *out_sp))
    for kpos, sl in _windows(attrs, w.shape[2:], out_sp):
        patch = xp[(slice(None),) * 3 + sl]
        y += np.einsum("ngc...,gkc->ngk...", patch, wg[(Ellipsis, *kpos)])
    return {"y": y.reshape(n, k, *out_sp)}


def conv_dgrad(node: Node, ins: Arrays) -> Arrays:
    """The adjoint of conv_fprop with respect to its image."""
    dy, w = ins["dy"], ins["w"]
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    dx_shape = node.outputs["dx"].shape
    g = conv_groups(node)
    n, c = dx_shape[:2]
    k = w.shape[0]
    out_sp = dy.shape[2:]
    padded = tuple(np.array(dx_shape[2:]) + attrs.pre_padding + attrs.post_padding)
    dxp = np.zeros((n, g, c // g, *padded))
    dyg = dy.reshape(n, g, k // g, *out_sp)
    wg = w.reshape(g, k // g, c // g, *w.shape[2:])
    for kpos, sl in _windows(attrs, w.shape[2:], out_sp):
        dxp[(slice(None),) * 3 + sl] += np.einsum("ngk...,gkc->ngc...", dyg, wg[(Ellipsis, *kpos)])
    crop = tuple(slice(p, p + d) for p, d in zip(attrs.pre_padding, dx_shape[2:], strict=True))
    return {"dx": dxp[(slice(None),) * 3 + crop].reshape(dx_shape)}


def conv_wgrad(node: Node, ins: Arrays) -> Arrays:
    """The adjoint of conv_fprop with respect to its filter."""
    x, dy = ins["x"], ins["dy"]
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    dw_shape = node.outputs["dw"].shape
    g = conv_groups(node)
    n, c = x.shape[:2]
    k = dw_shape[0]
    out_sp = dy.shape[2:]
    xp = _pad(x, attrs).reshape(n, g, c // g, *(np.array(x.shape[2:]) + attrs.pre_padding + attrs.post_padding))
    dyg = dy.reshape(n, g, k // g, -1)  # output positions flattened into one axis
    dw = np.zeros((g, k // g, c // g, *dw_shape[2:]))
    for kpos, sl in _windows(attrs, dw_shape[2:], out_sp):
        patch = xp[(slice(None),) * 3 + sl].reshape(n, g, c // g, -1)
        dw[(Ellipsis, *kpos)] = np.einsum("ngkp,ngcp->gkc", dyg, patch)
    return {"dw": dw.reshape(dw_shape)}


# ---- matmul and pointwise -----------------------------------------------------------------
def matmul(node: Node, ins: Arrays) -> Arrays:
    return {"c": np.matmul(ins["a"], ins["b"])}


def _sigmoid(x: Arr) -> Arr:
    return special.expit(x)  # type: ignore[no-any-return]


def _relu(x: Arr, lower: float, upper: float, slope: float) -> Arr:
    return np.where(x <= lower, lower + slope * (x - lower), np.minimum(x, upper))


def _gelu_grad(x: Arr) -> Arr:
    cdf = 0.5 * (1.0 + special.erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf  # type: ignore[no-any-return]


def _gelu_tanh_grad(x: Arr) -> Arr:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    t = np.tanh(_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)  # type: ignore[no-any-return]


def _swish_grad(x: Arr, beta: float) -> Arr:
    """d/dx of x sigmoid(beta x)."""
    s = _sigmoid(beta * x)
    return s + beta * x * s * (1.0 - s)  # type: ignore[no-any-return]


def _int_div(a: Arr, b: Arr) -> Arr:
    return np.asarray(np.trunc(a / b))


Pointwise = Callable[[Arr, Arr, Arr, PointwiseAttrs], Arr]
_C = math.sqrt(2.0 / math.pi)

POINTWISE_FNS: dict[PointwiseMode, Pointwise] = {
    M.ADD: lambda a, b, c, p: a + b,
    M.SUB: lambda a, b, c, p: a - b,
    M.MUL: lambda a, b, c, p: a * b,
    M.DIV: lambda a, b, c, p: a / b,
    M.MAX: lambda a, b, c, p: np.maximum(a, b),
    M.MIN: lambda a, b, c, p: np.minimum(a, b),
    M.POW: lambda a, b, c, p: np.power(a, b),
    M.ABS: lambda a, b, c, p: np.abs(a),
    M.NEG: lambda a, b, c, p: -a,
    M.EXP: lambda a, b, c, p: np.exp(a),
    M.LOG: lambda a, b, c, p: np.log(a),
    M.SQRT: lambda a, b, c, p: np.sqrt(a),
    M.RSQRT: lambda a, b, c, p: 1.0 / np.sqrt(a),
    M.RECIPROCAL: lambda a, b, c, p: 1.0 / a,
    M.SIN: lambda a, b, c, p: np.sin(a),
    M.COS: lambda a, b, c, p: np.cos(a),
    M.ERF: lambda a, b, c, p: special.erf(a),
    M.FLOOR: lambda a, b, c, p: np.floor(a),
    M.CEIL: lambda a, b, c, p: np.ceil(a),
    M.IDENTITY: lambda a, b, c, p: a,
    M.RELU_FWD: lambda a, b, c, p: _relu(
        a, p.param("relu_lower_clip"), p.param("relu_upper_clip"), p.param("relu_lower_clip_slope")
    ),
    M.TANH_FWD: lambda a, b, c, p: np.tanh(a),
    M.SIGMOID_FWD: lambda a, b, c, p: _sigmoid(a),
    M.GELU_FWD: lambda a, b, c, p: 0.5 * a * (1.0 + special.erf(a / math.sqrt(2.0))),
    M.GELU_APPROX_TANH_FWD: lambda a, b, c, p: 0.5 * a * (1.0 + np.tanh(_C * (a + 0.044715 * a**3))),
    M.ELU_FWD: lambda a, b, c, p: np.where(a > 0, a, p.param("elu_alpha") * np.expm1(a)),
    M.SWISH_FWD: lambda a, b, c, p: a * _sigmoid(p.param("swish_beta") * a),
    M.SOFTPLUS_FWD: lambda a, b, c, p: np.logaddexp(0.0, p.param("softplus_beta") * a)
    / p.param("softplus_beta"),
    M.CMP_EQ: lambda a, b, c, p: a == b,
    M.CMP_NEQ: lambda a, b, c, p: a != b,
    M.CMP_GT: lambda a, b, c, p: a > b,
    M.CMP_GE: lambda a, b, c, p: a >= b,
    M.CMP_LT: lambda a, b, c, p: a < b,
    M.CMP_LE: lambda a, b, c, p: a <= b,
    M.LOGICAL_AND: lambda a, b, c, p: np.logical_and(a, b),
    M.LOGICAL_OR: lambda a, b, c, p: np.logical_or(a, b),
    M.LOGICAL_NOT: lambda a, b, c, p: np.logical_not(a),
    M.BINARY_SELECT: lambda a, b, c, p: np.where(c != 0, a, b),  # an integer condition: nonzero
    M.RELU_BWD: lambda dy, x, c, p: dy * (x > p.param("relu_lower_clip")),
    M.GELU_BWD: lambda dy, x, c, p: dy * _gelu_grad(x),
    M.TANH_BWD: lambda dy, x, c, p: dy * (1.0 - np.tanh(x) ** 2),
    M.SIGMOID_BWD: lambda dy, x, c, p: dy * _sigmoid(x) * (1.0 - _sigmoid(x)),
    M.ELU_BWD: lambda dy, x, c, p: dy * np.where(x > 0, 1.0, p.param("elu_alpha") * np.exp(np.minimum(x, 0.0))),
    M.GELU_APPROX_TANH_BWD: lambda dy, x, c, p: dy * _gelu_tanh_grad(x),
    M.SOFTPLUS_BWD: lambda dy, x, c, p: dy * _sigmoid(p.param("softplus_beta") * x),
    M.SWISH_BWD: lambda dy, x, c, p: dy * _swish_grad(x, p.param("swish_beta")),
}


def pointwise(node: Node, ins: Arrays) -> Arrays:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    a, b, c = ins["a"], ins.get("b"), ins.get("c")
    out_int = node.outputs["y"].dtype.is_integer
    if attrs.mode == M.DIV and out_int:
        y = _int_div(a, b)  # type: ignore[arg-type]
    else:
        with np.errstate(all="ignore"):
            y = POINTWISE_FNS[attrs.mode](a, b, c, attrs)  # type: ignore[arg-type]
    return {"y": np.broadcast_to(y, node.outputs["y"].shape)}


# ---- reductions and norms -----------------------------------------------------------------
def reduction(node: Node, ins: Arrays) -> Arrays:
    attrs = node.attrs
    assert isinstance(attrs, ReductionAttrs)
    x = ins["x"]
    out = node.outputs["y"].shape
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, out, strict=True)) if a != b)
    fns: dict[ReductionMode, Callable[[Arr], Arr]] = {
        ReductionMode.SUM: lambda v: np.sum(v, axis=axes, keepdims=True),
        ReductionMode.MIN: lambda v: np.min(v, axis=axes, keepdims=True),
        ReductionMode.MAX: lambda v: np.max(v, axis=axes, keepdims=True),
        ReductionMode.AMAX: lambda v: np.max(np.abs(v), axis=axes, keepdims=True),
        ReductionMode.AVG: lambda v: np.mean(v, axis=axes, keepdims=True),
        ReductionMode.MUL: lambda v: np.prod(v, axis=axes, keepdims=True),
        ReductionMode.NORM1: lambda v: np.sum(np.abs(v), axis=axes, keepdims=True),
        ReductionMode.NORM2: lambda v: np.sqrt(np.sum(v * v, axis=axes, keepdims=True)),
    }
    return {"y": fns[attrs.mode](x)}


def _channel(v: Arr, rank: int) -> Arr:
    return v.reshape((1, -1) + (1,) * (rank - 2))


def batchnorm_inference(node: Node, ins: Arrays) -> Arrays:
    x = ins["x"]
    r = x.ndim
    eps = float(ins["epsilon"].reshape(-1)[0])
    mean, var = _channel(ins["mean"], r), _channel(ins["var"], r)
    y = (x - mean) / np.sqrt(var + eps) * _channel(ins["scale"], r) + _channel(ins["bias"], r)
    return {"y": y}


def batchnorm(node: Node, ins: Arrays) -> Arrays:
    x = ins["x"]
    r = x.ndim
    eps = float(ins["epsilon"].reshape(-1)[0])
    axes = (0, *range(2, r))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + eps)
    y = (x - mean) * inv * _channel(ins["scale"], r) + _channel(ins["bias"], r)
    out = {"y": y, "mean": mean, "inv_var": inv}
    if "in_running_mean" in ins:
        # cuDNN's and PyTorch's update: the running variance takes the unbiased batch variance
        m = float(ins["momentum"].reshape(-1)[0])
        count = x.size // x.shape[1]
        rm, rv = ins["in_running_mean"], ins["in_running_var"]
        out["next_running_mean"] = (1.0 - m) * rm + m * mean.reshape(rm.shape)
        out["next_running_var"] = (1.0 - m) * rv + m * (var * count / (count - 1)).reshape(rv.shape)
    return out


def layernorm(node: Node, ins: Arrays) -> Arrays:
    x = ins["x"]
    eps = float(ins["epsilon"].reshape(-1)[0])
    axes = tuple(range(1, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + eps)
    y = (x - mean) * inv * ins["scale"] + ins["bias"]
    out = {"y": y}
    if "mean" in node.outputs:
        out["mean"], out["inv_var"] = mean, inv
    return out


def rmsnorm(node: Node, ins: Arrays) -> Arrays:
    x = ins["x"]
    eps = float(ins["epsilon"].reshape(-1)[0])
    axes = tuple(range(1, x.ndim))
    inv = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    y = x * inv * ins["scale"]
    if "bias" in ins:
        y = y + ins["bias"]
    out = {"y": y}
    if "inv_rms" in node.outputs:
        out["inv_rms"] = inv
    return out


# ---- pooling, attention, softmax -----------------------------------------------------------
def pooling(node: Node, ins: Arrays) -> Arrays:
    x = ins["x"]
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    out_sp = node.outputs["y"].shape[2:]
    pads = [(0, 0), (0, 0), *zip(attrs.pre_padding, attrs.post_padding, strict=True)]
    is_max = attrs.mode == PoolingMode.MAX
    xp = np.pad(x, pads, constant_values=-np.inf if is_max else 0.0)
    valid = np.pad(np.ones(x.shape[2:]), pads[2:])  # 1 where a real element is
    acc = np.full((*x.shape[:2], *out_sp), -np.inf if is_max else 0.0)
    count = np.zeros(out_sp)
    for kpos in itertools.product(*(range(w) for w in attrs.window)):
        sl = tuple(
            slice(k, k + s * (o - 1) + 1, s) for k, s, o in zip(kpos, attrs.stride, out_sp, strict=True)
        )
        patch = xp[(slice(None), slice(None), *sl)]
        acc = np.maximum(acc, patch) if is_max else acc + patch
        count += valid[sl]
    if attrs.mode == PoolingMode.AVG_INCLUDE_PAD:
        acc = acc / math.prod(attrs.window)
    elif attrs.mode == PoolingMode.AVG_EXCLUDE_PAD:
        acc = acc / count
    return {"y": acc}


def pooling_backward(node: Node, ins: Arrays) -> Arrays:
    """dx of pooling: each output's dy goes to the first maximum of its window in row-major
    window order (a later tie never replaces it: PyTorch's rule), or is spread over the
    window divided as the forward divides. Computed on the padded input, then cropped: what
    lands on padding is dropped."""
    dy, x = ins["dy"], ins["x"]
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    out_sp = dy.shape[2:]
    pads = [(0, 0), (0, 0), *zip(attrs.pre_padding, attrs.post_padding, strict=True)]
    is_max = attrs.mode == PoolingMode.MAX
    windows = [
        tuple(slice(k, k + s * (o - 1) + 1, s) for k, s, o in zip(kpos, attrs.stride, out_sp, strict=True))
        for kpos in itertools.product(*(range(w) for w in attrs.window))
    ]
    dxp = np.zeros(np.pad(x, pads).shape)
    if is_max:
        xp = np.pad(x, pads, constant_values=-np.inf)
        best = np.full(dy.shape, -np.inf)
        arg = np.full(dy.shape, -1)  # which window position holds the first maximum
        for i, sl in enumerate(windows):
            patch = xp[(slice(None), slice(None), *sl)]
            better = (patch > best) | (arg < 0)
            best = np.where(better, patch, best)
            arg = np.where(better, i, arg)
        for i, sl in enumerate(windows):
            dxp[(slice(None), slice(None), *sl)] += np.where(arg == i, dy, 0.0)
    else:
        if attrs.mode == PoolingMode.AVG_INCLUDE_PAD:
            share = dy / math.prod(attrs.window)
        else:
            valid = np.pad(np.ones(x.shape[2:]), pads[2:])
            share = dy / sum(valid[sl] for sl in windows)
        for sl in windows:
            dxp[(slice(None), slice(None), *sl)] += share
    crop = tuple(slice(p, p + n) for p, n in zip(attrs.pre_padding, x.shape[2:], strict=True))
    return {"dx": dxp[(slice(None), slice(None), *crop)]}


def softmax(node: Node, ins: Arrays) -> Arrays:
    attrs = node.attrs
    assert isinstance(attrs, SoftmaxAttrs)
    x = ins["x"]
    if attrs.log:
        m = np.max(x, axis=attrs.axis, keepdims=True)
        return {"y": x - m - np.log(np.exp(x - m).sum(axis=attrs.axis, keepdims=True))}
    return {"y": _softmax(x, attrs.axis)}


# ---- data movement ---------------------------------------------------------------------------
def reshape(node: Node, ins: Arrays) -> Arrays:
    return {"y": ins["x"].reshape(node.outputs["y"].shape)}


def transpose(node: Node, ins: Arrays) -> Arrays:
    assert isinstance(node.attrs, TransposeAttrs)
    return {"y": np.transpose(ins["x"], node.attrs.permutation)}


def concatenate(node: Node, ins: Arrays) -> Arrays:
    assert isinstance(node.attrs, ConcatAttrs)
    parts = [ins[p] for p in node.inputs if p.startswith("x")]
    return {"y": np.concatenate(parts, axis=node.attrs.axis)}


def slice_(node: Node, ins: Arrays) -> Arrays:
    a = node.attrs
    assert isinstance(a, SliceAttrs)
    idx = tuple(slice(s, e, k) for s, e, k in zip(a.starts, a.ends, a.steps, strict=True))
    return {"y": ins["x"][idx]}


# ---- indexing ----------------------------------------------------------------------------------
def _index_values(node: Node, raw: Arr, rows: int) -> Arr:
    """The indices as int64 in ``[0, rows)``: negative ones wrap (ONNX), any outside
    ``[-rows, rows)`` is an ExecutionError naming the indices tensor (never a clamp)."""
    idx = np.asarray(raw).astype(np.int64)
    bad = (idx < -rows) | (idx >= rows)
    if bad.any():
        first = int(idx[bad].reshape(-1)[0])
        raise ExecutionError(
            f"{int(bad.sum())} index value(s) out of range [-{rows}, {rows}) for a gather over {rows} rows "
            f"(the first: {first})",
            node=node.name,
            tensor=node.inputs["indices"].name,
        )
    return np.where(idx < 0, idx + rows, idx)


def gather(node: Node, ins: Arrays) -> Arrays:
    attrs = node.attrs
    assert isinstance(attrs, GatherAttrs)
    data = ins["data"]
    axis = attrs.axis % data.ndim
    return {"y": np.take(data, _index_values(node, ins["indices"], data.shape[axis]), axis=axis)}


def gather_backward(node: Node, ins: Arrays) -> Arrays:
    """Zeros with every ``dy`` slice added into the row its index names (``np.add.at`` sums
    repeats); the padding row's gradient is zero."""
    attrs = node.attrs
    assert isinstance(attrs, GatherBackwardAttrs)
    dy = ins["dy"]
    n = attrs.num_rows
    idx = _index_values(node, ins["indices"], n).reshape(-1)
    rows = dy.reshape(idx.size, *dy.shape[ins["indices"].ndim:])
    out = np.zeros((n, *rows.shape[1:]), dtype=dy.dtype)
    np.add.at(out, idx, rows)
    if attrs.padding_idx is not None:
        out[attrs.padding_idx % n] = 0.0
    return {"d_data": out}


REFERENCE: dict[OpKind, Callable[[Node, Arrays], Arrays]] = {
    OpKind.CONV_FPROP: conv_fprop,
    OpKind.CONV_DGRAD: conv_dgrad,
    OpKind.CONV_WGRAD: conv_wgrad,
    OpKind.MATMUL: matmul,
    OpKind.POINTWISE: pointwise,
    OpKind.REDUCTION: reduction,
    OpKind.BATCHNORM_INFERENCE: batchnorm_inference,
    OpKind.BATCHNORM: batchnorm,
    OpKind.LAYERNORM: layernorm,
    OpKind.RMSNORM: rmsnorm,
    OpKind.POOLING: pooling,
    OpKind.POOLING_BACKWARD: pooling_backward,
    OpKind.SDPA: sdpa,
    OpKind.SOFTMAX: softmax,
    OpKind.RESHAPE: reshape,
    OpKind.TRANSPOSE: transpose,
    OpKind.CONCATENATE: concatenate,
    OpKind.SLICE: slice_,
    OpKind.SDPA_BACKWARD: sdpa_backward,
    OpKind.GATHER: gather,
    OpKind.GATHER_BACKWARD: gather_backward,
    **NORM_BACKWARD,
}

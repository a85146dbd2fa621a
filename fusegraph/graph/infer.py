"""Shape and dtype inference, one function per op kind, with checks that name the culprit.

Each function returns the proposed ``(dims, dtype)`` of every output port; the caller
(``Graph.validate``) checks them against what the user stated and fills the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from fusegraph.dtypes import DataType, family, promote
from fusegraph.graph.infer_attention import ATTENTION_INFER
from fusegraph.graph.infer_backward import BACKWARD_INFER
from fusegraph.graph.infer_base import (
    Dims,
    Proposal,
    broadcast_dims,
    fail,
    same_float_type,
    same_type,
)
from fusegraph.graph.infer_gather import GATHER_INFER
from fusegraph.graph.infer_norms import NORM_INFER
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    POINTWISE,
    ConcatAttrs,
    ConvAttrs,
    OpKind,
    PointwiseAttrs,
    PoolingAttrs,
    SliceAttrs,
    SoftmaxAttrs,
    TransposeAttrs,
)
from fusegraph.graph.tensor import TensorAttr


def conv_output_spatial(
    node: Node, inp: Sequence[int], kernel: Sequence[int], attrs: ConvAttrs
) -> Dims:
    out = []
    for i, (x, k) in enumerate(zip(inp, kernel, strict=True)):
        span = attrs.dilation[i] * (k - 1) + 1
        size = (x + attrs.pre_padding[i] + attrs.post_padding[i] - span) // attrs.stride[i] + 1
        if size < 1:
            raise fail(
                node,
                f"spatial axis {i}: input {x} with padding "
                f"{attrs.pre_padding[i]}+{attrs.post_padding[i]} is smaller than the "
                f"dilated window {span}",
            )
        out.append(size)
    return tuple(out)


def conv_groups(node: Node) -> int:
    """Groups of a convolution node, from channel counts (as cuDNN infers them)."""
    if node.kind == OpKind.CONV_FPROP:
        c, wc = node.inputs["x"].shape[1], node.inputs["w"].shape[1]
    elif node.kind == OpKind.CONV_DGRAD:
        c, wc = node.outputs["dx"].shape[1], node.inputs["w"].shape[1]
    else:
        c, wc = node.inputs["x"].shape[1], node.outputs["dw"].shape[1]
    return c // wc


def _check_conv_attrs(node: Node, attrs: ConvAttrs, nsp: int) -> None:
    for field_name in ("pre_padding", "post_padding", "stride", "dilation"):
        values = getattr(attrs, field_name)
        if len(values) != nsp:
            raise fail(
                node, f"{field_name} has {len(values)} entries, expected {nsp} (one per spatial axis)"
            )
    if any(p < 0 for p in attrs.pre_padding + attrs.post_padding):
        raise fail(node, "padding must be >= 0")
    if any(s < 1 for s in attrs.stride) or any(d < 1 for d in attrs.dilation):
        raise fail(node, "stride and dilation must be >= 1")



def _conv_check(
    node: Node, x: Dims, w: Dims, xt: TensorAttr, wt: TensorAttr, attrs: ConvAttrs
) -> tuple[int, Dims]:
    """Checks image/filter agreement; returns groups and output spatial dims."""
    if len(x) < 3 or len(x) > 5:
        raise fail(node, f"convolution needs rank 3-5 (1-3 spatial axes), got rank {len(x)}", xt)
    if len(w) != len(x):
        raise fail(node, f"filter rank {len(w)} differs from image rank {len(x)}", wt)
    _check_conv_attrs(node, attrs, len(x) - 2)
    c, k, wc = x[1], w[0], w[1]
    if c % wc:
        raise fail(
            node,
            f"channel mismatch: image has {c} channels, filter expects {wc} per group "
            f"({c} is not a multiple of {wc})",
            wt,
        )
    groups = c // wc
    if k % groups:
        raise fail(
            node, f"group mismatch: {k} output channels not divisible by {groups} groups", wt
        )
    return groups, conv_output_spatial(node, x[2:], w[2:], attrs)


INT_CONV_INPUTS = frozenset({DataType.INT8, DataType.UINT8})


def _int_conv_type(node: Node, x: TensorAttr, w: TensorAttr) -> DataType:
    """An 8-bit integer convolution (cuDNN's INT8x INT8 -> INT32): both operands 8-bit
    integers, accumulated in INT32, whatever the graph's float compute type; its result is
    INT32 unless the output's type is stated (a float output is the INT32 sum, converted)."""
    assert isinstance(node.attrs, ConvAttrs)
    for t in (x, w):
        if t.dtype not in INT_CONV_INPUTS:
            other = x if t is w else w
            raise fail(
                node,
                f"integer convolution needs INT8 or UINT8 operands, got {t.dtype.name} with "
                f"{other.dtype.name} on '{other.name}'",
                t,
            )
    cd = node.attrs.compute_data_type
    if cd is not None and cd != DataType.INT32:
        raise fail(node, f"an 8-bit integer convolution accumulates in INT32; compute_data_type {cd.name} is not allowed")
    return DataType.INT32


def infer_conv_fprop(node: Node) -> Proposal:
    x, w = node.inputs["x"], node.inputs["w"]
    assert isinstance(node.attrs, ConvAttrs)
    if x.dtype in INT_CONV_INPUTS or w.dtype in INT_CONV_INPUTS:
        dt = _int_conv_type(node, x, w)
    else:
        dt = same_float_type(node, x, w)
    _, spatial = _conv_check(node, x.shape, w.shape, x, w, node.attrs)
    return {"y": ((x.shape[0], w.shape[0], *spatial), dt)}


def infer_conv_dgrad(node: Node) -> Proposal:
    dy, w, dx = node.inputs["dy"], node.inputs["w"], node.outputs["dx"]
    assert isinstance(node.attrs, ConvAttrs)
    if not dx.dim_set:
        raise fail(node, "conv_dgrad's output dims must be set with .set_dim() before validate()", dx)
    dt = same_float_type(node, dy, w)
    _, spatial = _conv_check(node, dx.shape, w.shape, dx, w, node.attrs)
    expect = (dx.shape[0], w.shape[0], *spatial)
    if dy.shape != expect:
        raise fail(
            node,
            f"loss dims {list(dy.shape)} do not match the forward convolution of dx "
            f"{list(dx.shape)}, which gives {list(expect)}",
            dy,
        )
    return {"dx": (dx.shape, dt)}


def infer_conv_wgrad(node: Node) -> Proposal:
    x, dy, dw = node.inputs["x"], node.inputs["dy"], node.outputs["dw"]
    assert isinstance(node.attrs, ConvAttrs)
    if not dw.dim_set:
        raise fail(node, "conv_wgrad's output dims must be set with .set_dim() before validate()", dw)
    dt = same_float_type(node, x, dy)
    _, spatial = _conv_check(node, x.shape, dw.shape, x, dw, node.attrs)
    expect = (x.shape[0], dw.shape[0], *spatial)
    if dy.shape != expect:
        raise fail(
            node,
            f"loss dims {list(dy.shape)} do not match the forward convolution of the image "
            f"with dw {list(dw.shape)}, which gives {list(expect)}",
            dy,
        )
    return {"dw": (dw.shape, dt)}


def infer_matmul(node: Node) -> Proposal:
    a, b = node.inputs["a"], node.inputs["b"]
    for t in (a, b):
        if len(t.shape) < 2:
            raise fail(node, f"matmul operands need rank >= 2, got {list(t.shape)}", t)
    if a.dtype == DataType.BOOLEAN or b.dtype == DataType.BOOLEAN:
        raise fail(node, "matmul of boolean tensors", a if a.dtype == DataType.BOOLEAN else b)
    dt = same_type(node, a, b)
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise fail(
            node, f"inner dims differ: A is {list(a.shape)} (K={k}), B is {list(b.shape)} (K={k2})", b
        )
    batch = broadcast_dims([a.shape[:-2], b.shape[:-2]]) if (a.shape[:-2] or b.shape[:-2]) else ()
    if batch is None:
        raise fail(
            node,
            f"batch dims {list(a.shape[:-2])} and {list(b.shape[:-2])} do not broadcast",
            b,
        )
    return {"c": ((*batch, m, n), dt)}


def infer_pointwise(node: Node) -> Proposal:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    spec = POINTWISE[attrs.mode]
    ins = [node.inputs[p] for p in ("a", "b", "c")[: spec.arity] if p in node.inputs]
    if len(ins) != spec.arity or len(node.inputs) != spec.arity:
        raise fail(
            node, f"{attrs.mode.name} takes {spec.arity} input(s), got {len(node.inputs)}"
        )
    dims = broadcast_dims([t.shape for t in ins])
    if dims is None:
        shapes = ", ".join(f"'{t.name}' {list(t.shape)}" for t in ins)
        raise fail(node, f"shapes do not broadcast: {shapes}", ins[-1])
    _check_params(node, attrs)
    operands = ins
    if attrs.mode.name == "BINARY_SELECT":
        cond = ins[2]
        # cuDNN's tests pass INT32 masks: an integer condition is true where nonzero
        if cond.dtype != DataType.BOOLEAN and not cond.dtype.is_integer:
            raise fail(
                node,
                f"BINARY_SELECT's condition must be BOOLEAN or an integer type (nonzero = true), "
                f"got {cond.dtype.name}",
                cond,
            )
        operands = ins[:2]
    # Scalars are "weak": they never widen a tensor's type, but their family must fit.
    strong = [t for t in operands if not t.is_scalar] or operands
    fam = family(strong[0].dtype)
    for t in operands:
        f = family(t.dtype)
        weak_ok = t.is_scalar and fam == "float" and f == "int"
        if f != fam and not weak_ok:
            raise fail(
                node,
                f"data type mismatch: {t.dtype.name} mixed with {strong[0].dtype.name}; "
                "cast one side first (pointwise IDENTITY with an output data type)",
                t,
            )
    if spec.inputs == "float" and fam != "float":
        raise fail(node, f"{attrs.mode.name} needs floating-point inputs, got {strong[0].dtype.name}", strong[0])
    if spec.inputs == "bool" and fam != "bool":
        raise fail(node, f"{attrs.mode.name} needs BOOLEAN inputs, got {strong[0].dtype.name}", strong[0])
    if spec.inputs == "numeric" and fam == "bool":
        raise fail(node, f"{attrs.mode.name} is not defined on BOOLEAN inputs", strong[0])
    dt = strong[0].dtype
    for t in strong[1:]:
        dt = promote(dt, t.dtype)
    if spec.output == "bool":
        dt = DataType.BOOLEAN
    return {"y": (dims, dt)}


# Parameters that may be infinite: a clip at +-inf is no clip (relu_upper_clip's default).
_INFINITE_OK = frozenset({"relu_lower_clip", "relu_upper_clip"})


def _check_params(node: Node, attrs: PointwiseAttrs) -> None:
    for key, value in attrs.params:
        if math.isnan(value):
            raise fail(node, f"{attrs.mode.name} parameter '{key}' is NaN; it would make every result NaN")
        if math.isinf(value) and key not in _INFINITE_OK:
            raise fail(node, f"{attrs.mode.name} parameter '{key}' is {value}; it must be finite")
        if key == "softplus_beta" and value == 0.0:
            raise fail(node, f"{attrs.mode.name} parameter 'softplus_beta' is 0; softplus divides by it")


def infer_reduction(node: Node) -> Proposal:
    x, y = node.inputs["x"], node.outputs["y"]
    if not y.dim_set:
        raise fail(node, "reduction output dims are unknown: pass dim= or axes=, or .set_dim()", y)
    if len(y.shape) != len(x.shape):
        raise fail(
            node,
            f"output rank {len(y.shape)} differs from input rank {len(x.shape)}; "
            "reduced axes keep size 1",
            y,
        )
    for i, (a, b) in enumerate(zip(x.shape, y.shape, strict=True)):
        if b not in (a, 1):
            raise fail(node, f"output dim {i} is {b}: must be {a} (kept) or 1 (reduced)", y)
    if x.dtype == DataType.BOOLEAN:
        raise fail(node, "reduction of a BOOLEAN tensor", x)
    return {"y": (y.shape, x.dtype)}



def infer_pooling(node: Node) -> Proposal:
    return {"y": (_pooled_dims(node), node.inputs["x"].dtype)}


def infer_pooling_backward(node: Node) -> Proposal:
    """dx has x's dims and dy's type; dy must have the dims the forward gives for x."""
    dy, x = node.inputs["dy"], node.inputs["x"]
    want = _pooled_dims(node)
    if tuple(dy.shape) != want:
        raise fail(
            node,
            f"dy dims {list(dy.shape)} must be the pooling output dims {list(want)} of x '{x.name}' {list(x.shape)}",
            dy,
        )
    if not dy.dtype.is_float:
        raise fail(node, f"dy must be floating-point, got {dy.dtype.name}", dy)
    return {"dx": (tuple(x.shape), dy.dtype)}


def _pooled_dims(node: Node) -> tuple[int, ...]:
    """The forward's output dims for the node's x (pooling and its backward share attrs)."""
    x = node.inputs["x"]
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    nsp = len(x.shape) - 2
    if nsp < 1 or nsp > 3:
        raise fail(node, f"pooling needs rank 3-5, got {list(x.shape)}", x)
    for f in ("window", "stride", "pre_padding", "post_padding"):
        if len(getattr(attrs, f)) != nsp:
            raise fail(node, f"{f} has {len(getattr(attrs, f))} entries, expected {nsp}")
    if any(w < 1 for w in attrs.window) or any(s < 1 for s in attrs.stride):
        raise fail(node, "window and stride must be >= 1")
    for i in range(nsp):
        if not (0 <= attrs.pre_padding[i] < attrs.window[i] and 0 <= attrs.post_padding[i] < attrs.window[i]):
            raise fail(node, f"padding on axis {i} must be in [0, window) = [0, {attrs.window[i]})")
    if x.dtype == DataType.BOOLEAN:
        raise fail(node, "pooling of a BOOLEAN tensor", x)
    spatial = []
    for i in range(nsp):
        size = (x.shape[2 + i] + attrs.pre_padding[i] + attrs.post_padding[i] - attrs.window[i]) // attrs.stride[i] + 1
        if size < 1:
            raise fail(node, f"window {attrs.window[i]} larger than padded input on axis {i}", x)
        spatial.append(size)
    return (*x.shape[:2], *spatial)



def infer_softmax(node: Node) -> Proposal:
    x = node.inputs["x"]
    assert isinstance(node.attrs, SoftmaxAttrs)
    if not -len(x.shape) <= node.attrs.axis < len(x.shape):
        raise fail(node, f"axis {node.attrs.axis} out of range for rank {len(x.shape)}")
    if not x.dtype.is_float:
        raise fail(node, f"softmax needs a floating-point input, got {x.dtype.name}", x)
    return {"y": (x.shape, x.dtype)}


def infer_reshape(node: Node) -> Proposal:
    x, y = node.inputs["x"], node.outputs["y"]
    if math.prod(x.shape) != math.prod(y.shape):
        raise fail(node, f"cannot reshape {list(x.shape)} ({math.prod(x.shape)} elements) to {list(y.shape)}", y)
    return {"y": (y.shape, x.dtype)}


def infer_transpose(node: Node) -> Proposal:
    x = node.inputs["x"]
    assert isinstance(node.attrs, TransposeAttrs)
    perm = node.attrs.permutation
    if sorted(perm) != list(range(len(x.shape))):
        raise fail(node, f"permutation {list(perm)} is not a permutation of the {len(x.shape)} axes", x)
    return {"y": (tuple(x.shape[p] for p in perm), x.dtype)}


def infer_concatenate(node: Node) -> Proposal:
    ins = node.input_list()
    assert isinstance(node.attrs, ConcatAttrs)
    if not ins:
        raise fail(node, "concatenate needs at least one input")
    rank = len(ins[0].shape)
    axis = node.attrs.axis
    if not 0 <= axis < rank:
        raise fail(node, f"axis {axis} out of range for rank {rank}")
    total = 0
    dt = ins[0].dtype
    for t in ins:
        if len(t.shape) != rank or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, ins[0].shape, strict=True)) if i != axis
        ):
            raise fail(node, f"dims {list(t.shape)} differ from {list(ins[0].shape)} off axis {axis}", t)
        if family(t.dtype) != family(dt):
            raise fail(node, f"data type mismatch: {t.dtype.name} with {dt.name}", t)
        dt = promote(dt, t.dtype)
        total += t.shape[axis]
    dims = list(ins[0].shape)
    dims[axis] = total
    return {"y": (tuple(dims), dt)}


def slice_dims(x: Dims, attrs: SliceAttrs) -> Dims:
    return tuple(
        len(range(*slice(s, e, st).indices(d)))
        for d, s, e, st in zip(x, attrs.starts, attrs.ends, attrs.steps, strict=True)
    )


def infer_slice(node: Node) -> Proposal:
    x = node.inputs["x"]
    attrs = node.attrs
    assert isinstance(attrs, SliceAttrs)
    if not (len(attrs.starts) == len(attrs.ends) == len(attrs.steps) == len(x.shape)):
        raise fail(node, f"slice needs one start/end/step per axis ({len(x.shape)})", x)
    if any(st < 1 for st in attrs.steps):
        raise fail(node, "slice steps must be >= 1", x)
    dims = slice_dims(x.shape, attrs)
    if any(d < 1 for d in dims):
        raise fail(node, f"slice is empty: {list(dims)}", x)
    return {"y": (dims, x.dtype)}


INFER: dict[OpKind, Callable[[Node], Proposal]] = {
    OpKind.CONV_FPROP: infer_conv_fprop,
    OpKind.CONV_DGRAD: infer_conv_dgrad,
    OpKind.CONV_WGRAD: infer_conv_wgrad,
    OpKind.MATMUL: infer_matmul,
    OpKind.POINTWISE: infer_pointwise,
    OpKind.REDUCTION: infer_reduction,
    OpKind.POOLING: infer_pooling,
    OpKind.POOLING_BACKWARD: infer_pooling_backward,
    OpKind.SOFTMAX: infer_softmax,
    OpKind.RESHAPE: infer_reshape,
    OpKind.TRANSPOSE: infer_transpose,
    OpKind.CONCATENATE: infer_concatenate,
    OpKind.SLICE: infer_slice,
    **NORM_INFER,
    **ATTENTION_INFER,
    **GATHER_INFER,
    **BACKWARD_INFER,
}


# Output strides: ops whose outputs follow the memory order of their first input.
INHERIT_LAYOUT = frozenset(
    {
        OpKind.CONV_FPROP,
        OpKind.CONV_DGRAD,
        OpKind.CONV_WGRAD,
        OpKind.POINTWISE,
        OpKind.REDUCTION,
        OpKind.BATCHNORM_INFERENCE,
        OpKind.BATCHNORM,
        OpKind.LAYERNORM,
        OpKind.RMSNORM,
        OpKind.POOLING,
        OpKind.SOFTMAX,
        OpKind.CONCATENATE,
        OpKind.SLICE,
        OpKind.BATCHNORM_BACKWARD,
        OpKind.LAYERNORM_BACKWARD,
        OpKind.RMSNORM_BACKWARD,
    }
)

# Outputs whose layout follows one named input: a gradient is laid out as what it is the
# gradient of (dq as q: a BSHD query gets a BSHD dq).
LAYOUT_SOURCE: dict[OpKind, dict[str, str]] = {
    OpKind.SDPA_BACKWARD: {"dq": "q", "dk": "k", "dv": "v"},
    OpKind.POOLING_BACKWARD: {"dx": "x"},
}

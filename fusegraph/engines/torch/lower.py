"""The torch engine's op table: one lowering per OpKind (``LOWER``), each a function of the
plan's context, the node and its input tensors, returning the node's outputs by port.
Convolutions, matmul, reductions and data movement live here; pointwise nodes in
``lower_pointwise``, norms, pooling and attention in ``lower_nn``, the backward ops in
``lower_backward``, gather and its backward in ``lower_gather``, pooling's backward in
``lower_pool``."""

from __future__ import annotations

from fusegraph.engines.torch import split_products
from fusegraph.engines.torch import steps as torch_fusion
from fusegraph.engines.torch.context import (
    _F,
    Lowering,
    _conv_padding,
    _Ctx,
    _memory_format,
    _operands,
)
from fusegraph.engines.torch.convert import Tensor, _torch, torch_dtype
from fusegraph.engines.torch.lower_backward import (
    _lower_batchnorm_backward,
    _lower_layernorm_backward,
    _lower_rmsnorm_backward,
    _lower_sdpa_backward,
)
from fusegraph.engines.torch.lower_gather import _lower_gather, _lower_gather_backward
from fusegraph.engines.torch.lower_nn import (
    _lower_bn_inference,
    _lower_bn_training,
    _lower_layernorm,
    _lower_pooling,
    _lower_rmsnorm,
    _lower_sdpa,
    _lower_softmax,
)
from fusegraph.engines.torch.lower_pointwise import _lower_pointwise
from fusegraph.engines.torch.lower_pool import _lower_pooling_backward
from fusegraph.graph.infer import conv_groups
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    ConcatAttrs,
    ConvAttrs,
    OpKind,
    ReductionAttrs,
    ReductionMode,
    SliceAttrs,
    TransposeAttrs,
)


def _lower_conv_fprop(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    x, w = _operands(ctx, node, ins, ("x", "w"))
    x, w = _memory_format(ctx, x), _memory_format(ctx, w)
    x, pad = _conv_padding(x, attrs)
    conv = getattr(_F(), f"conv{x.dim() - 2}d")
    groups = conv_groups(node)
    if ctx.native_depthwise and groups > 1 and w.shape[1] == 1:
        cudnn = _torch().backends.cudnn
        before = cudnn.enabled
        cudnn.enabled = False  # PyTorch's depthwise kernel: nothing to build at first use
        try:
            return {"y": conv(x, w, None, list(attrs.stride), pad, list(attrs.dilation), groups)}
        finally:
            cudnn.enabled = before
    y = conv(x, w, None, list(attrs.stride), pad, list(attrs.dilation), groups)
    return {"y": y}


def _lower_conv_dgrad(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    dy, w = _operands(ctx, node, ins, ("dy", "w"))
    dy, w = _memory_format(ctx, dy), _memory_format(ctx, w)
    dx_shape = node.outputs["dx"].shape
    nsp = len(dx_shape) - 2
    grad_input = getattr(torch.nn.grad, f"conv{nsp}d_input")
    groups = conv_groups(node)
    if attrs.pre_padding == attrs.post_padding:
        dx = grad_input(dx_shape, w, dy, list(attrs.stride), list(attrs.pre_padding), list(attrs.dilation), groups)
        return {"dx": dx}
    padded = (*dx_shape[:2], *(d + a + b for d, a, b in zip(dx_shape[2:], attrs.pre_padding, attrs.post_padding, strict=True)))
    dxp = grad_input(padded, w, dy, list(attrs.stride), [0] * nsp, list(attrs.dilation), groups)
    crop = tuple(slice(p, p + d) for p, d in zip(attrs.pre_padding, dx_shape[2:], strict=True))
    return {"dx": dxp[(slice(None), slice(None), *crop)]}


def _lower_conv_wgrad(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ConvAttrs)
    x, dy = _operands(ctx, node, ins, ("x", "dy"))
    x, dy = _memory_format(ctx, x), _memory_format(ctx, dy)
    dw_shape = node.outputs["dw"].shape
    grad_weight = getattr(torch.nn.grad, f"conv{len(dw_shape) - 2}d_weight")
    x, pad = _conv_padding(x, attrs)
    dw = grad_weight(x, dw_shape, dy, list(attrs.stride), pad, list(attrs.dilation), conv_groups(node))
    return {"dw": dw}


def _lower_matmul(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    a, b = _operands(ctx, node, ins, ("a", "b"))
    torch = _torch()
    if not a.dtype.is_floating_point and not b.dtype.is_floating_point:
        # Integer products summed in the operands' own 8/16 bits wrap at once: accumulate
        # wide, as cuDNN's int8 matmul (INT32 compute) and the exact reference do -- in f64
        # for 8/16-bit operands (exact while K < 2**23), else in int64.
        if a.element_size() <= 2 and b.element_size() <= 2:
            return {"c": torch.matmul(a.double(), b.double()).to(torch.int64)}
        return {"c": torch.matmul(a.long(), b.long())}
    if ctx.split_fp32 and a.dtype == torch.float32 and b.dtype == torch.float32:
        split = split_products.lowered(a, b, functional=ctx.functional, bmm=ctx.split_batched)
        if split is not None:  # None: batched, without a bmm kernel (_Ctx logged it)
            return {"c": split}
    if a.dim() >= 3 and all(d == 1 for d in b.shape[:-2]):
        # One weight for every batch (a linear layer: [b, s, k] @ [1, k, n]) is one GEMM of
        # [b*s, k] rows, as nn.Linear runs it; broadcast, cuBLAS runs a strided batch with a
        # zero stride and small tiles (ViT-B/16's MLP on the H100: 0.8 ms a layer vs 0.2)
        k, n = b.shape[-2], b.shape[-1]
        rows = a.reshape(-1, k)
        out = torch.mm(rows, b.reshape(k, n))
        return {"c": out.reshape(*a.shape[:-1], n)}
    return {"c": torch.matmul(a, b)}


def _lower_reduction(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, ReductionAttrs)
    x = ctx.cast_in(node, ins["x"])
    out_shape = node.outputs["y"].shape
    axes = [i for i, (a, b) in enumerate(zip(node.inputs["x"].shape, out_shape, strict=True)) if a != b]
    if not axes:
        y = torch.abs(x) if attrs.mode in (ReductionMode.AMAX, ReductionMode.NORM1, ReductionMode.NORM2) else x
        return {"y": y}
    mode = attrs.mode
    if not x.dtype.is_floating_point and mode in (ReductionMode.AVG, ReductionMode.NORM2):
        x = x.to(torch.float64)  # the reference averages exactly, then truncates
    if mode == ReductionMode.SUM:
        y = torch.sum(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MIN:
        y = torch.amin(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MAX:
        y = torch.amax(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.AMAX:
        y = torch.amax(torch.abs(x), dim=axes, keepdim=True)
    elif mode == ReductionMode.AVG:
        y = torch.mean(x, dim=axes, keepdim=True)
    elif mode == ReductionMode.MUL:
        y = x
        for ax in sorted(axes, reverse=True):
            y = torch.prod(y, dim=ax, keepdim=True)
    elif mode == ReductionMode.NORM1:
        y = torch.sum(torch.abs(x), dim=axes, keepdim=True)
    else:
        y = torch.sqrt(torch.sum(x * x, dim=axes, keepdim=True))
    if not node.outputs["y"].dtype.is_float and y.dtype.is_floating_point:
        y = torch.trunc(y)
    return {"y": y}


def _lower_reshape(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    """A view when ``x``'s layout allows one; otherwise one copy straight into the declared
    layout of ``y`` (torch's own reshape would copy to row-major, and a channels-last
    partition would then run on NCHW from a channel shuffle onwards)."""
    x, y = ins["x"], node.outputs["y"]
    if ctx.functional:  # traced (oneDNN Graph, Inductor): no in-place copies into views
        return {"y": torch_fusion.as_declared(x.reshape(y.shape), y)}
    try:
        return {"y": x.view(y.shape)}
    except RuntimeError:
        pass
    out = _torch().empty_strided(y.shape, y.strides, dtype=x.dtype, device=x.device)
    try:
        out.view(x.shape).copy_(x)
    except RuntimeError:  # the declared layout does not split into x's dims either
        return {"y": x.reshape(y.shape)}
    return {"y": out}


def _lower_transpose(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    assert isinstance(node.attrs, TransposeAttrs)
    return {"y": ins["x"].permute(node.attrs.permutation)}


def _lower_concat(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    assert isinstance(node.attrs, ConcatAttrs)
    parts = [ins[p] for p in node.inputs if p.startswith("x")]
    target = torch_dtype(node.outputs["y"].dtype)
    # .to only where a type changes: a traced no-op aten::to splits oneDNN Graph partitions
    return {"y": torch.cat([p if p.dtype == target else p.to(target) for p in parts], dim=node.attrs.axis)}


def _lower_slice(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    a = node.attrs
    assert isinstance(a, SliceAttrs)
    idx = tuple(slice(s, e, k) for s, e, k in zip(a.starts, a.ends, a.steps, strict=True))
    return {"y": ins["x"][idx]}


LOWER: dict[OpKind, Lowering] = {
    OpKind.CONV_FPROP: _lower_conv_fprop,
    OpKind.CONV_DGRAD: _lower_conv_dgrad,
    OpKind.CONV_WGRAD: _lower_conv_wgrad,
    OpKind.MATMUL: _lower_matmul,
    OpKind.POINTWISE: _lower_pointwise,
    OpKind.REDUCTION: _lower_reduction,
    OpKind.BATCHNORM_INFERENCE: _lower_bn_inference,
    OpKind.BATCHNORM: _lower_bn_training,
    OpKind.LAYERNORM: _lower_layernorm,
    OpKind.RMSNORM: _lower_rmsnorm,
    OpKind.POOLING: _lower_pooling,
    OpKind.SDPA: _lower_sdpa,
    OpKind.SOFTMAX: _lower_softmax,
    OpKind.RESHAPE: _lower_reshape,
    OpKind.TRANSPOSE: _lower_transpose,
    OpKind.CONCATENATE: _lower_concat,
    OpKind.SLICE: _lower_slice,
    OpKind.BATCHNORM_BACKWARD: _lower_batchnorm_backward,
    OpKind.LAYERNORM_BACKWARD: _lower_layernorm_backward,
    OpKind.RMSNORM_BACKWARD: _lower_rmsnorm_backward,
    OpKind.SDPA_BACKWARD: _lower_sdpa_backward,
    OpKind.GATHER: _lower_gather,
    OpKind.GATHER_BACKWARD: _lower_gather_backward,
    OpKind.POOLING_BACKWARD: _lower_pooling_backward,
}

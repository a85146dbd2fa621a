"""Convolutions and pooling: Conv, ConvTranspose, MaxPool/AveragePool, global pools.

Filters are read as "filter" tensors, so the importer packs them once for the engine
(``importer.FILTER_LAYOUTS``); these ops mark a partition channels-last (``spatial``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusegraph.graph.ops import PoolingMode, ReductionMode
from fusegraph.onnx.ops.common import channel_vector, ints, is_read, spatial_attrs
from fusegraph.onnx.ops.table import Unmappable, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


@lowers("Conv", spatial=True)
def lower_conv(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"Conv: input rank {len(xs)} (fusegraph runs 1-D, 2-D and 3-D convolutions)")
    nsp = len(xs) - 2
    ws = imp.shape(node.inputs[1])
    kernel = list(ws[2:])
    ks = node.attr("kernel_shape")
    if ks is not None and ints(ks) != kernel:
        raise Unmappable(f"Conv: kernel_shape={list(ks)} differs from the weight's spatial dims {kernel}")
    dil = ints(node.attr("dilations", [1] * nsp))
    group = int(node.attr("group", 1))
    if xs[1] != ws[1] * group:
        raise Unmappable(f"Conv: group={group} with {xs[1]} input channels and weight {list(ws)}")
    stride, pre, post = spatial_attrs(imp, node, xs[2:], kernel, dil)
    x = imp.tensor(node.inputs[0])
    w = imp.tensor(node.inputs[1], "filter")
    y = imp.g.conv_fprop(x, w, stride=stride, dilation=dil, pre_padding=pre, post_padding=post)
    if len(node.inputs) > 2 and node.inputs[2]:
        y = imp.g.add(y, channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


@lowers("ConvTranspose", spatial=True)
def lower_conv_transpose(imp: Importer, node: ONode) -> None:
    """As conv_dgrad: the adjoint of a forward convolution whose filter is the weight."""
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"ConvTranspose: input rank {len(xs)}")
    nsp = len(xs) - 2
    ws = imp.shape(node.inputs[1])
    group = int(node.attr("group", 1))
    kernel = list(ws[2:])
    dil = ints(node.attr("dilations", [1] * nsp))
    stride = ints(node.attr("strides", [1] * nsp))
    outpad = ints(node.attr("output_padding", [0] * nsp))
    if xs[1] != ws[0]:
        raise Unmappable(f"ConvTranspose: {xs[1]} input channels but weight {list(ws)}")
    cout = ws[1] * group
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True)]
    out_shape = node.attr("output_shape")
    auto = node.attr("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if out_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = ints(out_shape)[-nsp:] if out_shape is not None else [x * s for x, s in zip(xs[2:], stride, strict=True)]
        pre, post = [], []
        for i in range(nsp):
            total = stride[i] * (xs[2 + i] - 1) + outpad[i] + span[i] - target[i]
            if total < 0:
                raise Unmappable(f"ConvTranspose: output_shape {target} needs negative padding on axis {i}")
            if auto == "SAME_UPPER":
                pre.append(total // 2)
                post.append(total - total // 2)
            else:
                pre.append(total - total // 2)
                post.append(total // 2)
    else:
        pads = ints(node.attr("pads", [0] * (2 * nsp)))
        pre, post = pads[:nsp], pads[nsp:]
    out_sp = [
        stride[i] * (xs[2 + i] - 1) + outpad[i] + span[i] - pre[i] - post[i] for i in range(nsp)
    ]
    for i in range(nsp):
        if outpad[i] >= stride[i]:
            raise Unmappable(f"ConvTranspose: output_padding={outpad} must be < strides={stride}")
    x = imp.tensor(node.inputs[0])
    w = imp.tensor(node.inputs[1], "filter")
    y = imp.g.conv_dgrad(x, w, stride=stride, dilation=dil, pre_padding=pre, post_padding=post)
    dims = [xs[0], cout, *out_sp]
    y.set_dim(dims)
    y.set_stride(imp._strides(dims, "act"))
    if len(node.inputs) > 2 and node.inputs[2]:
        y = imp.g.add(y, channel_vector(imp, node.inputs[2], len(xs)))
    imp.set(node.outputs[0], y)


@lowers("MaxPool", "AveragePool", spatial=True)
def lower_pool(imp: Importer, node: ONode) -> None:
    op = node.op_type
    xs = imp.shape(node.inputs[0])
    if not 3 <= len(xs) <= 5:
        raise Unmappable(f"{op}: input rank {len(xs)}")
    nsp = len(xs) - 2
    kernel = ints(node.attr("kernel_shape"))
    dil = ints(node.attr("dilations", [1] * nsp))
    if any(d != 1 for d in dil):
        raise Unmappable(f"{op}: dilations={dil} (fusegraph pooling has no dilation)")
    if op == "MaxPool":
        if int(node.attr("storage_order", 0)):
            raise Unmappable("MaxPool: storage_order=1")
        if len(node.outputs) > 1 and node.outputs[1] and is_read(imp, node.outputs[1]):
            raise Unmappable("MaxPool: the Indices output is used")
        mode = PoolingMode.MAX
    else:
        mode = PoolingMode.AVG_INCLUDE_PAD if int(node.attr("count_include_pad", 0)) else PoolingMode.AVG_EXCLUDE_PAD
    stride, pre, post = spatial_attrs(imp, node, xs[2:], kernel, dil)
    if int(node.attr("ceil_mode", 0)):
        post = list(post)
        for i in range(nsp):
            span = xs[2 + i] + pre[i] + post[i] - kernel[i]
            out = -(-span // stride[i]) + 1
            if (out - 1) * stride[i] >= xs[2 + i] + pre[i]:
                out -= 1
            extra = (out - 1) * stride[i] + kernel[i] - (xs[2 + i] + pre[i] + post[i])
            if extra > 0:
                if mode == PoolingMode.AVG_INCLUDE_PAD:
                    raise Unmappable(f"{op}: ceil_mode=1 with count_include_pad=1 needs a partial window")
                post[i] += extra
    for i in range(nsp):
        if not (pre[i] < kernel[i] and post[i] < kernel[i]):
            raise Unmappable(f"{op}: pads {pre}+{post} not smaller than kernel_shape={kernel}")
    x = imp.tensor(node.inputs[0])
    y = imp.g.pooling(x, mode, window=kernel, stride=stride, pre_padding=pre, post_padding=post)
    imp.set(node.outputs[0], y)


@lowers("GlobalAveragePool", "GlobalMaxPool")
def lower_global_pool(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) < 3:
        raise Unmappable(f"{node.op_type}: input rank {len(xs)} < 3")
    mode = ReductionMode.AVG if node.op_type == "GlobalAveragePool" else ReductionMode.MAX
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.reduction(x, mode, axes=list(range(2, len(xs)))))

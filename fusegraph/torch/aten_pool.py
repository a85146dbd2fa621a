"""Converters of the ATen pooling backward ops (registered in aten.CONVERTERS):
``aten.max_pool2d_with_indices_backward`` (what ``nn.MaxPool2d`` leaves in an AOTAutograd
backward: ResNet's stem) and ``aten.avg_pool2d_backward``, each onto the graph API's
pooling_backward (cuDNN's resample backward) with the forward's window, stride and padding.

The graph op keeps no indices: max pooling's gradient goes to each window's first maximum
of x, which is how PyTorch's forward chose the indices, so the indices operand is not
read. What the graph op cannot express (dilation, ceil_mode's extra window, a divisor
override, an unbatched input) is refused with the reason.
"""

from __future__ import annotations

import torch
import torch.fx

from fusegraph.graph.ops import PoolingMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import Ctx, Refused, _args, _shape, converts, meta
from fusegraph.torch.aten_norms import _arg, _pair

aten = torch.ops.aten


def _window(n: torch.fx.Node, first: int, what: str) -> tuple[list[int], list[int], list[int]]:
    """(kernel, stride, padding) from the arguments starting at ``first`` (kernel_size);
    an empty stride is the kernel, as in the forward."""
    kernel = _pair(_arg(n, first, "kernel_size", None), 2, ())
    stride = _pair(_arg(n, first + 1, "stride", []), 2, kernel)
    padding = _pair(_arg(n, first + 2, "padding", 0), 2, (0, 0))
    xs = _shape(meta(_args(n)[1]))
    if len(xs) != 4:
        raise Refused(f"{what} of a rank-{len(xs)} input (unbatched)")
    return kernel, stride, padding


@converts(aten.max_pool2d_with_indices_backward.default)
def _max_pool_backward(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices) -> the
    gradient of self. The ``indices`` operand is ignored: the graph op recomputes each
    window's first maximum from ``self`` (the torch engine runs max_pool2d with
    return_indices on x, then this same ATen op), which is where PyTorch's forward put
    them -- so the forward's indices need not reach the graph."""
    dy, x = _args(n)[:2]
    kernel, stride, padding = _window(n, 2, "max pooling backward")
    dilation = _pair(_arg(n, 5, "dilation", 1), 2, (1, 1))
    if any(d != 1 for d in dilation):
        raise Refused(f"max pooling backward with dilation {dilation} (the graph op has no dilated windows)")
    if _arg(n, 6, "ceil_mode", False):
        raise Refused("max pooling backward with ceil_mode=True (not converted: the extra window's padding)")
    return c.g.pooling_backward(c.value(dy), c.value(x), PoolingMode.MAX, kernel, stride, padding)


@converts(aten.avg_pool2d_backward.default)
def _avg_pool_backward(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
    divisor_override) -> the gradient of self; count_include_pad picks the include-pad or
    exclude-pad divisor."""
    dy, x = _args(n)[:2]
    kernel, stride, padding = _window(n, 2, "average pooling backward")
    if _arg(n, 5, "ceil_mode", False):
        raise Refused("average pooling backward with ceil_mode=True (PyTorch divides the extra window by "
                      "less than the window)")
    if _arg(n, 7, "divisor_override", None) is not None:
        raise Refused("average pooling backward with divisor_override (the graph op divides by the window "
                      "or its real elements)")
    include = bool(_arg(n, 6, "count_include_pad", True))
    mode = PoolingMode.AVG_INCLUDE_PAD if include else PoolingMode.AVG_EXCLUDE_PAD
    return c.g.pooling_backward(c.value(dy), c.value(x), mode, kernel, stride, padding)

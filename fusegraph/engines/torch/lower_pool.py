"""The torch lowering of pooling's backward (``POOLING_BACKWARD``): PyTorch's own pooling
backward kernels, fed what the graph's attributes mean.

Max pooling's graph op keeps no indices (cuDNN's resample backward reads x, not indices),
so they are recomputed here by ``max_poolNd(..., return_indices=True)`` on x and handed to
``max_poolNd_with_indices_backward`` -- one extra forward pass, and the same first-maximum
rule on ties as PyTorch's forward. Average pooling goes to ``avg_poolNd_backward``.

Where torch's own padding gives the graph's windows (``lower_nn._native_padding``: the
padding at most half the window and the post padding what ceil_mode adds) it is used as
is; otherwise x is padded explicitly (max: with -inf, so padding never wins; average: an
uninitialised tensor, only its shape is read) and the gradient cropped. One spatial axis
runs as two (a unit axis in front): PyTorch has no 1-d backward kernels.
"""

from __future__ import annotations

import math

from fusegraph.engines.torch.context import _F, _Ctx, _pad_list
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.engines.torch.lower_nn import _native_padding
from fusegraph.graph.node import Node
from fusegraph.graph.ops import PoolingAttrs, PoolingMode


def _lower_pooling_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, PoolingAttrs)
    dy = ctx.cast_in(node, ins["dy"])
    x = ctx.cast_in(node, ins["x"]).to(dy.dtype)
    if x.dim() == 3:  # one spatial axis: as two, the first of size 1
        lifted = PoolingAttrs(
            attrs.mode,
            (1, *attrs.window),
            (1, *attrs.stride),
            (0, *attrs.pre_padding),
            (0, *attrs.post_padding),
        )
        return {"dx": _backward(lifted, dy.unsqueeze(2), x.unsqueeze(2)).squeeze(2)}
    return {"dx": _backward(attrs, dy, x)}


def _backward(attrs: PoolingAttrs, dy: Tensor, x: Tensor) -> Tensor:
    torch = _torch()
    F = _F()
    aten = torch.ops.aten
    nsp = x.dim() - 2
    win, stride, pre = list(attrs.window), list(attrs.stride), list(attrs.pre_padding)
    zeros = [0] * nsp
    native = _native_padding(attrs, tuple(x.shape[2:]), tuple(dy.shape[2:]))
    pads = _pad_list(attrs.pre_padding, attrs.post_padding)
    crop = (slice(None), slice(None), *(slice(p, p + n) for p, n in zip(pre, x.shape[2:], strict=True)))
    if attrs.mode == PoolingMode.MAX:
        pool = getattr(F, f"max_pool{nsp}d")
        bwd = getattr(aten, f"max_pool{nsp}d_with_indices_backward")
        ones = [1] * nsp
        if native is not None:
            _, idx = pool(x, win, stride, padding=pre, ceil_mode=native, return_indices=True)
            return bwd(dy, x, win, stride, pre, ones, native, idx)  # type: ignore[no-any-return]
        xp = F.pad(x, pads, value=-math.inf)
        _, idx = pool(xp, win, stride, return_indices=True)
        return bwd(dy, xp, win, stride, zeros, ones, False, idx)[crop]  # type: ignore[no-any-return]
    bwd = getattr(aten, f"avg_pool{nsp}d_backward")
    include = attrs.mode == PoolingMode.AVG_INCLUDE_PAD
    if native is not None and not (include and native):
        # include-pad only without ceil_mode's extra window: torch divides that one by less
        return bwd(dy, x, win, stride, pre, native, include, None)  # type: ignore[no-any-return]
    padded = [n + a + b for n, a, b in zip(x.shape[2:], attrs.pre_padding, attrs.post_padding, strict=True)]
    xp = x.new_empty((*x.shape[:2], *padded))  # only its shape is read
    if include:
        return bwd(dy, xp, win, stride, zeros, False, True, None)[crop]  # type: ignore[no-any-return]
    ones_in = torch.ones((1, 1, *x.shape[2:]), dtype=dy.dtype, device=dy.device)
    count = getattr(F, f"avg_pool{nsp}d")(F.pad(ones_in, pads), win, stride) * math.prod(win)  # real elements
    return bwd(dy / count, xp, win, stride, zeros, False, True, 1)[crop]  # type: ignore[no-any-return]

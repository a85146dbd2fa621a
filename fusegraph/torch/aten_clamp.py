"""Converters of ATen's clamps (registered in aten.CONVERTERS): ``aten.hardtanh`` (what
``nn.ReLU6`` traces to: MobileNetV2's activation, every block), ``aten.clamp`` and its
one-sided forms, each a max and a min against scalars, and ``aten.hardtanh_backward``, the
gradient passed where the input lies strictly inside the bounds and zero elsewhere (at a
bound too, as PyTorch's kernel does). A held-out MobileNetV2 left 70 such nodes of its
training graphs unconverted, each cutting the regions around it."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import Ctx, Refused, _args, converts

aten = torch.ops.aten


def _bound(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Refused(f"clamp {what} {v!r} is not a number (a tensor bound is not converted)")
    return float(v)


def _clamped(c: Ctx, x: TensorAttr, lo: float | None, hi: float | None) -> TensorAttr:
    if lo is None and hi is None:
        raise Refused("clamp without a bound")
    y = x if lo is None else c.g.max(x, c.scalar(lo, x))
    return y if hi is None else c.g.min(y, c.scalar(hi, x))


@converts(aten.hardtanh.default)
def _hardtanh(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    args = _args(n)
    lo = _bound(args[1] if len(args) > 1 else n.kwargs.get("min_val", -1.0), "minimum")
    hi = _bound(args[2] if len(args) > 2 else n.kwargs.get("max_val", 1.0), "maximum")
    return _clamped(c, c.value(args[0]), lo, hi)


@converts(aten.clamp.default)
def _clamp(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    args = _args(n)
    lo = _bound(args[1] if len(args) > 1 else n.kwargs.get("min"), "minimum")
    hi = _bound(args[2] if len(args) > 2 else n.kwargs.get("max"), "maximum")
    return _clamped(c, c.value(args[0]), lo, hi)


@converts(aten.clamp_min.default)
def _clamp_min(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    return _clamped(c, c.value(_args(n)[0]), _bound(_args(n)[1], "minimum"), None)


@converts(aten.clamp_max.default)
def _clamp_max(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    return _clamped(c, c.value(_args(n)[0]), None, _bound(_args(n)[1], "maximum"))


@converts(aten.hardtanh_backward.default)
def _hardtanh_backward(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(grad_output, self, min_val, max_val): grad_output where min_val < self < max_val."""
    dy, x_node, lo_v, hi_v = _args(n)[:4]
    lo, hi = _bound(lo_v, "minimum"), _bound(hi_v, "maximum")
    assert lo is not None and hi is not None
    g, d, x = c.g, c.value(dy), c.value(x_node)
    inside = g.logical_and(g.cmp_gt(x, c.scalar(lo, x)), g.cmp_lt(x, c.scalar(hi, x)))
    return g.binary_select(d, c.scalar(0.0, d), inside)

"""The torch lowering of pointwise nodes: one torch expression per PointwiseMode (the
table the op-table guard in tests/test_layers.py reads)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fusegraph.engines.torch.context import _F, _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.graph.node import Node
from fusegraph.graph.ops import PointwiseAttrs, PointwiseMode

M = PointwiseMode


def _relu(x: Tensor, p: PointwiseAttrs) -> Tensor:
    torch = _torch()
    lower, upper = p.param("relu_lower_clip"), p.param("relu_upper_clip")
    slope = p.param("relu_lower_clip_slope")
    if lower == 0.0 and slope == 0.0 and math.isinf(upper):
        return torch.relu(x)
    below = lower + slope * (x - lower)
    return torch.where(x <= lower, below, x if math.isinf(upper) else torch.clamp(x, max=upper))


def _swish_grad(x: Tensor, beta: float) -> Tensor:
    s = _torch().sigmoid(beta * x)
    return s + beta * x * s * (1.0 - s)


def _pointwise_table() -> dict[PointwiseMode, Callable[[Tensor, Tensor, Tensor, PointwiseAttrs], Tensor]]:
    torch = _torch()
    F = _F()
    return {
        M.ADD: lambda a, b, c, p: a + b,
        M.SUB: lambda a, b, c, p: a - b,
        M.MUL: lambda a, b, c, p: a * b,
        M.DIV: lambda a, b, c, p: torch.div(a, b, rounding_mode="trunc")
        if not a.dtype.is_floating_point and not b.dtype.is_floating_point
        else a / b,
        M.MAX: lambda a, b, c, p: torch.maximum(a, b),
        M.MIN: lambda a, b, c, p: torch.minimum(a, b),
        M.POW: lambda a, b, c, p: torch.pow(a, b),
        M.ABS: lambda a, b, c, p: torch.abs(a),
        M.NEG: lambda a, b, c, p: torch.neg(a),
        M.EXP: lambda a, b, c, p: torch.exp(a),
        M.LOG: lambda a, b, c, p: torch.log(a),
        M.SQRT: lambda a, b, c, p: torch.sqrt(a),
        M.RSQRT: lambda a, b, c, p: torch.rsqrt(a),
        M.RECIPROCAL: lambda a, b, c, p: torch.reciprocal(a),
        M.SIN: lambda a, b, c, p: torch.sin(a),
        M.COS: lambda a, b, c, p: torch.cos(a),
        M.ERF: lambda a, b, c, p: torch.erf(a),
        M.FLOOR: lambda a, b, c, p: torch.floor(a),
        M.CEIL: lambda a, b, c, p: torch.ceil(a),
        M.IDENTITY: lambda a, b, c, p: a,
        M.RELU_FWD: lambda a, b, c, p: _relu(a, p),
        M.TANH_FWD: lambda a, b, c, p: torch.tanh(a),
        M.SIGMOID_FWD: lambda a, b, c, p: torch.sigmoid(a),
        M.GELU_FWD: lambda a, b, c, p: F.gelu(a),
        M.GELU_APPROX_TANH_FWD: lambda a, b, c, p: F.gelu(a, approximate="tanh"),
        M.ELU_FWD: lambda a, b, c, p: F.elu(a, alpha=p.param("elu_alpha")),
        M.SWISH_FWD: lambda a, b, c, p: F.silu(a)
        if p.param("swish_beta") == 1.0
        else a * torch.sigmoid(p.param("swish_beta") * a),
        M.SOFTPLUS_FWD: lambda a, b, c, p: F.softplus(a, beta=p.param("softplus_beta"), threshold=1e30),
        M.CMP_EQ: lambda a, b, c, p: a == b,
        M.CMP_NEQ: lambda a, b, c, p: a != b,
        M.CMP_GT: lambda a, b, c, p: a > b,
        M.CMP_GE: lambda a, b, c, p: a >= b,
        M.CMP_LT: lambda a, b, c, p: a < b,
        M.CMP_LE: lambda a, b, c, p: a <= b,
        M.LOGICAL_AND: lambda a, b, c, p: torch.logical_and(a, b),
        M.LOGICAL_OR: lambda a, b, c, p: torch.logical_or(a, b),
        M.LOGICAL_NOT: lambda a, b, c, p: torch.logical_not(a),
        # an integer condition (cuDNN's INT32 masks) is true where nonzero
        M.BINARY_SELECT: lambda a, b, c, p: torch.where(c if c.dtype == torch.bool else c != 0, a, b),
        M.RELU_BWD: lambda dy, x, c, p: dy * (x > p.param("relu_lower_clip")).to(dy.dtype),
        M.GELU_BWD: lambda dy, x, c, p: torch.ops.aten.gelu_backward(*torch.broadcast_tensors(dy, x)),
        M.TANH_BWD: lambda dy, x, c, p: dy * (1.0 - torch.tanh(x) ** 2),
        M.SIGMOID_BWD: lambda dy, x, c, p: dy * torch.sigmoid(x) * (1.0 - torch.sigmoid(x)),
        M.ELU_BWD: lambda dy, x, c, p: torch.where(x > 0, dy, dy * p.param("elu_alpha") * torch.exp(torch.clamp(x, max=0.0))),
        M.GELU_APPROX_TANH_BWD: lambda dy, x, c, p: torch.ops.aten.gelu_backward(
            *torch.broadcast_tensors(dy, x), approximate="tanh"
        ),
        M.SOFTPLUS_BWD: lambda dy, x, c, p: dy * torch.sigmoid(p.param("softplus_beta") * x),
        M.SWISH_BWD: lambda dy, x, c, p: dy * _swish_grad(x, p.param("swish_beta")),
    }


_PW_CACHE: dict[str, Any] = {}


def _pw_fns() -> dict[PointwiseMode, Callable[[Tensor, Tensor, Tensor, PointwiseAttrs], Tensor]]:
    if "table" not in _PW_CACHE:
        _PW_CACHE["table"] = _pointwise_table()
    return _PW_CACHE["table"]  # type: ignore[no-any-return]


def _lower_pointwise(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    a = ins["a"]
    b, c = ins.get("b"), ins.get("c")
    a = ctx.cast_in(node, a)
    if b is not None:
        b = ctx.cast_in(node, b)
    if attrs.mode == M.BINARY_SELECT and b is not None:
        # Both branches in one type (a boolean select of mixed types would promote).
        common = _torch().promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    return {"y": _pw_fns()[attrs.mode](a, b, c, attrs)}


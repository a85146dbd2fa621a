"""The pointwise builder methods: ``pointwise(mode=...)`` and one named method per mode
(cuDNN frontend names), checked against the mode's row in graph/ops.py ``POINTWISE``.

A mixin of ``graph.Graph``, like graph/builder.py; kept apart because the named methods
are many and alike, and a new pointwise mode adds one here (docs/CONTRIBUTING.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fusegraph.errors import ValidationError
from fusegraph.graph.builder_base import NodeAdder
from fusegraph.graph.ops import POINTWISE, OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.graph.tensor import TensorAttr


def _name_of(t: Any) -> str | None:
    return t.name if isinstance(t, TensorAttr) else None


class PointwiseBuilder(NodeAdder):
    """The pointwise methods of ``Graph`` (a mixin: the IR half is ``graph.Graph``)."""

    # ---- pointwise ----------------------------------------------------------------------------
    def pointwise(
        self,
        a: TensorAttr,
        b: TensorAttr | None = None,
        c: TensorAttr | None = None,
        mode: PointwiseMode = PointwiseMode.IDENTITY,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
        **params: float,
    ) -> TensorAttr:
        """An elementwise op with NumPy broadcasting; ``params`` as in the op table."""
        try:
            mode = PointwiseMode(mode)
        except ValueError:
            raise ValidationError(f"unknown pointwise mode {mode!r}", node=name, tensor=_name_of(a)) from None
        spec = POINTWISE[mode]
        allowed = dict(spec.params)
        for key, value in params.items():
            if key not in allowed:
                raise ValidationError(
                    f"{mode.name} has no parameter '{key}' (it takes: {sorted(allowed) or 'none'})",
                    node=name,
                    tensor=_name_of(a),
                )
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise ValidationError(
                    f"{mode.name} parameter '{key}' must be a number, got {value!r}",
                    node=name,
                    tensor=_name_of(a),
                )
        values = tuple((k, float(params.get(k, d))) for k, d in spec.params)
        attrs = PointwiseAttrs(mode, values, self._compute_default(compute_data_type))
        return self._add_node(OpKind.POINTWISE, attrs, {"a": a, "b": b, "c": c}, name).outputs["y"]

    def _pw(
        self,
        mode: PointwiseMode,
        a: TensorAttr,
        b: TensorAttr | None = None,
        c: TensorAttr | None = None,
        *,
        name: str | None,
        **params: float,
    ) -> TensorAttr:
        return self.pointwise(a, b, c, mode=mode, name=name, **params)

    def add(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ADD, a, b, name=name)

    def bias(self, input: TensorAttr, bias: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ADD, input, bias, name=name)

    def sub(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SUB, a, b, name=name)

    def mul(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.MUL, a, b, name=name)

    def scale(self, input: TensorAttr, scale: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.MUL, input, scale, name=name)

    def div(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.DIV, a, b, name=name)

    def max(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.MAX, a, b, name=name)

    def min(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.MIN, a, b, name=name)

    def pow(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.POW, a, b, name=name)

    def abs(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ABS, input, name=name)

    def neg(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.NEG, input, name=name)

    def exp(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.EXP, input, name=name)

    def log(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.LOG, input, name=name)

    def sqrt(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SQRT, input, name=name)

    def rsqrt(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.RSQRT, input, name=name)

    def reciprocal(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.RECIPROCAL, input, name=name)

    def sin(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SIN, input, name=name)

    def cos(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.COS, input, name=name)

    def erf(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ERF, input, name=name)

    def floor(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.FLOOR, input, name=name)

    def ceil(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CEIL, input, name=name)

    def identity(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.IDENTITY, input, name=name)

    def relu(
        self,
        input: TensorAttr,
        negative_slope: float | None = None,
        lower_clip: float | None = None,
        upper_clip: float | None = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Clamped, leaky ReLU: slope ``negative_slope`` below ``lower_clip`` (default 0)."""
        return self.pointwise(
            input,
            mode=PointwiseMode.RELU_FWD,
            name=name,
            relu_lower_clip_slope=0.0 if negative_slope is None else negative_slope,
            relu_lower_clip=0.0 if lower_clip is None else lower_clip,
            relu_upper_clip=math.inf if upper_clip is None else upper_clip,
        )

    def leaky_relu(self, input: TensorAttr, negative_slope: float = 0.01, name: str | None = None) -> TensorAttr:
        return self.relu(input, negative_slope=negative_slope, name=name)

    def tanh(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.TANH_FWD, input, name=name)

    def sigmoid(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SIGMOID_FWD, input, name=name)

    def gelu(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.GELU_FWD, input, name=name)

    def gelu_approx_tanh(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.GELU_APPROX_TANH_FWD, input, name=name)

    def elu(self, input: TensorAttr, alpha: float = 1.0, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ELU_FWD, input, name=name, elu_alpha=alpha)

    def swish(self, input: TensorAttr, beta: float = 1.0, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SWISH_FWD, input, name=name, swish_beta=beta)

    def softplus(self, input: TensorAttr, beta: float = 1.0, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SOFTPLUS_FWD, input, name=name, softplus_beta=beta)

    def cmp_eq(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_EQ, a, b, name=name)

    def cmp_neq(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_NEQ, a, b, name=name)

    def cmp_gt(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_GT, a, b, name=name)

    def cmp_ge(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_GE, a, b, name=name)

    def cmp_lt(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_LT, a, b, name=name)

    def cmp_le(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.CMP_LE, a, b, name=name)

    def logical_and(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.LOGICAL_AND, a, b, name=name)

    def logical_or(self, a: TensorAttr, b: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.LOGICAL_OR, a, b, name=name)

    def logical_not(self, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.LOGICAL_NOT, input, name=name)

    def binary_select(
        self, input0: TensorAttr, input1: TensorAttr, mask: TensorAttr, name: str | None = None
    ) -> TensorAttr:
        """``input0`` where ``mask`` is true, else ``input1``."""
        return self._pw(PointwiseMode.BINARY_SELECT, input0, input1, mask, name=name)

    def relu_backward(self, loss: TensorAttr, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.RELU_BWD, loss, input, name=name)

    def gelu_backward(self, loss: TensorAttr, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.GELU_BWD, loss, input, name=name)

    def tanh_backward(self, loss: TensorAttr, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.TANH_BWD, loss, input, name=name)

    def sigmoid_backward(self, loss: TensorAttr, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SIGMOID_BWD, loss, input, name=name)

    def elu_backward(self, loss: TensorAttr, input: TensorAttr, alpha: float = 1.0, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.ELU_BWD, loss, input, name=name, elu_alpha=alpha)

    def gelu_approx_tanh_backward(self, loss: TensorAttr, input: TensorAttr, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.GELU_APPROX_TANH_BWD, loss, input, name=name)

    def softplus_backward(
        self, loss: TensorAttr, input: TensorAttr, beta: float = 1.0, name: str | None = None
    ) -> TensorAttr:
        return self._pw(PointwiseMode.SOFTPLUS_BWD, loss, input, name=name, softplus_beta=beta)

    def swish_backward(self, loss: TensorAttr, input: TensorAttr, beta: float = 1.0, name: str | None = None) -> TensorAttr:
        return self._pw(PointwiseMode.SWISH_BWD, loss, input, name=name, swish_beta=beta)

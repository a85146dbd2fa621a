"""Graph: the builder users write against (cuDNN Python frontend style), and its validation.

Ops are added through methods that return their output TensorAttr(s); ``validate()``
infers every dim, stride and dtype that was left unset and checks the whole graph. The
validated graph is the descriptor every engine reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.errors import ValidationError
from fusegraph.graph import layout
from fusegraph.graph.infer import INFER, INHERIT_LAYOUT
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    OPS,
    POINTWISE,
    ConcatAttrs,
    ConvAttrs,
    MatmulAttrs,
    NormAttrs,
    NormFwdPhase,
    OpAttrs,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
    PoolingAttrs,
    PoolingMode,
    ReductionAttrs,
    ReductionMode,
    ReshapeAttrs,
    SdpaAttrs,
    SliceAttrs,
    SoftmaxAttrs,
    TransposeAttrs,
)
from fusegraph.graph.tensor import Scalar, TensorAttr, _ints

if TYPE_CHECKING:
    from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.graph")

Ints = Sequence[int]
Epsilon = float | TensorAttr


def _name_of(t: Any) -> str | None:
    return t.name if isinstance(t, TensorAttr) else None


class Graph:
    """A graph of tensor operations; see the README for a walk-through."""

    def __init__(
        self,
        name: str | None = None,
        io_data_type: Any = None,
        intermediate_data_type: Any = None,
        compute_data_type: Any = None,
    ) -> None:
        self.name = name or "graph"
        self.io_data_type = as_data_type(io_data_type) if io_data_type is not None else None
        self.intermediate_data_type = (
            as_data_type(intermediate_data_type) if intermediate_data_type is not None else None
        )
        self.compute_data_type = (
            as_data_type(compute_data_type) if compute_data_type is not None else None
        )
        self.tensors: list[TensorAttr] = []
        self._by_name: dict[str, TensorAttr] = {}  # a lookup cache, checked on every hit
        self.nodes: list[Node] = []
        self._counters: dict[str, int] = {}
        self._validated = False
        self._key: str | None = None
        # Engines keep built plans here, keyed by (engine, handle); cleared on any change.
        self.plans: dict[Any, Any] = {}
        self._selection: Any = None

    # ---- tensors ------------------------------------------------------------------------
    def tensor(
        self,
        name: str,
        dim: Ints,
        stride: Ints | None = None,
        data_type: Any = None,
    ) -> TensorAttr:
        """A graph input (or, with ``set_output``, a tensor the caller owns)."""
        if not isinstance(name, str) or not name:
            raise ValidationError(f"tensor names must be non-empty strings, got {name!r}")
        dims = _ints(dim, name, "dims")
        if stride is None:
            stride = layout.packed_strides(dims)
        if data_type is None:
            data_type = self.io_data_type
        return self._add_tensor(TensorAttr(self, name, dims, stride, data_type))

    def tensor_like(self, array: Any, name: str | None = None) -> TensorAttr:
        """A graph input with the dims, element strides and dtype of an array."""
        arr = np.asarray(array) if not hasattr(array, "__array_interface__") else array
        arr = np.asarray(arr)
        dt = as_data_type(arr.dtype)
        strides = layout.element_strides(arr.shape, arr.strides, arr.itemsize)
        if strides is None:
            raise ValidationError("array strides are not whole elements", tensor=name)
        return self.tensor(name or self._unique("tensor"), arr.shape, strides, dt)

    def scalar(self, value: Scalar, data_type: Any = None) -> TensorAttr:
        """A constant inlined into the graph (cuDNN's pass-by-value scalar)."""
        if data_type is None:
            data_type = (
                DataType.BOOLEAN
                if isinstance(value, bool | np.bool_)
                else DataType.INT64
                if isinstance(value, int | np.integer)
                else DataType.FLOAT
            )
        dt = as_data_type(data_type)
        py: Scalar = bool(value) if dt == DataType.BOOLEAN else int(value) if dt.is_integer else float(value)
        t = TensorAttr(self, self._unique("scalar"), (1,), (1,), dt, value=py)
        return self._add_tensor(t)

    def _add_tensor(self, t: TensorAttr) -> TensorAttr:
        self.tensors.append(t)
        self._touch()
        return t

    def _unique(self, base: str) -> str:
        taken = {t.name for t in self.tensors} | {n.name for n in self.nodes}
        while True:
            i = self._counters.get(base, 0)
            self._counters[base] = i + 1
            name = f"{base}_{i}"
            if name not in taken:
                return name

    def _touch(self) -> None:
        self._validated = False
        self._key = None
        if self.plans:
            self.plans.clear()
        self._selection = None

    # ---- generic node construction -------------------------------------------------------
    def _check_operand(self, t: Any, port: str, op: str) -> TensorAttr:
        if not isinstance(t, TensorAttr):
            raise ValidationError(
                f"input '{port}' must be a TensorAttr of this graph, got {type(t).__name__}", node=op
            )
        if t.graph is not self:
            raise ValidationError(f"input '{port}' belongs to another graph", node=op, tensor=t.name)
        return t

    def _add_node(
        self,
        kind: OpKind,
        attrs: OpAttrs,
        inputs: Mapping[str, TensorAttr | None],
        name: str | None,
        outputs: Sequence[str] | None = None,
    ) -> Node:
        node_name = name or self._unique(kind.value)
        ins = {p: self._check_operand(t, p, node_name) for p, t in inputs.items() if t is not None}
        spec = OPS[kind]
        outs: dict[str, TensorAttr] = {}
        for port in outputs if outputs is not None else spec.outputs:
            t = TensorAttr(self, f"{node_name}::{port}", is_virtual=True)
            t.producer = node_name
            outs[port] = t
            self.tensors.append(t)
        node = Node(node_name, kind, attrs, ins, outs)
        self.nodes.append(node)
        self._touch()
        self._try_infer(node)
        return node

    def _try_infer(self, node: Node) -> None:
        """Fill output dims/dtypes right away when inputs are known (validate() re-checks)."""
        known = all(t._dim is not None and t._data_type is not None for t in node.inputs.values())
        if not known:
            return
        try:
            proposal = INFER[node.kind](node)
        except ValidationError:
            return  # reported by validate(), where the whole graph is in view
        except (ValueError, KeyError, IndexError, TypeError):
            return
        for port, (dims, dt) in proposal.items():
            t = node.outputs[port]
            if not t.dim_set:
                t._infer(dim=dims)
            if not t.dtype_set:
                t._infer(data_type=self._default_dtype(t, dt))

    def _default_dtype(self, t: TensorAttr, proposed: DataType) -> DataType:
        if not proposed.is_float:
            return proposed
        chosen = self.intermediate_data_type if t.is_virtual else self.io_data_type
        return chosen or proposed

    def _compute_default(self, compute_data_type: Any) -> DataType | None:
        return as_data_type(compute_data_type) if compute_data_type is not None else None

    # ---- convolutions ---------------------------------------------------------------------
    def _conv_attrs(
        self,
        nsp: int,
        padding: Ints | None,
        stride: Ints | None,
        dilation: Ints | None,
        pre_padding: Ints | None,
        post_padding: Ints | None,
        compute_data_type: Any,
    ) -> ConvAttrs:
        pad = tuple(padding) if padding is not None else (0,) * nsp
        return ConvAttrs(
            pre_padding=tuple(int(p) for p in (pre_padding if pre_padding is not None else pad)),
            post_padding=tuple(int(p) for p in (post_padding if post_padding is not None else pad)),
            stride=tuple(int(s) for s in (stride if stride is not None else (1,) * nsp)),
            dilation=tuple(int(d) for d in (dilation if dilation is not None else (1,) * nsp)),
            compute_data_type=self._compute_default(compute_data_type),
        )

    @staticmethod
    def _nsp(a: Any, b: Any, *given: Ints | None) -> int:
        """Spatial axes of a convolution, from whichever operand already has dims (a
        dgrad output gets its dims only later), else from the lengths the caller gave."""
        for t in (a, b):
            if isinstance(t, TensorAttr) and t._dim is not None:
                return max(len(t._dim) - 2, 0)
        for values in given:
            if values is not None:
                return len(values)
        return 0

    def conv_fprop(
        self,
        image: TensorAttr,
        weight: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """y = conv(image, weight); groups = image channels / weight.dim[1]."""
        attrs = self._conv_attrs(
            self._nsp(image, weight, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_FPROP, attrs, {"x": image, "w": weight}, name).outputs["y"]

    def conv_dgrad(
        self,
        loss: TensorAttr,
        filter: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """dx of a convolution; set its dims with ``.set_dim(...)`` before validate()."""
        attrs = self._conv_attrs(
            self._nsp(loss, filter, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_DGRAD, attrs, {"dy": loss, "w": filter}, name).outputs["dx"]

    def conv_wgrad(
        self,
        image: TensorAttr,
        loss: TensorAttr,
        padding: Ints | None = None,
        stride: Ints | None = None,
        dilation: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """dw of a convolution; set its dims with ``.set_dim(...)`` before validate()."""
        attrs = self._conv_attrs(
            self._nsp(image, loss, padding, stride, dilation, pre_padding, post_padding),
            padding, stride, dilation, pre_padding, post_padding, compute_data_type,
        )
        return self._add_node(OpKind.CONV_WGRAD, attrs, {"x": image, "dy": loss}, name).outputs["dw"]

    # ---- matmul -----------------------------------------------------------------------------
    def matmul(
        self, A: TensorAttr, B: TensorAttr, *, compute_data_type: Any = None, name: str | None = None
    ) -> TensorAttr:
        """C[..., M, N] = A[..., M, K] @ B[..., K, N]; batch dims broadcast."""
        attrs = MatmulAttrs(self._compute_default(compute_data_type))
        return self._add_node(OpKind.MATMUL, attrs, {"a": A, "b": B}, name).outputs["c"]

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

    # ---- reductions, norms, pooling, attention ------------------------------------------------
    def reduction(
        self,
        input: TensorAttr,
        mode: ReductionMode = ReductionMode.SUM,
        dim: Ints | None = None,
        *,
        axes: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Reduce to ``dim`` (same rank, 1 on reduced axes), or over ``axes``."""
        attrs = ReductionAttrs(mode, self._compute_default(compute_data_type))
        node = self._add_node(OpKind.REDUCTION, attrs, {"x": input}, name)
        y = node.outputs["y"]
        if dim is not None and axes is not None:
            raise ValidationError("give dim= or axes=, not both", node=node.name)
        if axes is not None:
            if input._dim is None:
                raise ValidationError(
                    "reduction: axes= needs the input's dims, which are not known yet; pass dim=",
                    node=node.name,
                    tensor=input.name,
                )
            rank = len(input.dim)
            if any(not -rank <= int(a) < rank for a in axes):
                raise ValidationError(
                    f"reduction: axes {list(axes)} out of range for input dims {input.dim}",
                    node=node.name,
                    tensor=input.name,
                )
            ax = {int(a) % rank for a in axes}
            dim = [1 if i in ax else d for i, d in enumerate(input.dim)]
        if dim is not None:
            y.set_dim(dim)
            self._try_infer(node)
        return y

    def _eps(self, epsilon: Epsilon) -> TensorAttr:
        if isinstance(epsilon, TensorAttr):
            return epsilon
        return self.scalar(float(epsilon), DataType.FLOAT)

    def batchnorm_inference(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        mean: TensorAttr,
        var: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """y = (x - mean) / sqrt(var + eps) * scale + bias, per channel (axis 1)."""
        attrs = NormAttrs(NormFwdPhase.INFERENCE, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "mean": mean, "var": var, "epsilon": self._eps(epsilon)}
        return self._add_node(OpKind.BATCHNORM_INFERENCE, attrs, ins, name).outputs["y"]

    def batchnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr, TensorAttr]:
        """Training batchnorm over (N, spatial): returns (y, saved_mean, saved_inv_var)."""
        attrs = NormAttrs(NormFwdPhase.TRAINING, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon)}
        o = self._add_node(OpKind.BATCHNORM, attrs, ins, name).outputs
        return o["y"], o["mean"], o["inv_var"]

    def layernorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        bias: TensorAttr,
        epsilon: Epsilon = 1e-5,
        phase: NormFwdPhase = NormFwdPhase.INFERENCE,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr | None, TensorAttr | None]:
        """Normalizes over every dim but the first; (y, mean, inv_var), stats at TRAINING only."""
        phase = NormFwdPhase(phase)
        attrs = NormAttrs(phase, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon)}
        ports = ("y", "mean", "inv_var") if phase == NormFwdPhase.TRAINING else ("y",)
        o = self._add_node(OpKind.LAYERNORM, attrs, ins, name, outputs=ports).outputs
        return o["y"], o.get("mean"), o.get("inv_var")

    def rmsnorm(
        self,
        input: TensorAttr,
        scale: TensorAttr,
        epsilon: Epsilon = 1e-5,
        phase: NormFwdPhase = NormFwdPhase.INFERENCE,
        *,
        bias: TensorAttr | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[TensorAttr, TensorAttr | None]:
        """y = x / rms(x) * scale (+ bias) over every dim but the first; (y, inv_rms)."""
        phase = NormFwdPhase(phase)
        attrs = NormAttrs(phase, self._compute_default(compute_data_type))
        ins = {"x": input, "scale": scale, "bias": bias, "epsilon": self._eps(epsilon)}
        ports = ("y", "inv_rms") if phase == NormFwdPhase.TRAINING else ("y",)
        o = self._add_node(OpKind.RMSNORM, attrs, ins, name, outputs=ports).outputs
        return o["y"], o.get("inv_rms")

    def pooling(
        self,
        input: TensorAttr,
        mode: PoolingMode = PoolingMode.MAX,
        window: Ints = (2, 2),
        stride: Ints | None = None,
        padding: Ints | None = None,
        *,
        pre_padding: Ints | None = None,
        post_padding: Ints | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Max / average pooling over the spatial axes; stride defaults to the window."""
        win = tuple(int(w) for w in window)
        pad = tuple(padding) if padding is not None else (0,) * len(win)
        attrs = PoolingAttrs(
            mode=PoolingMode(mode),
            window=win,
            stride=tuple(int(s) for s in (stride if stride is not None else win)),
            pre_padding=tuple(int(p) for p in (pre_padding if pre_padding is not None else pad)),
            post_padding=tuple(int(p) for p in (post_padding if post_padding is not None else pad)),
            compute_data_type=self._compute_default(compute_data_type),
        )
        return self._add_node(OpKind.POOLING, attrs, {"x": input}, name).outputs["y"]

    def sdpa(
        self,
        q: TensorAttr,
        k: TensorAttr,
        v: TensorAttr,
        attn_scale: float | None = None,
        causal: bool = False,
        mask: TensorAttr | None = None,
        *,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> TensorAttr:
        """softmax(q kᵀ · scale + mask) v on [batch, heads, seq, dim]; k/v heads may divide q's."""
        attrs = SdpaAttrs(
            None if attn_scale is None else float(attn_scale),
            bool(causal),
            self._compute_default(compute_data_type),
        )
        return self._add_node(OpKind.SDPA, attrs, {"q": q, "k": k, "v": v, "mask": mask}, name).outputs["o"]

    def softmax(
        self, input: TensorAttr, axis: int = -1, log: bool = False, *, name: str | None = None
    ) -> TensorAttr:
        """Softmax (or log-softmax) along one axis."""
        attrs = SoftmaxAttrs(axis=int(axis), log=bool(log))
        return self._add_node(OpKind.SOFTMAX, attrs, {"x": input}, name).outputs["y"]

    # ---- data movement ---------------------------------------------------------------------
    def reshape(self, input: TensorAttr, dim: Ints, name: str | None = None) -> TensorAttr:
        """Row-major reshape of the logical dims; one dim may be -1."""
        dims = [int(d) for d in dim]
        if dims.count(-1) > 1:
            raise ValidationError("reshape: at most one -1 in dims", node=name, tensor=input.name)
        if -1 in dims:
            if not isinstance(input, TensorAttr) or input._dim is None:
                raise ValidationError(
                    "reshape: -1 needs the input's dims, which are not known yet (set them first)",
                    node=name,
                    tensor=_name_of(input),
                )
            known = math.prod(d for d in dims if d != -1)
            total = math.prod(input.dim)
            if known == 0 or total % known:
                raise ValidationError(
                    f"reshape: cannot infer -1 in {dims} from {input.dim}", node=name, tensor=input.name
                )
            dims[dims.index(-1)] = total // known
        node = self._add_node(OpKind.RESHAPE, ReshapeAttrs(), {"x": input}, name)
        y = node.outputs["y"]
        y.set_dim(dims)
        self._try_infer(node)
        return y

    def transpose(self, input: TensorAttr, permutation: Ints, name: str | None = None) -> TensorAttr:
        """Logical transpose: output dim i is input dim permutation[i]."""
        attrs = TransposeAttrs(tuple(int(p) for p in permutation))
        return self._add_node(OpKind.TRANSPOSE, attrs, {"x": input}, name).outputs["y"]

    def concatenate(self, inputs: Sequence[TensorAttr], axis: int, name: str | None = None) -> TensorAttr:
        rank = len(inputs[0].dim) if inputs else 0
        axis = int(axis) + rank if axis < 0 else int(axis)
        ins = {f"x{i}": t for i, t in enumerate(inputs)}
        return self._add_node(OpKind.CONCATENATE, ConcatAttrs(axis), ins, name).outputs["y"]

    def slice(
        self,
        input: TensorAttr,
        starts: Ints,
        ends: Ints,
        steps: Ints | None = None,
        axes: Ints | None = None,
        name: str | None = None,
    ) -> TensorAttr:
        """Python/NumPy slicing per axis (negative and out-of-range indices clamp); steps >= 1."""
        if not isinstance(input, TensorAttr) or input._dim is None:
            raise ValidationError(
                "slice: the input's dims must be known first (set them with .set_dim())",
                node=name,
                tensor=_name_of(input),
            )
        dims = input.dim
        rank = len(dims)
        if axes is not None and any(not -rank <= int(a) < rank for a in axes):
            raise ValidationError(
                f"slice: axes {list(axes)} out of range for rank {rank}", node=name, tensor=input.name
            )
        ax = [int(a) % rank for a in axes] if axes is not None else list(range(len(starts)))
        st = list(steps) if steps is not None else [1] * len(ax)
        if not (len(ax) == len(starts) == len(ends) == len(st)) or len(set(ax)) != len(ax) or len(ax) > rank:
            raise ValidationError(
                "slice: starts, ends, steps and axes must have one entry per sliced axis "
                f"(got {len(starts)}, {len(ends)}, {len(st)}, axes {ax}) for rank {rank}",
                node=name,
                tensor=input.name,
            )
        s_all, e_all, k_all = [0] * rank, list(dims), [1] * rank
        for a, s, e, k in zip(ax, starts, ends, st, strict=True):
            if int(k) < 1:
                raise ValidationError(f"slice: step {k} on axis {a} must be >= 1", node=name, tensor=input.name)
            lo, hi, _ = slice(int(s), int(e), int(k)).indices(dims[a])
            s_all[a], e_all[a], k_all[a] = lo, max(hi, lo), int(k)
        attrs = SliceAttrs(tuple(s_all), tuple(e_all), tuple(k_all))
        return self._add_node(OpKind.SLICE, attrs, {"x": input}, name).outputs["y"]

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> Graph:
        """Infers what was left unset and checks the whole graph; raises ValidationError."""
        self._check_names()
        order = self.topological_order()
        produced = {t.name for n in self.nodes for t in n.outputs.values()}
        used: set[int] = set()
        for n in self.nodes:
            for t in n.inputs.values():
                used.add(id(t))
                if t.is_virtual and t.name not in produced:
                    raise ValidationError(
                        "virtual tensor is used but no node produces it", node=n.name, tensor=t.name
                    )
                if not t.is_virtual and t.producer is None:
                    self._check_tensor(t, is_input=True)
        for n in order:
            for t in n.inputs.values():
                if t._dim is None or t._data_type is None:
                    raise ValidationError(
                        "dims or data type unknown (set them, or check the producing node)",
                        node=n.name,
                        tensor=t.name,
                    )
            proposal = INFER[n.kind](n)
            for port, (dims, dt) in proposal.items():
                self._settle_output(n, n.outputs[port], dims, dt)
        outputs = [t for t in self.tensors if t.is_output]
        if not outputs:
            raise ValidationError(
                f"graph '{self.name}' has no output: mark at least one tensor with .set_output(True)"
            )
        for t in outputs:
            if t.producer is None:
                raise ValidationError("output is not produced by any node", tensor=t.name)
        for t in self.tensors:
            if t.producer is None and not t.is_scalar and id(t) not in used:
                log.debug("tensor '%s' is declared but never used", t.name)
        self._validated = True
        return self

    def _settle_output(self, node: Node, t: TensorAttr, dims: tuple[int, ...], dt: DataType) -> None:
        if t.dim_set and tuple(t.dim) != dims:
            raise ValidationError(
                f"dims were set to {t.dim} but the op produces {list(dims)}", node=node.name, tensor=t.name
            )
        t._infer(dim=dims)
        if not t.dtype_set:
            t._infer(data_type=self._default_dtype(t, dt))
        if not t.stride_set:
            t._infer(stride=self._output_strides(node, dims))
        self._check_tensor(t, is_input=False)

    def _output_strides(self, node: Node, dims: tuple[int, ...]) -> tuple[int, ...]:
        if node.kind in INHERIT_LAYOUT:
            for src in node.inputs.values():
                if len(src.dim) == len(dims) and not src.is_scalar and all(s > 0 for s in src.stride):
                    return layout.packed_strides(dims, layout.stride_order(src.dim, src.stride))
        return layout.packed_strides(dims)

    def _check_tensor(self, t: TensorAttr, *, is_input: bool) -> None:
        dims, strides = t.dim, t.stride
        if not dims:
            raise ValidationError("tensor has no dims", tensor=t.name)
        if any(d < 1 for d in dims):
            raise ValidationError(f"dims must be >= 1, got {dims}", tensor=t.name)
        if t._data_type is None:
            raise ValidationError(
                "data type unknown: pass data_type= or set the graph's io_data_type", tensor=t.name
            )
        if len(strides) != len(dims):
            raise ValidationError(f"{len(strides)} strides for {len(dims)} dims", tensor=t.name)
        if any(s < 0 for s in strides):
            raise ValidationError(f"negative stride in {strides}", tensor=t.name)
        if not is_input and any(s == 0 and d > 1 for s, d in zip(strides, dims, strict=True)):
            what = "output" if t.is_output else "intermediate tensor"
            raise ValidationError(
                f"{what} has a broadcast (zero) stride {strides}; only graph inputs may", tensor=t.name
            )
        pair = layout.overlapping_axes(dims, strides)
        if pair is not None:
            raise ValidationError(
                f"strides {strides} overlap: axes {pair[0]} and {pair[1]} interleave or address the "
                "same memory (each axis must step over the whole extent of the axes inside it)",
                tensor=t.name,
            )

    def _check_names(self) -> None:
        # Nodes first: a repeated node name also repeats its outputs' names.
        node_names: set[str] = set()
        for n in self.nodes:
            if n.name in node_names:
                raise ValidationError("duplicate node name", node=n.name)
            node_names.add(n.name)
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValidationError("duplicate tensor name", tensor=t.name)
            seen.add(t.name)

    def topological_order(self) -> list[Node]:
        """Nodes ordered so producers come first; raises ValidationError on a cycle."""
        producer = {id(t): n for n in self.nodes for t in n.outputs.values()}
        state: dict[int, int] = {}  # 1 = on the stack, 2 = done
        order: list[Node] = []
        for root in self.nodes:
            if id(root) in state:
                continue
            stack: list[tuple[Node, int]] = [(root, 0)]
            state[id(root)] = 1
            while stack:
                node, i = stack.pop()
                deps = [producer[id(t)] for t in node.inputs.values() if id(t) in producer]
                if i < len(deps):
                    stack.append((node, i + 1))
                    dep = deps[i]
                    s = state.get(id(dep))
                    if s == 1:
                        raise ValidationError("cycle: the node depends on its own output", node=dep.name)
                    if s is None:
                        state[id(dep)] = 1
                        stack.append((dep, 0))
                else:
                    state[id(node)] = 2
                    order.append(node)
        return order

    # ---- views used by engines ---------------------------------------------------------------
    @property
    def is_validated(self) -> bool:
        return self._validated

    def ensure_valid(self) -> Graph:
        if not self._validated:
            self.validate()
        return self

    def inputs(self) -> list[TensorAttr]:
        """Non-virtual, non-scalar tensors read by some node, in declaration order."""
        read = {id(t) for n in self.nodes for t in n.inputs.values()}
        return [t for t in self.tensors if t.producer is None and not t.is_scalar and id(t) in read]

    def outputs(self) -> list[TensorAttr]:
        return [t for t in self.tensors if t.is_output]

    def tensor_by_name(self, name: str) -> TensorAttr:
        """O(1) on a hit (engines resolve every pack key through here on every call); tensors
        may be added or renamed at any time, so a miss or a stale entry rebuilds the index."""
        t = self._by_name.get(name)
        if t is not None and t.name == name:
            return t
        index: dict[str, TensorAttr] = {}
        for t in self.tensors:
            index.setdefault(t.name, t)  # the first of duplicates, as a linear search finds
        self._by_name = index
        try:
            return index[name]
        except KeyError:
            raise KeyError(name) from None

    def node_by_name(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    # ---- serialization -----------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        from fusegraph.graph.serialize import graph_to_json

        return graph_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        from fusegraph.graph.serialize import graph_from_json

        return graph_from_json(text)

    def key(self) -> str:
        """Stable content hash of the validated graph (hex sha256)."""
        if self._key is None:
            from fusegraph.graph.serialize import graph_key

            self.ensure_valid()
            self._key = graph_key(self)
        return self._key

    # ---- execution (the engine and selection layers do the work) ------------------------------
    def execute(
        self,
        variant_pack: Mapping[Any, Any],
        workspace: Any = None,
        *,
        handle: Handle | str | None = None,
        engine: str | None = None,
    ) -> dict[str, Any]:
        """Runs the graph; outputs in the pack are written in place, the rest returned by name.

        Values may be numpy arrays or fusegraph Buffers. Without a built plan, the default
        plan for ``handle`` is built first (see ``build``).
        """
        from fusegraph.execute import execute_graph

        return execute_graph(self, variant_pack, handle=handle, engine=engine)

    def build(self, handle: Handle | str | None = None, engine: str | None = None, **options: Any) -> Any:
        """Builds (or loads from cache) the plan that ``execute`` will use on ``handle``."""
        from fusegraph.select import api

        return api.build(self, handle, engine=engine, **options)

    def create_execution_plans(self, modes: Sequence[Any] | None = None, handle: Handle | str | None = None) -> Graph:
        from fusegraph.select import api

        api.create_execution_plans(self, modes, handle)
        return self

    def check_support(self, handle: Handle | str | None = None) -> Graph:
        from fusegraph.select import api

        api.check_support(self, handle)
        return self

    def build_plans(self, policy: Any = None, handle: Handle | str | None = None) -> Graph:
        from fusegraph.select import api

        api.build_plans(self, policy, handle)
        return self

    def get_execution_plan_count(self) -> int:
        from fusegraph.select import api

        return api.get_execution_plan_count(self)

    def execute_plan_at_index(self, variant_pack: Mapping[Any, Any], index: int, workspace: Any = None) -> dict[str, Any]:
        from fusegraph.select import api

        return api.execute_plan_at_index(self, variant_pack, index)

    def autotune(self, variant_pack: Mapping[Any, Any] | None = None, handle: Handle | str | None = None, **options: Any) -> Any:
        """Times every applicable (engine, knobs) and remembers the fastest (tuning DB)."""
        from fusegraph.select import api

        return api.autotune(self, variant_pack, handle, **options)

    def emit_mlir(self) -> str:
        """The torch-dialect MLIR the IREE engine compiles (for debugging)."""
        from fusegraph.engines.iree.emit import emit_mlir

        return emit_mlir(self.ensure_valid()).text

    def compile_to_artifact(self, target: str = "cpu", **options: Any) -> bytes:
        """Ahead-of-time compile for a target ("cpu", "cuda", "hip:gfx942"...); load with
        ``fusegraph.engines.iree.load_artifact``, also on another machine."""
        from fusegraph.engines.iree.artifact import compile_to_artifact

        return compile_to_artifact(self.ensure_valid(), target, **options)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.tensors)} tensors)"

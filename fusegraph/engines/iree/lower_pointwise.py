"""Pointwise ops: one torch op (or a short chain) per PointwiseMode, in the compute type.

Operands are aligned to one layout (that of the full-size input, so a channels-last
convolution result feeds its epilogue without a transpose) and cast to the compute type;
the result is cast to the output's data type by ``Lowering.set``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from fusegraph.dtypes import DataType, family, promote
from fusegraph.engines.iree.lower_base import Lowering, Perm, Shape, Val, identity
from fusegraph.graph.infer_base import broadcast_dims
from fusegraph.graph.node import Node
from fusegraph.graph.ops import POINTWISE, PointwiseAttrs, PointwiseMode
from fusegraph.graph.tensor import TensorAttr

M = PointwiseMode
# (lowering, operands aligned and cast, attrs, result shape, result order, compute type)
PointwiseLowering = Callable[[Lowering, list[Val], PointwiseAttrs, Shape, Perm, DataType], Val]

_FLOAT = "!torch.float"
_INT = "!torch.int"
_STR = "!torch.str"


def _unary(name: str) -> PointwiseLowering:
    def lower(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
        return c.b.aten(name, [a[0]], shape, ct, perm)

    return lower


def _binary(name: str, *, alpha: bool = False, out: DataType | None = None) -> PointwiseLowering:
    def lower(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
        extra = [(c.b.const_int(1), _INT)] if alpha else []
        return c.b.aten(name, [a[0], a[1], *extra], shape, out or ct, perm)

    return lower


def _div(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    if ct.is_float:
        return c.b.aten("div.Tensor", a[:2], shape, ct, perm)
    # Integer division truncates toward zero (C semantics, as the reference does).
    return c.b.aten("div.Tensor_mode", [a[0], a[1], (c.b.const_str("trunc"), _STR)], shape, ct, perm)


def _scalar_op(c: Lowering, name: str, x: Val, value: float, *, alpha: bool = False) -> Val:
    extra = [(c.b.const_int(1), _INT)] if alpha else []
    return c.b.aten(name, [x, (c.b.const_float(value), _FLOAT), *extra], x.shape, x.dtype, x.perm)


def _relu(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    """x <= lower: lower + slope * (x - lower); else min(x, upper)."""
    x = a[0]
    lower, upper = p.param("relu_lower_clip"), p.param("relu_upper_clip")
    slope = p.param("relu_lower_clip_slope")
    b = c.b
    if slope == 0.0 and lower <= upper:
        if lower == 0.0 and math.isinf(upper):
            return b.aten("relu", [x], shape, ct, perm)
        hi = (b.const_float(upper), _FLOAT) if math.isfinite(upper) else (b.const_none(), "!torch.none")
        return b.aten("clamp", [x, (b.const_float(lower), _FLOAT), hi], shape, ct, perm)
    if lower == 0.0 and math.isinf(upper):
        return b.aten("leaky_relu", [x, (b.const_float(slope), _FLOAT)], shape, ct, perm)
    below = b.aten("le.Scalar", [x, (b.const_float(lower), _FLOAT)], shape, DataType.BOOLEAN, perm)
    low = _scalar_op(c, "sub.Scalar", x, lower, alpha=True)
    low = _scalar_op(c, "add.Scalar", _scalar_op(c, "mul.Scalar", low, slope), lower, alpha=True)
    high = _scalar_op(c, "clamp_max", x, upper) if math.isfinite(upper) else x
    return b.aten("where.self", [below, low, high], shape, ct, perm)


def _gelu(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    return c.b.aten("gelu", [a[0], (c.b.const_str("none"), _STR)], shape, ct, perm)


def _gelu_tanh(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written out: torch's "tanh"
    gelu lowers with a 5e-5 relative error in f32 on IREE 3.13."""
    x = a[0]
    b = c.b
    x3 = b.aten("mul.Tensor", [x, b.aten("mul.Tensor", [x, x], shape, ct, perm)], shape, ct, perm)
    inner = b.aten("add.Tensor", [x, _scalar_op(c, "mul.Scalar", x3, 0.044715), (b.const_int(1), _INT)], shape, ct, perm)
    t = b.aten("tanh", [_scalar_op(c, "mul.Scalar", inner, math.sqrt(2.0 / math.pi))], shape, ct, perm)
    half_x = _scalar_op(c, "mul.Scalar", x, 0.5)
    return b.aten("mul.Tensor", [half_x, _scalar_op(c, "add.Scalar", t, 1.0, alpha=True)], shape, ct, perm)


def _elu(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    b = c.b
    args = [(b.const_float(p.param("elu_alpha")), _FLOAT), (b.const_float(1.0), _FLOAT), (b.const_float(1.0), _FLOAT)]
    return b.aten("elu", [a[0], *args], shape, ct, perm)


def _swish(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    beta = p.param("swish_beta")
    if beta == 1.0:
        return c.b.aten("silu", [a[0]], shape, ct, perm)
    s = c.b.aten("sigmoid", [_scalar_op(c, "mul.Scalar", a[0], beta)], shape, ct, perm)
    return c.b.aten("mul.Tensor", [a[0], s], shape, ct, perm)


def _softplus(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    # torch's threshold (linear above beta*x > 20) is within 2e-9 of the exact value.
    b = c.b
    args = [(b.const_float(p.param("softplus_beta")), _FLOAT), (b.const_float(20.0), _FLOAT)]
    return b.aten("softplus", [a[0], *args], shape, ct, perm)


def _identity(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    return a[0]


def _select(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    return c.b.aten("where.self", [a[2], a[0], a[1]], shape, ct, perm)


def _relu_bwd(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    thr = (c.b.const_float(p.param("relu_lower_clip")), _FLOAT)
    return c.b.aten("threshold_backward", [a[0], a[1], thr], shape, ct, perm)


def _full(c: Lowering, v: Val, shape: Shape, perm: Perm) -> Val:
    """``v`` expanded to the result's ``shape`` (stored in order ``perm``).

    torch's activation-backward ops (gelu/tanh/sigmoid_backward) do not broadcast, and
    torch-mlir lowers them assuming grad and input have the result's shape: a broadcast dy
    became a 'tensor.cast' from [5,2,3,4] to [1,2,1,4] that IREE rejected (or a failed
    translation when a reduction read the result)."""
    logical = [0] * len(perm)
    for i, axis in enumerate(perm):
        logical[axis] = shape[i]
    return c.broadcast(v, logical, perm) if v.shape != shape else v


def _gelu_bwd(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
    dy, x = _full(c, a[0], shape, perm), _full(c, a[1], shape, perm)
    return c.b.aten("gelu_backward", [dy, x, (c.b.const_str("none"), _STR)], shape, ct, perm)


def _via_output(fwd: str, bwd: str) -> PointwiseLowering:
    """Backward ops torch defines on the forward output (tanh, sigmoid)."""

    def lower(c: Lowering, a: list[Val], p: PointwiseAttrs, shape: Shape, perm: Perm, ct: DataType) -> Val:
        y = c.b.aten(fwd, [a[1]], a[1].shape, ct, a[1].perm)
        return c.b.aten(bwd, [_full(c, a[0], shape, perm), _full(c, y, shape, perm)], shape, ct, perm)

    return lower


_B = DataType.BOOLEAN
POINTWISE_LOWER: dict[PointwiseMode, PointwiseLowering] = {
    M.ADD: _binary("add.Tensor", alpha=True),
    M.SUB: _binary("sub.Tensor", alpha=True),
    M.MUL: _binary("mul.Tensor"),
    M.DIV: _div,
    M.MAX: _binary("maximum"),
    M.MIN: _binary("minimum"),
    M.POW: _binary("pow.Tensor_Tensor"),
    M.ABS: _unary("abs"),
    M.NEG: _unary("neg"),
    M.EXP: _unary("exp"),
    M.LOG: _unary("log"),
    M.SQRT: _unary("sqrt"),
    M.RSQRT: _unary("rsqrt"),
    M.RECIPROCAL: _unary("reciprocal"),
    M.SIN: _unary("sin"),
    M.COS: _unary("cos"),
    M.ERF: _unary("erf"),
    M.FLOOR: _unary("floor"),
    M.CEIL: _unary("ceil"),
    M.IDENTITY: _identity,
    M.RELU_FWD: _relu,
    M.TANH_FWD: _unary("tanh"),
    M.SIGMOID_FWD: _unary("sigmoid"),
    M.GELU_FWD: _gelu,
    M.GELU_APPROX_TANH_FWD: _gelu_tanh,
    M.ELU_FWD: _elu,
    M.SWISH_FWD: _swish,
    M.SOFTPLUS_FWD: _softplus,
    M.CMP_EQ: _binary("eq.Tensor", out=_B),
    M.CMP_NEQ: _binary("ne.Tensor", out=_B),
    M.CMP_GT: _binary("gt.Tensor", out=_B),
    M.CMP_GE: _binary("ge.Tensor", out=_B),
    M.CMP_LT: _binary("lt.Tensor", out=_B),
    M.CMP_LE: _binary("le.Tensor", out=_B),
    M.LOGICAL_AND: _binary("logical_and", out=_B),
    M.LOGICAL_OR: _binary("logical_or", out=_B),
    M.LOGICAL_NOT: _unary("logical_not"),
    M.BINARY_SELECT: _select,
    M.RELU_BWD: _relu_bwd,
    M.GELU_BWD: _gelu_bwd,
    M.TANH_BWD: _via_output("tanh", "tanh_backward"),
    M.SIGMOID_BWD: _via_output("sigmoid", "sigmoid_backward"),
}

# IREE 3.13's CPU backend links no f64 sin/cos/tanh and cannot lower f64 erf, so these
# cannot compute in a declared f64 compute type (undeclared, f64 tensors compute them in f32).
NO_F64 = frozenset(
    {M.SIN, M.COS, M.ERF, M.TANH_FWD, M.GELU_FWD, M.GELU_APPROX_TANH_FWD, M.GELU_BWD, M.TANH_BWD}
)

# Modes computed in floating point even on integer inputs (their params are floats).
_FLOAT_MATH = frozenset({M.RELU_FWD, M.RELU_BWD})


def choose_perm(ctx: Lowering, inputs: Sequence[TensorAttr], out: TensorAttr) -> Perm:
    """The layout to compute in: that of the first full-size input, so no transposes."""
    rank = len(out.shape)
    fallback: Perm | None = None
    for t in inputs:
        if t.is_scalar or len(t.shape) != rank:
            continue
        val = ctx.get(t)
        if val.logical_shape == tuple(out.shape):
            return val.perm
        if fallback is None and any(d != 1 for d in val.shape):
            fallback = val.perm
    return fallback or identity(rank)


def pointwise_compute_type(ctx: Lowering, node: Node) -> DataType:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    spec = POINTWISE[attrs.mode]
    ins = [node.inputs[p] for p in ("a", "b", "c")[: spec.arity]]
    operands = ins[:2] if attrs.mode == M.BINARY_SELECT else ins
    strong = [t for t in operands if not t.is_scalar] or operands
    fam = family(strong[0].dtype)
    if fam == "bool":
        return DataType.BOOLEAN
    if fam == "int":
        dt = strong[0].dtype
        for t in strong[1:]:
            dt = promote(dt, t.dtype)
        return ctx.compute_type(node, DataType.FLOAT) if attrs.mode in _FLOAT_MATH else dt
    return ctx.compute_type(node, *(t.dtype for t in strong))


def lower_pointwise(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    spec = POINTWISE[attrs.mode]
    ins = [node.inputs[p] for p in ("a", "b", "c")[: spec.arity]]
    out = node.outputs["y"]
    perm = choose_perm(ctx, ins, out)
    ct = pointwise_compute_type(ctx, node)
    if ct == DataType.DOUBLE and attrs.mode in NO_F64:
        if (attrs.compute_data_type or ctx.graph.compute_data_type) != DataType.DOUBLE:
            ct = DataType.FLOAT  # f64 only by default: f32 is the best IREE has for these
        else:
            raise ctx.fail(
                f"{attrs.mode.name} cannot compute in f64 on IREE (no f64 sin/cos/tanh/erf in its "
                "code generation); declare compute_data_type=FLOAT for this node"
            )
    args: list[Val] = []
    for i, t in enumerate(ins):
        is_cond = attrs.mode == M.BINARY_SELECT and i == 2
        want = DataType.BOOLEAN if is_cond else ct
        if t.is_scalar:
            assert t.value is not None
            args.append(ctx.b.literal(t.value, want))
        else:
            args.append(ctx.cast(ctx.align(ctx.get(t), perm), want))
    shaped = [a.shape for a in args if a.rank]
    shape = broadcast_dims(shaped) if shaped else ()
    assert shape is not None
    if not shape:  # every operand a scalar: compute at the output's shape
        args[0] = ctx.broadcast(args[0], out.shape, perm)
        shape = args[0].shape
    if spec.commutative and ctx.swap_commutative(args[0], args[1]):
        args = [args[1], args[0]]
    result = POINTWISE_LOWER[attrs.mode](ctx, args, attrs, tuple(shape), perm, ct)
    ctx.set(out, result)

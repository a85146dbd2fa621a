"""Elementwise ops: arithmetic, comparisons and logic, activations, Where, Cast.

Each is one or a few pointwise graph ops; one-element constant operands become scalars
(``Importer.operand``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.graph.ops import PointwiseMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import data_type_of, out_rank
from fusegraph.onnx.ops.table import Unmappable, contrib, fused, lowers, register

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


M = PointwiseMode


_BINARY = {
    "Add": M.ADD, "Sub": M.SUB, "Mul": M.MUL, "Div": M.DIV, "Pow": M.POW,
    "Equal": M.CMP_EQ, "Greater": M.CMP_GT, "Less": M.CMP_LT,
    "GreaterOrEqual": M.CMP_GE, "LessOrEqual": M.CMP_LE, "And": M.LOGICAL_AND, "Or": M.LOGICAL_OR,
}


_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "Equal", "And", "Or"})


def _ordered(imp: Importer, node: ONode, names: Sequence[str]) -> list[str]:
    """Activations first for commutative ops, so outputs inherit their memory layout."""
    if node.op_type not in _COMMUTATIVE:
        return list(names)
    return sorted(names, key=lambda n: (imp.is_const(n), -len(imp.shape(n))))


@lowers(*_BINARY)
def lower_binary(imp: Importer, node: ONode) -> None:
    if node.op_type == "Div" and imp.dtype(node.inputs[0]).is_integer:
        raise Unmappable("Div: integer division (ONNX truncation semantics are left to ONNX Runtime)")
    if node.op_type == "Pow" and imp.dtype(node.inputs[0]) != imp.dtype(node.inputs[1]):
        raise Unmappable(
            f"Pow: base {imp.dtype(node.inputs[0]).name} and exponent {imp.dtype(node.inputs[1]).name} types differ"
        )
    rank = out_rank(imp, node)
    a_name, b_name = _ordered(imp, node, node.inputs[:2])
    y = imp.g.pointwise(imp.operand(a_name, rank), imp.operand(b_name, rank), mode=_BINARY[node.op_type])
    imp.set(node.outputs[0], y)


@lowers("Max", "Min", "Sum", "Mean")
def lower_variadic(imp: Importer, node: ONode) -> None:
    mode = {"Max": M.MAX, "Min": M.MIN, "Sum": M.ADD, "Mean": M.ADD}[node.op_type]
    names = _ordered(imp, node, [i for i in node.inputs if i])
    rank = out_rank(imp, node)
    acc = imp.operand(names[0], rank)
    if len(names) == 1:
        acc = imp.g.identity(acc)
    for n in names[1:]:
        acc = imp.g.pointwise(acc, imp.operand(n, rank), mode=mode)
    if node.op_type == "Mean" and len(names) > 1:
        acc = imp.g.mul(acc, imp.scalar(1.0 / len(names), acc.dtype))
    imp.set(node.outputs[0], acc)


def _unary(mode: PointwiseMode) -> Callable[[Importer, ONode], None]:
    def lower(imp: Importer, node: ONode) -> None:
        imp.set(node.outputs[0], imp.g.pointwise(imp.tensor(node.inputs[0]), mode=mode))

    return lower


_UNARY = {
    "Relu": M.RELU_FWD, "Sigmoid": M.SIGMOID_FWD, "Tanh": M.TANH_FWD, "Erf": M.ERF,
    "Softplus": M.SOFTPLUS_FWD, "Abs": M.ABS, "Neg": M.NEG, "Exp": M.EXP, "Log": M.LOG,
    "Sqrt": M.SQRT, "Reciprocal": M.RECIPROCAL, "Sin": M.SIN, "Cos": M.COS,
    "Floor": M.FLOOR, "Ceil": M.CEIL,
}
for _op, _mode in _UNARY.items():
    register(_op, _unary(_mode))


@lowers("LeakyRelu")
def lower_leaky_relu(imp: Importer, node: ONode) -> None:
    alpha = float(node.attr("alpha", 0.01))
    imp.set(node.outputs[0], imp.g.relu(imp.tensor(node.inputs[0]), negative_slope=alpha))


@lowers("Elu")
def lower_elu(imp: Importer, node: ONode) -> None:
    imp.set(node.outputs[0], imp.g.elu(imp.tensor(node.inputs[0]), alpha=float(node.attr("alpha", 1.0))))


@lowers("Selu")
def lower_selu(imp: Importer, node: ONode) -> None:
    alpha = float(node.attr("alpha", 1.67326319217681884765625))
    gamma = float(node.attr("gamma", 1.05070102214813232421875))
    x = imp.tensor(node.inputs[0])
    y = imp.g.elu(x, alpha=alpha)
    imp.set(node.outputs[0], imp.g.mul(y, imp.scalar(gamma, y.dtype)))


def _hard_sigmoid(imp: Importer, x: TensorAttr, alpha: float, beta: float) -> TensorAttr:
    t = imp.g.add(imp.g.mul(x, imp.scalar(alpha, x.dtype)), imp.scalar(beta, x.dtype))
    return imp.g.relu(t, lower_clip=0.0, upper_clip=1.0)


@lowers("HardSigmoid")
def lower_hard_sigmoid(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], _hard_sigmoid(imp, x, float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))))


@lowers("HardSwish")
def lower_hard_swish(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.mul(x, _hard_sigmoid(imp, x, 1.0 / 6.0, 0.5)))


@lowers("Softsign")
def lower_softsign(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    den = imp.g.add(imp.g.abs(x), imp.scalar(1.0, x.dtype))
    imp.set(node.outputs[0], imp.g.div(x, den))


@lowers("Mish")
def lower_mish(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.mul(x, imp.g.tanh(imp.g.softplus(x))))


@lowers("Gelu")
def lower_gelu(imp: Importer, node: ONode) -> None:
    approx = node.attr("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else str(approx)
    x = imp.tensor(node.inputs[0])
    if approx == "tanh":
        imp.set(node.outputs[0], imp.g.gelu_approx_tanh(x))
    elif approx == "none":
        imp.set(node.outputs[0], imp.g.gelu(x))
    else:
        raise Unmappable(f"Gelu: approximate={approx!r}")


@lowers(fused("Gelu"))
def lower_fused_gelu(imp: Importer, node: ONode) -> None:
    """patterns_gelu's match: the Erf form (approximate=0) or the Tanh form (1)."""
    x = imp.tensor(node.inputs[int(node.attr("x"))])
    y = imp.g.gelu_approx_tanh(x) if int(node.attr("approximate")) else imp.g.gelu(x)
    _pattern(imp, y, "gelu.tanh" if int(node.attr("approximate")) else "gelu.erf")
    imp.set(node.outputs[0], y)


@lowers(contrib("Gelu"), contrib("BiasGelu"), contrib("FastGelu"))
def lower_contrib_gelu(imp: Importer, node: ONode) -> None:
    """ONNX Runtime's Gelu (Erf form), BiasGelu (of x + bias) and FastGelu (Tanh form, of x + bias)."""
    x = imp.tensor(node.inputs[0])
    if len(node.inputs) > 1 and node.inputs[1]:
        x = imp.g.add(x, imp.operand(node.inputs[1], len(x.dim)))
    y = imp.g.gelu_approx_tanh(x) if node.op_type == "FastGelu" else imp.g.gelu(x)
    if tuple(y.dim) != tuple(imp.shape(node.inputs[0])):
        raise Unmappable(f"{node.op_type}: bias broadcasts the input up to {y.dim}")
    imp.set(node.outputs[0], y)


def _pattern(imp: Importer, t: TensorAttr, pattern: str) -> None:
    """Marks the node that made ``t`` for the report's fusion counts."""
    for n in reversed(imp.g.nodes):
        if any(o is t for o in n.outputs.values()):
            n.meta["pattern"] = pattern
            return


@lowers("PRelu")
def lower_prelu(imp: Importer, node: ONode) -> None:
    """max(x, 0) + slope * min(x, 0): PRelu's slope broadcasts (unidirectionally)."""
    x = imp.tensor(node.inputs[0])
    rank = len(x.dim)
    slope = imp.operand(node.inputs[1], rank)
    zero = imp.scalar(0.0, x.dtype)
    y = imp.g.add(imp.g.max(x, zero), imp.g.mul(imp.g.min(x, zero), slope))
    imp.set(node.outputs[0], y)


@lowers("ThresholdedRelu")
def lower_thresholded_relu(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    alpha = float(node.attr("alpha", 1.0))
    keep = imp.g.cmp_gt(x, imp.scalar(alpha, x.dtype))
    imp.set(node.outputs[0], imp.g.binary_select(x, imp.scalar(0.0, x.dtype), keep))


@lowers("Clip")
def lower_clip(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    if imp.og.opset < 11:
        lo: float | None = float(node.attr("min", -3.4028234663852886e38))
        hi: float | None = float(node.attr("max", 3.4028234663852886e38))
    else:
        lo = hi = None
        if len(node.inputs) > 1 and node.inputs[1]:
            lo = float(imp.const(node.inputs[1], "min").reshape(-1)[0])
        if len(node.inputs) > 2 and node.inputs[2]:
            hi = float(imp.const(node.inputs[2], "max").reshape(-1)[0])
    y = x
    if lo is not None and hi is not None and x.dtype.is_float and lo <= hi:
        y = imp.g.relu(x, lower_clip=lo, upper_clip=hi)
    else:
        if lo is not None:
            y = imp.g.max(y, imp.scalar(lo, x.dtype))
        if hi is not None:
            y = imp.g.min(y, imp.scalar(hi, x.dtype))
        if y is x:
            y = imp.g.identity(x)
    imp.set(node.outputs[0], y)


@lowers("Sign")
def lower_sign(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    dt = x.dtype
    zero = imp.scalar(0.0, dt)
    neg = imp.g.binary_select(imp.scalar(-1.0, dt), zero, imp.g.cmp_lt(x, imp.scalar(0.0, dt)))
    imp.set(node.outputs[0], imp.g.binary_select(imp.scalar(1.0, dt), neg, imp.g.cmp_gt(x, imp.scalar(0.0, dt))))


@lowers("Shrink")
def lower_shrink(imp: Importer, node: ONode) -> None:
    x = imp.tensor(node.inputs[0])
    dt = x.dtype
    lambd, bias = float(node.attr("lambd", 0.5)), float(node.attr("bias", 0.0))
    hi = imp.g.binary_select(imp.g.sub(x, imp.scalar(bias, dt)), imp.scalar(0.0, dt), imp.g.cmp_gt(x, imp.scalar(lambd, dt)))
    y = imp.g.binary_select(imp.g.add(x, imp.scalar(bias, dt)), hi, imp.g.cmp_lt(x, imp.scalar(-lambd, dt)))
    imp.set(node.outputs[0], y)


@lowers("Where")
def lower_where(imp: Importer, node: ONode) -> None:
    rank = out_rank(imp, node)
    c = imp.operand(node.inputs[0], rank)
    a, b = imp.operand(node.inputs[1], rank), imp.operand(node.inputs[2], rank)
    imp.set(node.outputs[0], imp.g.binary_select(a, b, c))


@lowers("Not")
def lower_not(imp: Importer, node: ONode) -> None:
    imp.set(node.outputs[0], imp.g.logical_not(imp.tensor(node.inputs[0])))


@lowers("Xor")
def lower_xor(imp: Importer, node: ONode) -> None:
    """a != b on booleans (the graph API has and/or/not, and != takes any type)."""
    rank = out_rank(imp, node)
    imp.set(node.outputs[0], imp.g.cmp_neq(imp.operand(node.inputs[0], rank), imp.operand(node.inputs[1], rank)))


@lowers("Cast")
def lower_cast(imp: Importer, node: ONode) -> None:
    to = data_type_of(int(node.attr("to")), "Cast target")
    x = imp.tensor(node.inputs[0])
    if x.dtype == to:
        imp.set(node.outputs[0], imp.g.identity(x))
        return
    if to == DataType.BOOLEAN and x.dtype != DataType.BOOLEAN:  # ONNX: x != 0 (NaN is true)
        imp.set(node.outputs[0], imp.g.cmp_neq(x, imp.scalar(0, x.dtype)))
        return
    y = imp.g.identity(x)
    y.set_data_type(to)
    imp.set(node.outputs[0], y)


@lowers("IsNaN")
def lower_isnan(imp: Importer, node: ONode) -> None:
    """x != x: true exactly where x is NaN."""
    x = imp.tensor(node.inputs[0])
    if not x.dtype.is_float:
        raise Unmappable(f"IsNaN: input of type {x.dtype.name} (floating point only)")
    imp.set(node.outputs[0], imp.g.cmp_neq(x, x))


@lowers("IsInf")
def lower_isinf(imp: Importer, node: ONode) -> None:
    """x == +inf, x == -inf, or either, as detect_positive / detect_negative ask."""
    x = imp.tensor(node.inputs[0])
    if not x.dtype.is_float:
        raise Unmappable(f"IsInf: input of type {x.dtype.name} (floating point only)")
    pos, neg = int(node.attr("detect_positive", 1)), int(node.attr("detect_negative", 1))
    if not pos and not neg:
        raise Unmappable("IsInf: detect_positive=0 and detect_negative=0 (always false)")
    hits = [imp.g.cmp_eq(x, imp.scalar(v, x.dtype)) for v, on in ((math.inf, pos), (-math.inf, neg)) if on]
    imp.set(node.outputs[0], hits[0] if len(hits) == 1 else imp.g.logical_or(hits[0], hits[1]))


@lowers("Trilu")
def lower_trilu(imp: Importer, node: ONode) -> None:
    """x where a constant [M, N] triangle mask holds, else 0 (the mask broadcasts over the
    leading axes)."""
    xs = imp.shape(node.inputs[0])
    if len(xs) < 2:
        raise Unmappable(f"Trilu: input rank {len(xs)} < 2")
    k = 0
    if len(node.inputs) > 1 and node.inputs[1]:
        k = int(imp.const(node.inputs[1], "k").reshape(-1)[0])
    m, n = xs[-2], xs[-1]
    mask = np.triu(np.ones((m, n), dtype=bool), k) if int(node.attr("upper", 1)) else np.tril(np.ones((m, n), dtype=bool), k)
    x = imp.tensor(node.inputs[0])
    keep = imp.constant(mask.reshape((1,) * (len(xs) - 2) + (m, n)), "trilu_mask", "plain")
    zero = imp.scalar(False if x.dtype == DataType.BOOLEAN else 0, x.dtype)
    imp.set(node.outputs[0], imp.g.binary_select(x, zero, keep))

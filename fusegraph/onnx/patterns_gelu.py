"""GELU as exporters write it out, fused into one node the importer lowers to the graph
API's pointwise ``gelu_fwd`` / ``gelu_approx_tanh_fwd``.

``onnx.gelu.erf`` (BERT, torch ``F.gelu`` before opset 20), anchored at the ``Erf``::

    Erf(Div(x, sqrt 2) | Mul(x, 1/sqrt 2)) -> Add 1 -> times x and 0.5, in any grouping

``onnx.gelu.tanh`` (GPT-2's ``gelu_new``, ``approximate='tanh'``), anchored at the ``Tanh``::

    Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), sqrt(2/pi))) -> Add 1 -> times x and 0.5

Every constant must be the formula's value, exactly or rounded once to its type.
"""

from __future__ import annotations

import math

from fusegraph.onnx.model import ONode
from fusegraph.onnx.patterns_common import Ctx, Refused

ERF = "onnx.gelu.erf"
TANH = "onnx.gelu.tanh"


def _other(node: ONode, value: str) -> str | None:
    if len(node.inputs) != 2 or value not in node.inputs:
        return None
    a, b = node.inputs
    return b if a == value else a


def _mul_by(ctx: Ctx, node: ONode | None, want: float) -> str | None:
    """The non-constant operand of ``node`` = Mul(v, want) (either order), else None."""
    if node is None or node.op_type != "Mul" or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if ctx.const_is(b, want) and a not in ctx.og.constants:
        return a
    if ctx.const_is(a, want) and b not in ctx.og.constants:
        return b
    return None


def _one_plus(ctx: Ctx, value: str, nodes: list[ONode]) -> str:
    add = ctx.next_node(value, "the Erf/Tanh output", "Add")
    if not ctx.const_is(_other(add, value) or "", 1.0):
        raise Refused(f"{add.name}: adds {ctx.scalar(_other(add, value) or '')}, not the constant 1")
    nodes.append(add)
    return add.outputs[0]


def _times_half_x(ctx: Ctx, one_plus: str, x: str, nodes: list[ONode]) -> str:
    """The product of ``one_plus``, ``x`` and 0.5 in any grouping; returns its output."""
    m1 = ctx.next_node(one_plus, "1 + erf/tanh", "Mul")
    other = _other(m1, one_plus) or ""
    if other == x or ctx.const_is(other, 0.5):
        m2 = ctx.sole_reader(m1.outputs[0])
        want = 0.5 if other == x else None
        rest = _other(m2, m1.outputs[0]) if m2 is not None and m2.op_type == "Mul" else None
        if rest is not None and ((want is not None and ctx.const_is(rest, 0.5)) or (want is None and rest == x)):
            nodes += [m1, m2]  # type: ignore[list-item]
            return m2.outputs[0]  # type: ignore[union-attr]
        raise Refused(f"{m1.name}: (1 + ...) * {'x' if other == x else '0.5'} is not then multiplied by "
                      f"{'0.5' if other == x else 'x'}")
    h = ctx.producer.get(other)
    if h is not None and _mul_by(ctx, h, 0.5) == x:
        ctx.only_reader(other, "x * 0.5", [m1])
        nodes += [h, m1]
        return m1.outputs[0]
    raise Refused(f"{m1.name}: multiplies (1 + ...) by '{other}', not by x, 0.5 or x * 0.5")


def _check(ctx: Ctx, nodes: list[ONode], out: str, x: str) -> None:
    for n in nodes:
        for o in n.outputs:
            if o and o != out:
                ctx.only_reader(o, "the intermediate", nodes)
    if ctx.og.shape(out) != ctx.og.shape(x):
        raise Refused(f"the output's shape {ctx.og.shape(out)} differs from x's {ctx.og.shape(x)}")
    if ctx.elem(x) not in (1, 10, 16):
        raise Refused(f"'{x}' is not float32/float16/bfloat16")
    if why := ctx.excluded(nodes):
        raise Refused(why)


def _erf(ctx: Ctx, erf: ONode) -> tuple[list[ONode], str, str] | None:
    d = ctx.producer.get(erf.inputs[0])
    if d is None or d.op_type not in ("Div", "Mul") or len(d.inputs) != 2:
        return None
    if d.op_type == "Div":
        x, c = d.inputs
        if x in ctx.og.constants or ctx.scalar(c) is None:
            return None
        if not ctx.const_is(c, math.sqrt(2.0)):
            raise Refused(f"{d.name}: divides by {ctx.scalar(c)}, not sqrt(2)")
    else:
        x = next((i for i in d.inputs if i not in ctx.og.constants), "")
        c = _other(d, x) or ""
        if not x or ctx.scalar(c) is None:
            return None
        if not ctx.const_is(c, 1.0 / math.sqrt(2.0)):
            raise Refused(f"{d.name}: multiplies by {ctx.scalar(c)}, not 1/sqrt(2)")
    nodes = [d, erf]
    out = _times_half_x(ctx, _one_plus(ctx, erf.outputs[0], nodes), x, nodes)
    _check(ctx, nodes, out, x)
    return nodes, out, x


def _cube(ctx: Ctx, value: str, x: str) -> list[ONode] | None:
    p = ctx.producer.get(value)
    if p is None:
        return None
    if p.op_type == "Pow" and p.inputs[0] == x and ctx.const_is(p.inputs[1], 3.0):
        return [p]
    if p.op_type == "Mul" and x in p.inputs:
        sq = ctx.producer.get(_other(p, x) or "")
        if sq is not None and sq.op_type == "Mul" and sq.inputs == (x, x):
            return [sq, p]
    return None


def _tanh(ctx: Ctx, th: ONode) -> tuple[list[ONode], str, str] | None:
    s = ctx.producer.get(th.inputs[0])
    if s is None or s.op_type != "Mul" or len(s.inputs) != 2:
        return None
    inner = next((i for i in s.inputs if i not in ctx.og.constants), "")
    add = ctx.producer.get(inner)
    if add is None or add.op_type != "Add" or len(add.inputs) != 2:
        return None
    if not ctx.const_is(_other(s, inner) or "", math.sqrt(2.0 / math.pi)):
        raise Refused(f"{s.name}: multiplies by {ctx.scalar(_other(s, inner) or '')}, not sqrt(2/pi)")
    for x in add.inputs:
        t3 = ctx.producer.get(_other(add, x) or "")
        if t3 is None or t3.op_type != "Mul":
            continue
        cube = next((_cube(ctx, i, x) for i in t3.inputs if _cube(ctx, i, x) is not None), None)
        if cube is None:
            continue
        k = _other(t3, cube[-1].outputs[0]) or ""
        if not ctx.const_is(k, 0.044715):
            raise Refused(f"{t3.name}: multiplies x^3 by {ctx.scalar(k)}, not 0.044715")
        nodes = [*cube, t3, add, s, th]
        out = _times_half_x(ctx, _one_plus(ctx, th.outputs[0], nodes), x, nodes)
        _check(ctx, nodes, out, x)
        return nodes, out, x
    raise Refused(f"{add.name}: is not x + 0.044715 * x^3")


def _fuse(ctx: Ctx, op: str, name: str, approximate: int) -> int:
    count = 0
    gone: set[int] = set()
    match = _erf if op == "Erf" else _tanh
    for anchor in list(ctx.og.nodes):
        if id(anchor) in gone or anchor.op_type != op or not anchor.is_default_domain:
            continue
        try:
            found = match(ctx, anchor)
        except Refused as exc:
            ctx.refuse(name, anchor, exc.reason)
            continue
        if found is None:
            continue
        nodes, out, x = found
        gone.update(id(n) for n in nodes)
        ctx.fuse("Gelu", nodes, out, {"x": x}, {"approximate": approximate})
        count += 1
    return count


def fuse_gelu_erf(ctx: Ctx) -> int:
    return _fuse(ctx, "Erf", ERF, 0)


def fuse_gelu_tanh(ctx: Ctx) -> int:
    return _fuse(ctx, "Tanh", TANH, 1)

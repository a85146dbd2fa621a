"""Normalizations as exporters decompose them, fused into one node the importer lowers to
the graph API's ``rmsnorm`` / ``layernorm``.

``onnx.norm.rms`` (Llama's ``LlamaRMSNorm``, T5's norm), anchored at the ``ReduceMean``::

    ReduceMean(Pow(x, 2) | Mul(x, x), trailing axes, keepdims=1) -> Add eps -> Sqrt
      -> Div(1, .) -> Mul(x, .)  |  Reciprocal -> Mul(x, .)  |  Div(x, .)
      -> [Cast to the same type]... -> [Mul by a weight over the normalized axes]

``onnx.norm.layer`` (LayerNorm before opset 17's LayerNormalization), anchored at the
``Sub``::

    d = Sub(x, ReduceMean(x, trailing axes, keepdims=1))
    ReduceMean(Pow(d, 2) | Mul(d, d), same axes) -> Add eps -> Sqrt -> Div(d, .)
      -> [Mul by a weight] -> [Add a bias]

A ``Cast`` to another type inside (fp16 models normalizing in fp32) ends the match before
it: what is fused then computes in one type, as the ONNX nodes did.
"""

from __future__ import annotations

import numpy as np

from fusegraph.onnx.model import ONode
from fusegraph.onnx.patterns_common import Ctx, Refused

RMS = "onnx.norm.rms"
LAYER = "onnx.norm.layer"


def _other(node: ONode, value: str) -> str | None:
    if len(node.inputs) != 2 or value not in node.inputs:
        return None
    a, b = node.inputs
    return b if a == value else a


def _squares(ctx: Ctx, value: str, x: str | None = None) -> tuple[str, ONode] | None:
    """(x, node) where ``value`` is Pow(x, 2) or Mul(x, x)."""
    p = ctx.made_by(value, "Pow", "Mul")
    if p is None or len(p.inputs) != 2:
        return None
    if (p.op_type == "Mul" and p.inputs[0] == p.inputs[1]) or (p.op_type == "Pow" and ctx.const_is(p.inputs[1], 2.0)):
        src = p.inputs[0]
    else:
        return None
    return (src, p) if x is None or src == x else None


def _axes(ctx: Ctx, rm: ONode, rank: int) -> list[int]:
    if ctx.og.opset >= 18:
        if len(rm.inputs) < 2 or not rm.inputs[1]:
            raise Refused(f"{rm.name}: ReduceMean has no axes (it reduces every axis)")
        c = ctx.og.constants.get(rm.inputs[1])
        if c is None:
            raise Refused(f"{rm.name}: ReduceMean axes '{rm.inputs[1]}' are not constant")
        axes = [int(a) for a in c.reshape(-1)]
    else:
        axes = [int(a) for a in rm.attr("axes", [])]
    if not axes:
        raise Refused(f"{rm.name}: ReduceMean has no axes (it reduces every axis)")
    if int(rm.attr("keepdims", 1)) != 1:
        raise Refused(f"{rm.name}: ReduceMean keepdims=0")
    axes = sorted({a % rank for a in axes})
    if axes != list(range(axes[0], rank)) or axes[0] == 0:
        raise Refused(f"{rm.name}: ReduceMean axes {axes} are not the trailing axes of a rank-{rank} input (batch excluded)")
    return axes


def _eps_sqrt(ctx: Ctx, ms: str, nodes: list[ONode]) -> tuple[float, str]:
    """Add(ms, eps) -> Sqrt: (eps, the Sqrt's output)."""
    add = ctx.next_node(ms, "the mean of squares", "Add")
    eps_name = _other(add, ms)
    eps = ctx.scalar(eps_name or "")
    if eps is None or not eps >= 0.0:
        raise Refused(f"{add.name}: adds '{eps_name}', not a non-negative scalar constant epsilon")
    sq = ctx.next_node(add.outputs[0], "the variance plus epsilon", "Sqrt")
    nodes += [add, sq]
    return eps, sq.outputs[0]


def _divide(ctx: Ctx, x: str, root: str, nodes: list[ONode]) -> str:
    """x / root as Div(x, root), Mul(x, Div(1, root)) or Mul(x, Reciprocal(root))."""
    r = ctx.next_node(root, "the root", "Div", "Reciprocal")
    if r.op_type == "Div" and r.inputs == (x, root):
        nodes.append(r)
        return r.outputs[0]
    if (r.op_type == "Div" and r.inputs[1] == root and ctx.const_is(r.inputs[0], 1.0)) or r.op_type == "Reciprocal":
        m = ctx.next_node(r.outputs[0], "the inverse root", "Mul")
        if _other(m, r.outputs[0]) == x:
            nodes += [r, m]
            return m.outputs[0]
        raise Refused(f"{r.name}: the inverse root is not multiplied by the normalized input '{x}'")
    raise Refused(f"{r.name}: {r.op_type} of the root is not Div(x, root), Div(1, root) or Reciprocal")


def _same_type_casts(ctx: Ctx, value: str, nodes: list[ONode]) -> str:
    while True:
        c = ctx.sole_reader(value)
        if c is not None and c.op_type == "Cast" and int(c.attr("to", 0)) == ctx.elem(value):
            nodes.append(c)
            value = c.outputs[0]
            continue
        return value


def _affine(ctx: Ctx, value: str, op: str, xs: tuple[int, ...], axis: int, nodes: list[ONode]) -> tuple[str, str]:
    """(output, parameter) of an optional Mul/Add by a tensor over the normalized axes."""
    n = ctx.sole_reader(value)
    if n is None or n.op_type != op or not n.is_default_domain:
        return value, ""
    w = _other(n, value)
    ws = ctx.og.shape(w or "")
    if not w or ws is None or w == value or ctx.og.shape(n.outputs[0]) != xs:
        return value, ""
    feat = xs[axis:]
    aligned = (1,) * (len(xs) - len(ws)) + tuple(ws)
    if any(d != 1 for d in aligned[:axis]) or any(a not in (1, f) for a, f in zip(aligned[axis:], feat, strict=True)):
        return value, ""
    if ctx.elem(w) != ctx.elem(value):
        return value, ""
    nodes.append(n)
    return n.outputs[0], w


def _float(ctx: Ctx, x: str) -> None:
    if ctx.elem(x) not in (1, 10, 16):
        raise Refused(f"'{x}' is not float32/float16/bfloat16")


def fuse_rms(ctx: Ctx) -> int:
    count = 0
    gone: set[int] = set()
    for rm in list(ctx.og.nodes):
        if id(rm) in gone or rm.op_type != "ReduceMean" or not rm.is_default_domain:
            continue
        found = _squares(ctx, rm.inputs[0])
        if found is None:
            continue
        x, sq = found
        if ctx.made_by(x, "Sub") is not None and ctx.made_by(ctx.producer[x].inputs[1], "ReduceMean"):
            continue  # the variance of a LayerNorm: onnx.norm.layer's
        try:
            nodes = [sq, rm]
            xs = ctx.og.shape(x)
            if xs is None or len(xs) < 2:
                raise Refused(f"the input '{x}' has shape {xs} (rank >= 2 needed)")
            _float(ctx, x)
            axes = _axes(ctx, rm, len(xs))
            ctx.only_reader(sq.outputs[0], "the squares", [rm])
            eps, root = _eps_sqrt(ctx, rm.outputs[0], nodes)
            y = _divide(ctx, x, root, nodes)
            y = _same_type_casts(ctx, y, nodes)
            y, w = _affine(ctx, y, "Mul", xs, axes[0], nodes)
            for n in nodes[:-1]:
                ctx.only_reader(n.outputs[0], "the intermediate", nodes)
            if why := ctx.excluded(nodes):
                raise Refused(why)
        except Refused as exc:
            ctx.refuse(RMS, rm, exc.reason)
            continue
        roles = {"x": x, **({"scale": w} if w else {})}
        gone.update(id(n) for n in nodes)
        ctx.fuse("RmsNorm", nodes, y, roles, {"epsilon": float(eps), "axis": axes[0]})
        count += 1
    return count


def fuse_layer(ctx: Ctx) -> int:
    count = 0
    gone: set[int] = set()
    for sub in list(ctx.og.nodes):
        if id(sub) in gone or sub.op_type != "Sub" or not sub.is_default_domain or len(sub.inputs) != 2:
            continue
        x = sub.inputs[0]
        rm1 = ctx.made_by(sub.inputs[1], "ReduceMean")
        if rm1 is None or rm1.inputs[0] != x:
            continue
        d = sub.outputs[0]
        try:
            xs = ctx.og.shape(x)
            if xs is None or len(xs) < 2:
                raise Refused(f"the input '{x}' has shape {xs} (rank >= 2 needed)")
            _float(ctx, x)
            axes = _axes(ctx, rm1, len(xs))
            readers = ctx.readers(d)
            sq = next((r for r in readers if _squares(ctx, r.outputs[0], d) is not None), None)
            if sq is None:
                raise Refused(f"the centred '{d}' is not squared (Pow(d, 2) or Mul(d, d))")
            rm2 = ctx.next_node(sq.outputs[0], "the squares", "ReduceMean")
            if _axes(ctx, rm2, len(xs)) != axes:
                raise Refused(f"{rm2.name}: the variance's axes differ from the mean's {axes}")
            nodes = [rm1, sub, sq, rm2]
            eps, root = _eps_sqrt(ctx, rm2.outputs[0], nodes)
            div = ctx.next_node(root, "the root", "Div")
            if div.inputs != (d, root):
                raise Refused(f"the root '{root}' is not read by one Div(centred, root)")
            nodes.append(div)
            y = _same_type_casts(ctx, div.outputs[0], nodes)
            y, w = _affine(ctx, y, "Mul", xs, axes[0], nodes)
            y, b = _affine(ctx, y, "Add", xs, axes[0], nodes)
            ctx.only_reader(rm1.outputs[0], "the mean", [sub])
            ctx.only_reader(d, "the centred input", [sq, div])
            for n in nodes[2:-1]:
                ctx.only_reader(n.outputs[0], "the intermediate", nodes)
            if why := ctx.excluded(nodes):
                raise Refused(why)
        except Refused as exc:
            ctx.refuse(LAYER, sub, exc.reason)
            continue
        roles = {"x": x, **({"scale": w} if w else {}), **({"bias": b} if b else {})}
        gone.update(id(n) for n in nodes)
        ctx.fuse("LayerNorm", nodes, y, roles, {"epsilon": float(eps), "axis": axes[0]})
        count += 1
    return count


__all__ = ["LAYER", "RMS", "fuse_layer", "fuse_rms", "np"]

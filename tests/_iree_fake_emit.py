"""A deliberately tiny torch-dialect emitter for the IREE engine's own tests.

It covers a few pointwise ops and 2-D convolution, so that compile/cache/runtime/plan can
be tested without the real emitter (fusegraph/engines/iree/emit.py, tested by its own
suite). It follows the same boundary convention: each argument/result is the tensor's
dense memory-order buffer, permuted to logical order inside the function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import OpKind, PointwiseMode
from fusegraph.graph.tensor import TensorAttr


@dataclass(frozen=True)
class FakeEmitted:
    text: str
    func_name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]


_UNARY = {
    PointwiseMode.RELU_FWD: "torch.aten.relu",
    PointwiseMode.TANH_FWD: "torch.aten.tanh",
    PointwiseMode.SIGMOID_FWD: "torch.aten.sigmoid",
    PointwiseMode.EXP: "torch.aten.exp",
    PointwiseMode.NEG: "torch.aten.neg",
}
_ALPHA_BINARY = {PointwiseMode.ADD: "torch.aten.add.Tensor", PointwiseMode.SUB: "torch.aten.sub.Tensor"}
_BINARY = {PointwiseMode.MUL: "torch.aten.mul.Tensor", PointwiseMode.MAX: "torch.aten.maximum"}


def _ty(shape: Any, t: TensorAttr) -> str:
    return f"!torch.vtensor<[{','.join(str(int(d)) for d in shape)}],{t.dtype.mlir}>"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"%v{self.n}"

    def ints(self, values: Any) -> str:
        names = []
        for v in values:
            c = self.fresh()
            self.lines.append(f"  {c} = torch.constant.int {int(v)}")
            names.append(c)
        lst = self.fresh()
        types = ", ".join("!torch.int" for _ in names)
        self.lines.append(f"  {lst} = torch.prim.ListConstruct {', '.join(names)} : ({types}) -> !torch.list<int>")
        return lst

    def permute(self, value: str, src_shape: Any, perm: Any, t: TensorAttr) -> tuple[str, tuple[int, ...]]:
        perm = tuple(perm)
        if perm == tuple(range(len(perm))):
            return value, tuple(src_shape)
        out_shape = tuple(src_shape[p] for p in perm)
        lst = self.ints(perm)
        r = self.fresh()
        self.lines.append(
            f"  {r} = torch.aten.permute {value}, {lst} : {_ty(src_shape, t)}, !torch.list<int> -> {_ty(out_shape, t)}"
        )
        return r, out_shape


def fake_emit(graph: Graph, func_name: str = "main", options: Any = None) -> FakeEmitted:
    graph.ensure_valid()
    w = _Writer()
    env: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor name -> (ssa, logical shape with 1 for broadcast)
    args, ins, in_shapes = [], [], []
    for i, t in enumerate(graph.inputs()):
        phys = layout.physical_shape(t.shape, t.strides)
        order = layout.physical_order(t.shape, t.strides)
        args.append(f"%arg{i}: {_ty(phys, t)}")
        inverse = [order.index(a) for a in range(len(order))]
        env[t.name] = w.permute(f"%arg{i}", phys, inverse, t)
        ins.append(t.name)
        in_shapes.append(tuple(phys))
    for node in graph.topological_order():
        y = next(iter(node.outputs.values()))
        shape = tuple(y.shape)
        r = w.fresh()
        if node.kind == OpKind.POINTWISE:
            mode = node.attrs.mode  # type: ignore[union-attr]
            a = env[node.inputs["a"].name]
            if mode in _UNARY:
                w.lines.append(f"  {r} = {_UNARY[mode]} {a[0]} : {_ty(a[1], y)} -> {_ty(shape, y)}")
            elif mode in _ALPHA_BINARY or mode in _BINARY:
                b = env[node.inputs["b"].name]
                tb = node.inputs["b"]
                if mode in _ALPHA_BINARY:
                    one = w.fresh()
                    w.lines.append(f"  {one} = torch.constant.int 1")
                    w.lines.append(
                        f"  {r} = {_ALPHA_BINARY[mode]} {a[0]}, {b[0]}, {one} : {_ty(a[1], y)}, {_ty(b[1], tb)}, !torch.int -> {_ty(shape, y)}"
                    )
                else:
                    w.lines.append(f"  {r} = {_BINARY[mode]} {a[0]}, {b[0]} : {_ty(a[1], y)}, {_ty(b[1], tb)} -> {_ty(shape, y)}")
            else:
                raise NotImplementedError(f"fake emitter: pointwise {mode}")
        elif node.kind == OpKind.CONV_FPROP:
            x, wt = env[node.inputs["x"].name], env[node.inputs["w"].name]
            at = node.attrs
            none, false, one = w.fresh(), w.fresh(), w.fresh()
            w.lines += [f"  {none} = torch.constant.none", f"  {false} = torch.constant.bool false", f"  {one} = torch.constant.int 1"]
            st, pad, dil, opad = w.ints(at.stride), w.ints(at.pre_padding), w.ints(at.dilation), w.ints([0] * len(at.stride))  # type: ignore[union-attr]
            w.lines.append(
                f"  {r} = torch.aten.convolution {x[0]}, {wt[0]}, {none}, {st}, {pad}, {dil}, {false}, {opad}, {one} : "
                f"{_ty(x[1], y)}, {_ty(wt[1], node.inputs['w'])}, !torch.none, !torch.list<int>, !torch.list<int>, "
                f"!torch.list<int>, !torch.bool, !torch.list<int>, !torch.int -> {_ty(shape, y)}"
            )
        else:
            raise NotImplementedError(f"fake emitter: {node.kind}")
        env[y.name] = (r, shape)
    rets, outs, out_shapes = [], [], []
    for t in graph.outputs():
        order = layout.physical_order(t.shape, t.strides)
        v, phys = w.permute(env[t.name][0], env[t.name][1], order, t)
        rets.append((v, _ty(phys, t)))
        outs.append(t.name)
        out_shapes.append(tuple(phys))
    text = (
        f"func.func @{func_name}({', '.join(args)}) -> ({', '.join(ty for _, ty in rets)}) {{\n"
        + "\n".join(w.lines)
        + f"\n  return {', '.join(v for v, _ in rets)} : {', '.join(ty for _, ty in rets)}\n}}\n"
    )
    return FakeEmitted(text, func_name, tuple(ins), tuple(outs), tuple(in_shapes), tuple(out_shapes))


fake_emit.version = "fake-1"  # type: ignore[attr-defined]

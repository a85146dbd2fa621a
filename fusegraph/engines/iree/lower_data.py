"""Data movement. A transpose emits nothing (the value just records its new axis order);
slices and concatenations work on whatever order the value is in; a reshape needs the
logical row-major order."""

from __future__ import annotations

from fusegraph.engines.iree.lower_base import Lowering, Val, identity
from fusegraph.engines.iree.lower_conv import slice_axis
from fusegraph.graph.node import Node
from fusegraph.graph.ops import ConcatAttrs, SliceAttrs, TransposeAttrs


def lower_reshape(ctx: Lowering, node: Node) -> None:
    xt, yt = node.inputs["x"], node.outputs["y"]
    x = ctx.get(xt, identity(len(xt.shape)), full=True)
    ctx.set(yt, ctx.reshape(x, yt.shape))


def lower_transpose(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, TransposeAttrs)
    x = ctx.get(node.inputs["x"])
    p = attrs.permutation
    # Value axis j holds x's logical axis x.perm[j], which is y's logical axis p.index(.).
    ctx.set(node.outputs["y"], Val(x.name, x.shape, x.dtype, tuple(p.index(a) for a in x.perm)))


def lower_concatenate(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, ConcatAttrs)
    yt = node.outputs["y"]
    ins = node.input_list()
    perm = ctx.get(ins[0]).perm if not ins[0].is_scalar else identity(len(yt.shape))
    parts = [ctx.cast(ctx.get(t, perm, full=True), yt.dtype) for t in ins]
    # A graph output is written out anyway: the concatenation reads the written copy
    # (FusionGuards.concatenates_an_output says why).
    parts = [ctx.fence(p) if ctx.concatenates_an_output(t) else p for t, p in zip(ins, parts, strict=True)]
    b = ctx.b
    lst = b.fresh("parts")
    b.line(
        f"{lst} = torch.prim.ListConstruct {', '.join(p.name for p in parts)} : "
        f"({', '.join(p.type for p in parts)}) -> !torch.list<vtensor>"
    )
    shape = tuple(yt.shape[a] for a in perm)
    y = b.aten("cat", [(lst, "!torch.list<vtensor>"), (b.const_int(perm.index(attrs.axis)), "!torch.int")], shape, yt.dtype, perm)
    ctx.set(yt, y)


def lower_slice(ctx: Lowering, node: Node) -> None:
    attrs = node.attrs
    assert isinstance(attrs, SliceAttrs)
    xt = node.inputs["x"]
    x = ctx.get(xt, full=True)
    for i, a in enumerate(x.perm):
        x = slice_axis(ctx, x, i, attrs.starts[a], attrs.ends[a], attrs.steps[a])
    ctx.set(node.outputs["y"], x)



"""Finding the torch engine's multi-node steps in a graph (the steps themselves, and why
they pay, are in ``steps``): chains of nodes whose intermediates nothing else reads, run as
one oneDNN convolution or linear with its epilogue on the CPU, a scale-shift, or a channel
shuffle.

Only f32 2-D convolutions are fused (f16/bf16 stay on the eager path, which computes them
in f32 on the CPU anyway); every intermediate the fusion swallows must be virtual and
read by the next node of the chain alone, so no value the graph exposes goes missing.
"""

from __future__ import annotations

import math

from fusegraph.dtypes import DataType
from fusegraph.engines.torch.steps import (
    ChannelShuffle,
    FusedConv,
    FusedLinear,
    ScaleShift,
    Step,
    TracedStep,
    Unary,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.graph.tensor import TensorAttr

M = PointwiseMode


def _f32(*ts: TensorAttr) -> bool:
    return all(t.dtype == DataType.FLOAT for t in ts)


def _compute_ok(node: Node, graph: Graph) -> bool:
    return _compute_in(node, graph, DataType.FLOAT)


def _compute_in(node: Node, graph: Graph, dt: DataType) -> bool:
    cd = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    return cd in (None, dt)


def _fusable_conv(node: Node, graph: Graph) -> bool:
    if node.kind != OpKind.CONV_FPROP or not _compute_ok(node, graph):
        return False
    x, w, y = node.inputs["x"], node.inputs["w"], node.outputs["y"]
    return len(x.shape) == 4 and _f32(x, w, y)


def _unary_of(node: Node) -> Unary | None:
    """The oneDNN eltwise equal to this pointwise node, if there is one."""
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    mode = attrs.mode
    if mode == M.RELU_FWD:
        lower, upper = attrs.param("relu_lower_clip"), attrs.param("relu_upper_clip")
        slope = attrs.param("relu_lower_clip_slope")
        if lower == 0.0 and math.isinf(upper) and upper > 0:
            return Unary("relu") if slope == 0.0 else Unary("leaky_relu", (slope,))
        if slope == 0.0 and not math.isinf(upper):
            return Unary("hardtanh", (lower, upper))
        return None
    simple = {M.SIGMOID_FWD: Unary("sigmoid"), M.TANH_FWD: Unary("tanh"),
              M.GELU_FWD: Unary("gelu", (), "none"), M.GELU_APPROX_TANH_FWD: Unary("gelu", (), "tanh")}
    if mode in simple:
        return simple[mode]
    if mode == M.SWISH_FWD and attrs.param("swish_beta") == 1.0:
        return Unary("swish")
    return None


def _is_plain_relu(node: Node) -> bool:
    return node.kind == OpKind.POINTWISE and _unary_of(node) == Unary("relu")


class _Walker:
    """Follows a value to its single consumer, when the fusion may swallow that value."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._readers: dict[int, list[Node]] | None = None
        self.claimed: set[int] = set()  # nodes already inside a fusion

    @property
    def readers(self) -> dict[int, list[Node]]:
        """Each value's readers, mapped on first use: a planner that finds no chain start
        (in most of the pieces a region build plans) never needs them."""
        if self._readers is None:
            readers: dict[int, list[Node]] = {}
            for n in self.graph.nodes:
                for t in n.inputs.values():
                    readers.setdefault(id(t), []).append(n)
            self._readers = readers
        return self._readers

    def next_any(self, t: TensorAttr) -> Node | None:
        """The one node reading ``t``, if ``t`` is a private intermediate (virtual, not an
        output) and that node is in no fusion yet."""
        if t.is_output or not t.is_virtual:
            return None
        readers = self.readers.get(id(t), [])
        if len(readers) != 1 or id(readers[0]) in self.claimed:
            return None
        return readers[0]

    def next(self, t: TensorAttr) -> Node | None:
        """The one pointwise node reading ``t`` (see ``next_any``)."""
        n = self.next_any(t)
        return n if n is not None and n.kind == OpKind.POINTWISE else None


def _f32_step(n: Node | None, graph: Graph) -> Node | None:
    """``n`` if it computes in f32 and produces f32 (what a fused f32 conv may swallow)."""
    if n is None or not _compute_ok(n, graph) or not _f32(*n.outputs.values()):
        return None
    return n


def _binary_other(node: Node, t: TensorAttr) -> TensorAttr | None:
    """For an ADD node reading ``t`` once, its other operand."""
    attrs = node.attrs
    assert isinstance(attrs, PointwiseAttrs)
    if attrs.mode != M.ADD:
        return None
    a, b = node.inputs["a"], node.inputs["b"]
    if a is t and b is not t:
        return b
    if b is t and a is not t:
        return a
    return None


def _per_channel(other: TensorAttr, y: TensorAttr) -> bool:
    """A bias broadcast along everything but the channel axis of a rank-4 NCHW-logical y."""
    if not _f32(other) or other.is_scalar:
        return False
    shape = tuple(other.shape)
    if len(shape) > 4:
        return False
    full = (1,) * (4 - len(shape)) + shape
    return full[0] == 1 and full[2] == 1 and full[3] == 1 and full[1] == y.shape[1]


def _smaller_operand(node: Node, t: TensorAttr, dtype: DataType) -> TensorAttr | None:
    """The other operand of a MUL/ADD reading ``t``, when it broadcasts into ``t``'s shape."""
    a, b = node.inputs["a"], node.inputs.get("b")
    if b is None or node.inputs.get("c") is not None:
        return None
    other = b if a is t else a if b is t else None
    if other is None or other is t or other.is_scalar or other.dtype != dtype:
        return None
    shape, full = tuple(other.shape), tuple(t.shape)
    if len(shape) > len(full):
        return None
    padded = (1,) * (len(full) - len(shape)) + shape
    return other if all(d in (1, f) for d, f in zip(padded, full, strict=True)) else None


def plan_scale_shifts(graph: Graph, walk: _Walker | None = None) -> dict[str, ScaleShift]:
    """mul -> add (-> ReLU) chains of one float type computed in it, keyed by last node."""
    out: dict[str, ScaleShift] = {}
    if not _has(graph, OpKind.POINTWISE):
        return out
    walk = walk or _Walker(graph)
    for mul in graph.topological_order():
        attrs = mul.attrs
        if id(mul) in walk.claimed or mul.kind != OpKind.POINTWISE or not isinstance(attrs, PointwiseAttrs):
            continue
        y = mul.outputs["y"]
        dt = y.dtype
        if attrs.mode != M.MUL or dt not in (DataType.FLOAT, DataType.DOUBLE) or not _compute_in(mul, graph, dt):
            continue
        full = [t for t in (mul.inputs["a"], mul.inputs.get("b")) if t is not None and tuple(t.shape) == tuple(y.shape)]
        x = full[0] if full and full[0].dtype == dt else None
        scale = _smaller_operand(mul, x, dt) if x is not None else None
        if x is None or scale is None:
            continue
        add = walk.next(y)
        if add is None or not isinstance(add.attrs, PointwiseAttrs) or add.attrs.mode != M.ADD:
            continue
        shift = _smaller_operand(add, y, dt)
        if shift is None or add.outputs["y"].dtype != dt or not _compute_in(add, graph, dt):
            continue
        nodes = [mul, add]
        cur = add.outputs["y"]
        r = walk.next(cur)
        relu = r is not None and _is_plain_relu(r) and r.outputs["y"].dtype == dt
        if relu and r is not None:
            nodes.append(r)
            cur = r.outputs["y"]
        walk.claimed.update(id(n) for n in nodes)
        ss = ScaleShift(tuple(nodes), x, scale, shift, relu, cur)
        out[ss.last.name] = ss
    return out


def plan_steps(graph: Graph, *, onednn: bool) -> dict[str, Step]:
    """Every multi-node step of a graph (oneDNN convolutions first), keyed by last node."""
    walk = _Walker(graph)
    steps: dict[str, Step] = {}
    if onednn:
        steps.update(plan_onednn_steps(graph, walk))
    steps.update(plan_scale_shifts(graph, walk))
    steps.update(plan_channel_shuffles(graph, walk))
    return steps


def plan_onednn_steps(graph: Graph, walk: _Walker | None = None) -> dict[str, FusedConv | FusedLinear]:
    """The fused convolutions and linears alone (what the oneDNN knobs change)."""
    walk = walk or _Walker(graph)
    steps: dict[str, FusedConv | FusedLinear] = {}
    steps.update(plan_fusions(graph, walk))
    steps.update(plan_linears(graph, walk))
    return steps



def plan_traced_steps(graph: Graph) -> dict[str, TracedStep]:
    """What a traced (oneDNN Graph) plan runs as one step: the fused convolutions and linears;
    channel shuffles (one layout-keeping aten op between partitions, not three); and
    scale-shifts of a value something else reads too, as aten ops outside the bridge's
    partitions -- fused there, mul -> add -> ReLU on a value that a concat also reads
    (DenseNet's pre-activation BN) gave wrong results (the fused op computed in place over
    its input, which the concat read after: relative error ~0.3)."""
    walk = _Walker(graph)
    steps: dict[str, TracedStep] = {}
    steps.update(plan_onednn_steps(graph, walk))
    # The other scale-shifts are claimed too but traced node by node, for the bridge to fuse.
    shifts = plan_scale_shifts(graph, walk)
    steps.update({name: ss for name, ss in shifts.items() if len(walk.readers[id(ss.x)]) > 1})
    steps.update(plan_channel_shuffles(graph, walk))
    return steps


def plan_channel_shuffles(graph: Graph, walk: _Walker | None = None) -> dict[str, ChannelShuffle]:
    """reshape -> transpose(0, 2, 1, ...) -> reshape chains that are channel shuffles."""
    out: dict[str, ChannelShuffle] = {}
    if not _has(graph, OpKind.RESHAPE):
        return out
    walk = walk or _Walker(graph)
    for r1 in graph.topological_order():
        if r1.kind != OpKind.RESHAPE or id(r1) in walk.claimed:
            continue
        x, s5 = r1.inputs["x"], r1.outputs["y"]
        if len(x.shape) != 4 or len(s5.shape) != 5:
            continue
        n, c, h, w = x.shape
        g = s5.shape[1]
        if tuple(s5.shape) != (n, g, c // g, h, w) or g * (c // g) != c or g < 2:
            continue
        tr = walk.next_any(s5)
        if tr is None or tr.kind != OpKind.TRANSPOSE:
            continue
        perm = getattr(tr.attrs, "permutation", None)
        if tuple(perm or ()) != (0, 2, 1, 3, 4):
            continue
        r2 = walk.next_any(tr.outputs["y"])
        if r2 is None or r2.kind != OpKind.RESHAPE or tuple(r2.outputs["y"].shape) != tuple(x.shape):
            continue
        if r2.outputs["y"].dtype != x.dtype:
            continue
        nodes = (r1, tr, r2)
        walk.claimed.update(id(k) for k in nodes)
        cs = ChannelShuffle(nodes, x, g, r2.outputs["y"])
        out[cs.last.name] = cs
    return out


def has_onednn_steps(graph: Graph) -> bool:
    """Whether the ``onednn`` knob changes anything for this graph: whether a chain starts
    anywhere, without planning the chains (each fusable conv or matmul starts one, and a
    chain swallows neither)."""
    return has_fused_convs(graph) or any(_fusable_linear(n, graph) for n in graph.nodes)


def has_fused_convs(graph: Graph) -> bool:
    """Whether ``plan_fusions`` finds any convolution (each fusable one is a step, alone or not)."""
    return any(_fusable_conv(n, graph) for n in graph.nodes)


def _has(graph: Graph, kind: OpKind) -> bool:
    """Whether a node of ``kind`` is in the graph: a planner with nothing to start a chain
    from skips the walk (most pieces a region build plans hold one node or a few)."""
    return any(n.kind == kind for n in graph.nodes)


def plan_linears(graph: Graph, walk: _Walker | None = None) -> dict[str, FusedLinear]:
    """f32 2-D matmuls with their bias and activation, keyed by last node."""
    out: dict[str, FusedLinear] = {}
    if not _has(graph, OpKind.MATMUL):
        return out
    walk = walk or _Walker(graph)
    for mm in graph.topological_order():
        if id(mm) in walk.claimed or not _fusable_linear(mm, graph):
            continue
        c = mm.outputs["c"]
        nodes, cur = [mm], c
        bias: TensorAttr | None = None
        unary: Unary | None = None
        n = _f32_step(walk.next(cur), graph)
        if n is not None:
            other = _binary_other(n, cur)
            if other is not None and _f32(other) and not other.is_scalar and _row_vector(other, cur):
                bias, cur = other, n.outputs["y"]
                nodes.append(n)
                n = _f32_step(walk.next(cur), graph)
        if n is not None and n.inputs.get("b") is None:
            unary = _unary_of(n)
            if unary is not None:
                cur = n.outputs["y"]
                nodes.append(n)
        walk.claimed.update(id(x) for x in nodes)
        fl = FusedLinear(mm, tuple(nodes), bias, unary, cur)
        out[fl.last.name] = fl
    return out


def _fusable_linear(node: Node, graph: Graph) -> bool:
    if node.kind != OpKind.MATMUL or not _compute_ok(node, graph):
        return False
    a, b, c = node.inputs["a"], node.inputs["b"], node.outputs["c"]
    return len(a.shape) == 2 and len(b.shape) == 2 and _f32(a, b, c)


def _row_vector(other: TensorAttr, y: TensorAttr) -> bool:
    """A bias broadcast along the rows of a [M, N] result: [N] or [1, N]."""
    shape = tuple(other.shape)
    return shape in ((y.shape[1],), (1, y.shape[1]))


def plan_fusions(graph: Graph, walk: _Walker | None = None) -> dict[str, FusedConv]:
    """The fused convolutions of a graph, keyed by the name of the last node each replaces."""
    out: dict[str, FusedConv] = {}
    if not _has(graph, OpKind.CONV_FPROP):
        return out
    walk = walk or _Walker(graph)
    for conv in graph.topological_order():
        if not _fusable_conv(conv, graph):
            continue
        nodes = [conv]
        cur = conv.outputs["y"]
        bias: TensorAttr | None = None
        unary: Unary | None = None
        residual: TensorAttr | None = None
        post_relu = False
        n = _f32_step(walk.next(cur), graph)
        if n is not None:
            other = _binary_other(n, cur)
            if other is not None and _per_channel(other, cur):
                bias, cur = other, n.outputs["y"]
                nodes.append(n)
                n = _f32_step(walk.next(cur), graph)
        if n is not None:
            u = _unary_of(n) if n.inputs.get("b") is None else None
            if u is not None:
                unary, cur = u, n.outputs["y"]
                nodes.append(n)
            else:
                other = _binary_other(n, cur)
                if other is not None and _f32(other) and tuple(other.shape) == tuple(cur.shape):
                    residual, cur = other, n.outputs["y"]
                    nodes.append(n)
                    r = _f32_step(walk.next(cur), graph)
                    if r is not None and _is_plain_relu(r):
                        post_relu, cur = True, r.outputs["y"]
                        nodes.append(r)
        # A lone conv too: it still gets its filter prepacked.
        walk.claimed.update(id(n) for n in nodes)
        fc = FusedConv(conv, tuple(nodes), bias, unary, residual, post_relu, cur)
        out[fc.last.name] = fc
    return out


__all__ = [
    "has_fused_convs",
    "has_onednn_steps",
    "plan_channel_shuffles",
    "plan_fusions",
    "plan_linears",
    "plan_onednn_steps",
    "plan_scale_shifts",
    "plan_steps",
    "plan_traced_steps",
]

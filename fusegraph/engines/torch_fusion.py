"""The torch engine's multi-node steps: oneDNN fused convolutions and linears on the CPU;
scale-shift chains (the inference form of a BatchNorm that follows no conv) and channel
shuffles anywhere.

A convolution with its epilogue -- per-channel bias, an activation, or a residual add
followed by ReLU -- becomes one oneDNN call (``torch.ops.mkldnn._convolution_pointwise``,
the op Inductor's CPU freezing path emits), and a filter the plan is told is constant
(``ExecutionPlan.bind_constants``) is reordered once into oneDNN's blocked layout instead
of on every call.

Why: eager PyTorch runs the conv, the bias add and the ReLU as three passes over memory
and reorders each filter per call. Hand-built ResNet-50 in an ad-hoc script (not in benchmarks/), batch 1, f32, 2 cores: eager
34.6 ms, fused epilogues 33.0 ms, fused + prepacked filters 22.5 ms (ONNX Runtime on the
same model 24.3 ms, measured side by side).

A scale-shift ``x * s + b`` with per-channel ``s``, ``b`` (what the importer makes of a
BatchNormalization after a concat, as in DenseNet), and a ReLU after it, is one
``torch.addcmul`` plus an in-place ReLU: one new tensor instead of three, two passes
instead of three (26 vs 49 us on a 96x56x56 NHWC tensor).

Only f32 2-D convolutions are fused (f16/bf16 stay on the eager path, which computes them
in f32 on the CPU anyway); every intermediate the fusion swallows must be virtual and
read by the next node of the chain alone, so no value the graph exposes goes missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.infer import conv_groups
from fusegraph.graph.node import Node
from fusegraph.graph.ops import ConvAttrs, OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.graph.tensor import TensorAttr

Tensor = Any
M = PointwiseMode


def _torch() -> Any:
    import torch

    return torch


@dataclass(frozen=True)
class Unary:
    """A oneDNN eltwise post-op: its name, scalars and algorithm, as the mkldnn ops take them."""

    attr: str
    scalars: tuple[float, ...] = ()
    algorithm: str = ""

    def aten(self, y: Tensor) -> Tensor:
        """The same activation as plain torch ops (for a trace that oneDNN Graph reads)."""
        torch = _torch()
        F = torch.nn.functional
        if self.attr == "relu":
            return torch.relu(y)
        if self.attr == "leaky_relu":
            return F.leaky_relu(y, self.scalars[0])
        if self.attr == "hardtanh":
            return torch.clamp(y, self.scalars[0], self.scalars[1])
        if self.attr == "sigmoid":
            return torch.sigmoid(y)
        if self.attr == "tanh":
            return torch.tanh(y)
        if self.attr == "gelu":
            return F.gelu(y, approximate="tanh" if self.algorithm == "tanh" else "none")
        if self.attr == "swish":
            return F.silu(y)
        assert self.attr == "none", self.attr
        return y


class _Chain:
    """A step replacing a chain of graph nodes; keyed by (and run in place of) the last one."""

    nodes: tuple[Node, ...]

    @property
    def last(self) -> Node:
        return self.nodes[-1]


@dataclass(frozen=True)
class FusedConv(_Chain):
    """conv -> [+ bias] -> [activation | + residual -> [ReLU]] as one oneDNN call (a lone
    conv included: its filter is prepacked all the same)."""

    conv: Node
    nodes: tuple[Node, ...]  # the graph nodes it replaces, conv first
    bias: TensorAttr | None
    unary: Unary | None  # activation (no residual)
    residual: TensorAttr | None
    post_relu: bool  # ReLU after the residual add
    out: TensorAttr

    def thunk(self, memory_format: str = "auto") -> Callable[[dict[str, Tensor]], None]:
        """The step with its arguments settled once: the per-call Python is a few lookups
        and layout checks (the filter may be oneDNN-packed, dense, or any declared layout)."""
        torch = _torch()
        ops = torch.ops.mkldnn
        unary_op, binary_op = ops._convolution_pointwise, ops._convolution_pointwise.binary
        conv = self.conv
        xn, wn, on = conv.inputs["x"].name, conv.inputs["w"].name, self.out.name
        bn = self.bias.name if self.bias is not None else None
        rn = self.residual.name if self.residual is not None else None
        pre_pad, pad = conv_padding(conv)
        _, stride, dilation, groups = conv_args(conv)
        u = self.unary or Unary("none")
        ua, us, ualg = u.attr, list(u.scalars), u.algorithm
        post = "relu" if self.post_relu else None
        cl = torch.channels_last
        F = torch.nn.functional

        def dense(t: Tensor) -> Tensor:
            if memory_format == "channels_last":
                return t.contiguous(memory_format=cl)
            if memory_format == "contiguous" or not (t.is_contiguous(memory_format=cl) or t.is_contiguous()):
                return t.contiguous()
            return t

        def step(env: dict[str, Tensor]) -> None:
            x = dense(env[xn])
            if pre_pad is not None:
                x = F.pad(x, pre_pad)
            w = env[wn]
            if not w.is_mkldnn:
                w = dense(w)
            b = env[bn].reshape(-1).contiguous() if bn is not None else None
            if rn is None:
                env[on] = unary_op(x, w, b, pad, stride, dilation, groups, ua, us, ualg)
                return
            # oneDNN's binary post-op reads `other` in the output's (= x's) memory format.
            fmt = cl if x.is_contiguous(memory_format=cl) and not x.is_contiguous() else torch.contiguous_format
            env[on] = binary_op(x, env[rn].contiguous(memory_format=fmt), w, b, pad, stride, dilation, groups,
                                "add", 1.0, post, [], "")

        return step

    def describe(self) -> str:
        parts = ["conv"]
        if self.bias is not None:
            parts.append("bias")
        if self.unary is not None:
            parts.append(self.unary.attr)
        if self.residual is not None:
            parts.append("add")
        if self.post_relu:
            parts.append("relu")
        return "+".join(parts)


class _RunStep(_Chain):
    """``thunk`` for a step whose ``run`` has nothing worth settling ahead of the call."""

    out: TensorAttr

    def run(self, env: Mapping[str, Tensor], memory_format: str = "auto") -> Tensor:
        raise NotImplementedError

    def thunk(self, memory_format: str = "auto") -> Callable[[dict[str, Tensor]], None]:
        name, run = self.out.name, self.run

        def step(env: dict[str, Tensor]) -> None:
            env[name] = run(env, memory_format)

        return step


@dataclass(frozen=True)
class ScaleShift(_RunStep):
    """mul(x, scale) -> add(., shift) -> [ReLU], as addcmul (+ relu_)."""

    nodes: tuple[Node, ...]
    x: TensorAttr
    scale: TensorAttr
    shift: TensorAttr
    relu: bool
    out: TensorAttr

    def describe(self) -> str:
        return "scale+shift+relu" if self.relu else "scale+shift"

    def run(self, env: Mapping[str, Tensor], memory_format: str = "auto") -> Tensor:
        torch = _torch()
        y = torch.addcmul(env[self.shift.name], env[self.x.name], env[self.scale.name])
        return torch.relu_(y) if self.relu else y


@dataclass(frozen=True)
class FusedLinear(_RunStep):
    """matmul(a [M, K], b [K, N]) -> [+ bias over N] -> [activation] as one oneDNN linear,
    which reads b as [N, K] rows: free when b is stored column-major (the ONNX importer
    packs constant B so for this engine), a per-call copy otherwise."""

    matmul: Node
    nodes: tuple[Node, ...]
    bias: TensorAttr | None
    unary: Unary | None
    out: TensorAttr

    def describe(self) -> str:
        return "+".join(["linear", *(["bias"] if self.bias is not None else []), *([self.unary.attr] if self.unary else [])])

    def run(self, env: Mapping[str, Tensor], memory_format: str = "auto") -> Tensor:
        torch = _torch()
        a = env[self.matmul.inputs["a"].name]
        w = env[self.matmul.inputs["b"].name].t()
        if not a.is_contiguous():
            a = a.contiguous()
        if not w.is_contiguous():
            w = w.contiguous()
        b = env[self.bias.name].reshape(-1) if self.bias is not None else None
        u = self.unary or Unary("none")
        return torch.ops.mkldnn._linear_pointwise(a, w, b, u.attr, list(u.scalars), u.algorithm)


@dataclass(frozen=True)
class ChannelShuffle(_RunStep):
    """reshape [N, C, H, W] -> [N, g, C/g, H, W], swap axes 1 and 2, reshape back: ShuffleNet's
    channel shuffle, as ``torch.channel_shuffle`` (a vectorized channels-last kernel, 3-4x
    faster than the strided copy the three ops make)."""

    nodes: tuple[Node, ...]
    x: TensorAttr
    groups: int
    out: TensorAttr

    def describe(self) -> str:
        return f"channel_shuffle(g={self.groups})"

    def run(self, env: Mapping[str, Tensor], memory_format: str = "auto") -> Tensor:
        torch = _torch()
        y = torch.channel_shuffle(env[self.x.name], self.groups)  # in x's memory format
        if layout.same_strides(self.out.shape, y.stride(), self.out.strides):
            return y
        out = torch.empty_strided(self.out.shape, self.out.strides, dtype=y.dtype, device=y.device)
        return out.copy_(y)  # the declared layout, as the reshape would have made it


Step = FusedConv | ScaleShift | FusedLinear | ChannelShuffle


def as_declared(y: Tensor, t: TensorAttr) -> Tensor:
    """``y`` in ``t``'s declared layout when that is a torch memory format (row-major,
    channels-last), without writing into a view: the functional form, for traced plans. A
    traced op that loses the layout (a reshape's copy is row-major) would otherwise run the
    rest of a channels-last partition on NCHW, paying two reorders per oneDNN partition."""
    torch = _torch()
    if layout.same_strides(t.shape, y.stride(), t.strides):
        return y
    channels_last = {4: ("NHWC", torch.channels_last), 5: ("NDHWC", torch.channels_last_3d)}.get(len(t.shape))
    for name, fmt in (*((channels_last,) if channels_last else ()), ("row_major", torch.contiguous_format)):
        if layout.same_strides(t.shape, layout.strides_for(t.shape, name), t.strides):
            return y.contiguous(memory_format=fmt)
    return y  # a layout torch has no memory format for: values are right, strides as they come


def available() -> bool:
    """Whether this torch has the mkldnn fused-convolution ops (CPU builds with oneDNN)."""
    try:
        torch = _torch()
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
    except Exception:
        return False


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
        self.readers: dict[int, list[Node]] = {}
        for n in graph.nodes:
            for t in n.inputs.values():
                self.readers.setdefault(id(t), []).append(n)
        self.claimed: set[int] = set()  # nodes already inside a fusion

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
    walk = walk or _Walker(graph)
    out: dict[str, ScaleShift] = {}
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


TracedStep = FusedConv | FusedLinear | ChannelShuffle | ScaleShift


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
    walk = walk or _Walker(graph)
    out: dict[str, ChannelShuffle] = {}
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
    """Whether the ``onednn`` knob changes anything for this graph."""
    return bool(plan_onednn_steps(graph))


def plan_linears(graph: Graph, walk: _Walker | None = None) -> dict[str, FusedLinear]:
    """f32 2-D matmuls with their bias and activation, keyed by last node."""
    walk = walk or _Walker(graph)
    out: dict[str, FusedLinear] = {}
    for mm in graph.topological_order():
        if mm.kind != OpKind.MATMUL or id(mm) in walk.claimed or not _compute_ok(mm, graph):
            continue
        a, b, c = mm.inputs["a"], mm.inputs["b"], mm.outputs["c"]
        if len(a.shape) != 2 or len(b.shape) != 2 or not _f32(a, b, c):
            continue
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


def _row_vector(other: TensorAttr, y: TensorAttr) -> bool:
    """A bias broadcast along the rows of a [M, N] result: [N] or [1, N]."""
    shape = tuple(other.shape)
    return shape in ((y.shape[1],), (1, y.shape[1]))


def plan_fusions(graph: Graph, walk: _Walker | None = None) -> dict[str, FusedConv]:
    """The fused convolutions of a graph, keyed by the name of the last node each replaces."""
    walk = walk or _Walker(graph)
    out: dict[str, FusedConv] = {}
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


def conv_args(conv: Node) -> tuple[list[int], list[int], list[int], int]:
    attrs = conv.attrs
    assert isinstance(attrs, ConvAttrs)
    return list(attrs.pre_padding), list(attrs.stride), list(attrs.dilation), conv_groups(conv)


def conv_padding(conv: Node) -> tuple[list[int] | None, list[int]]:
    """(F.pad's list, the conv call's padding): oneDNN and F.conv2d take symmetric padding,
    so asymmetric padding is applied to the input first (F.pad's list, else None)."""
    attrs = conv.attrs
    assert isinstance(attrs, ConvAttrs)
    if attrs.pre_padding == attrs.post_padding:
        return None, list(attrs.pre_padding)
    pads: list[int] = []
    for a, b in zip(reversed(attrs.pre_padding), reversed(attrs.post_padding), strict=True):
        pads += [a, b]
    return pads, [0] * len(attrs.pre_padding)


def pack_filter(conv: Node, w: Tensor) -> Tensor:
    """The filter reordered into oneDNN's blocked layout for this conv's input shape."""
    torch = _torch()
    attrs = conv.attrs
    assert isinstance(attrs, ConvAttrs)
    pre_pad, pad = conv_padding(conv)
    shape = list(conv.inputs["x"].shape)
    if pre_pad is not None:  # the call sees the padded input
        for i, (a, b) in enumerate(zip(attrs.pre_padding, attrs.post_padding, strict=True)):
            shape[2 + i] += a + b
    _, stride, dilation, groups = conv_args(conv)
    return torch._C._nn.mkldnn_reorder_conv2d_weight(w.contiguous().to_mkldnn(), pad, stride, dilation, groups, shape)


__all__ = [
    "ChannelShuffle",
    "FusedConv",
    "FusedLinear",
    "ScaleShift",
    "Step",
    "TracedStep",
    "Unary",
    "as_declared",
    "available",
    "conv_args",
    "conv_padding",
    "has_onednn_steps",
    "pack_filter",
    "plan_channel_shuffles",
    "plan_fusions",
    "plan_linears",
    "plan_onednn_steps",
    "plan_scale_shifts",
    "plan_steps",
    "plan_traced_steps",
]

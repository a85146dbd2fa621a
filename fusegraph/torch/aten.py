"""ATen FX graphs (what AOTAutograd hands a ``torch.compile`` backend, forward and
backward) into one fusegraph Graph: each ATen node fusegraph's op table can express
becomes one or more graph nodes (an *atom*: the region layer keeps them together); every
other node stays outside, its results graph inputs, and what it reads is recorded as
opaque dependencies so no region closes a cycle through it.

Shapes, strides and dtypes come from the nodes' ``meta["val"]`` (fake tensors); a
symbolic size takes its hint (the region runner re-converts for every size it meets).
One converter per ATen overload, in ``CONVERTERS``; a node without one is reported as
"no converter for aten.X".
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fusegraph.errors import FusegraphError
from fusegraph.graph.graph import Graph
from fusegraph.graph.infer import INFER
from fusegraph.graph.ops import NormFwdPhase, PointwiseMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.plans import data_type

aten = torch.ops.aten
Key = tuple[str, int | None]  # an FX value: (node name, tuple index or None)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Refused(Exception):
    """This ATen node is not converted (the message says why)."""


def hint(v: Any) -> int:
    """An int, or a symbolic size's hint (the size of the example it was traced with)."""
    return _int(v)


def _int(v: Any) -> int:
    if isinstance(v, int):
        return v
    hint = getattr(getattr(v, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    return int(v)


def _args(n: torch.fx.Node) -> Any:
    """A node's arguments, untyped (FX types them as any argument at all)."""
    return n.args


def meta(node: Any) -> Any:
    """The fake tensor (or tuple of them) an FX node's value has."""
    if not isinstance(node, torch.fx.Node):
        raise Refused(f"expected a tensor, got {type(node).__name__}")
    val = node.meta.get("val")
    if val is None:
        raise Refused(f"node '{node.name}' has no meta value")
    return val


def _shape(v: Any) -> list[int]:
    return [_int(s) for s in v.shape]


def _stride(v: Any) -> list[int]:
    return [_int(s) for s in v.stride()]


@dataclass(frozen=True)
class Zeros:
    """A result no computation needs but a signature returns (attention's RNG state without
    dropout, its debug mask): the runner hands back zeros of this shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


Result = TensorAttr | Zeros | None


@dataclass
class Converted:
    graph: Graph
    atoms: dict[str, str] = field(default_factory=dict)  # graph node -> FX node
    inputs: dict[str, Key] = field(default_factory=dict)  # graph input -> FX value
    values: dict[Key, str] = field(default_factory=dict)  # FX value -> graph tensor (converted nodes)
    refused: dict[str, str] = field(default_factory=dict)  # FX node -> why not converted
    opaque: dict[str, list[str]] = field(default_factory=dict)  # graph input -> graph tensors it depends on
    converted: list[str] = field(default_factory=list)  # FX nodes converted, in order
    constants: dict[Key, Zeros] = field(default_factory=dict)  # FX values the runner fills with zeros
    # FX node -> every FX node its graph nodes stand for (a matched pattern: the decomposed
    # RMSNorm's pow ... mul(weight) becomes one rmsnorm, its atoms named after the first node)
    members: dict[str, list[str]] = field(default_factory=dict)


class Ctx:
    """What a converter uses: the graph, operands, scalars, and the node being converted."""

    def __init__(self, out: Converted) -> None:
        self.out = out
        self.g = out.graph
        self._tensors: dict[Key, TensorAttr] = {}
        self._inputs: dict[Key, TensorAttr] = {}
        self.absorbed: list[str] = []  # later FX nodes the node being converted took in
        self.skip: set[str] = set()  # FX nodes an earlier pattern took in

    def absorb(self, node: torch.fx.Node, result: TensorAttr | None) -> None:
        """A later FX node is part of the pattern being converted: ``result`` (None where
        nothing outside the pattern reads it) is its value, and ``convert`` passes it by. An
        earlier node that nothing else reads may be taken in too (a zero pad a convolution
        folds): ``convert`` then withdraws its refusal."""
        if result is not None:
            self._tensors[(node.name, None)] = _typed(result, meta(node))
            self.out.values[(node.name, None)] = result.name
        self.absorbed.append(node.name)

    def value(self, arg: Any, dtypes: Any = None, kind: str = "a floating-point") -> TensorAttr:
        """The graph tensor of an FX value: computed in the graph, or a graph input (one per
        FX value, shared by its readers) of one of ``dtypes`` (default: the float types)."""
        if not isinstance(arg, torch.fx.Node):
            raise Refused(f"expected a tensor operand, got {arg!r}")
        key: Key = (arg.name, None)
        if arg.op == "call_function" and arg.target is operator.getitem:
            src, idx = _args(arg)
            assert isinstance(src, torch.fx.Node)
            key = (src.name, int(idx))
        t = self._tensors.get(key)
        if t is not None:
            return t
        t = self._inputs.get(key)
        if t is None:
            v = meta(arg)
            if not isinstance(v, torch.Tensor) or v.dtype not in (dtypes or _FLOATS):
                raise Refused(f"operand '{arg.name}' is not {kind} tensor")
            if v.dim() == 0:  # it would fail the whole graph's validation, not only this node
                raise Refused(f"operand '{arg.name}' is a 0-dim tensor (a graph tensor has at least one dim)")
            name = f"{key[0]}" if key[1] is None else f"{key[0]}.{key[1]}"
            t = self.g.tensor(f"in:{name}", _shape(v), _stride(v), data_type(v.dtype))
            self._inputs[key] = t
            self.out.inputs[t.name] = key
        return t

    def forget(self, name: str) -> None:
        self._tensors.pop((name, None), None)
        self.out.values.pop((name, None), None)

    def scalar(self, v: Any, like: TensorAttr) -> TensorAttr:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise Refused(f"scalar operand {v!r} is not a number")
        return self.g.scalar(float(v), like.dtype)

    def done(self, node: torch.fx.Node, result: TensorAttr | Sequence[Result]) -> None:
        """Records the node's results, each set to the dtype its meta value has."""
        v = meta(node)
        if isinstance(result, TensorAttr):
            self._tensors[(node.name, None)] = _typed(result, v)
            self.out.values[(node.name, None)] = result.name
            return
        for i, r in enumerate(result):
            if isinstance(r, Zeros):
                self.out.constants[(node.name, i)] = r
            elif r is not None:
                self._tensors[(node.name, i)] = _typed(r, v[i])
                self.out.values[(node.name, i)] = r.name


def _typed(t: TensorAttr, v: Any) -> TensorAttr:
    dt = data_type(v.dtype)
    if t.data_type != dt or not t.dtype_set:
        t.set_data_type(dt)
    return t


Converter = Callable[[Ctx, torch.fx.Node], TensorAttr | Sequence[Result]]
CONVERTERS: dict[Any, Converter] = {}


def converts(*ops: Any) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for op in ops:
            CONVERTERS[op] = fn
        return fn

    return deco


def _reshape(c: Ctx, t: TensorAttr, shape: Sequence[int]) -> TensorAttr:
    return t if list(t.dim) == list(shape) else c.g.reshape(t, list(shape))


# ---- convolution -----------------------------------------------------------------------------------
def _window(n: torch.fx.Node, x: Any, **params: Sequence[Any]) -> dict[str, Any]:
    """A convolution's stride, padding and dilation, one entry per spatial axis. ATen takes a
    single entry for all of them, as ``padding="valid"`` traces (``[0]``), and expands it."""
    rank = len(_shape(meta(x))) - 2
    out: dict[str, list[int]] = {}
    for name, values in params.items():
        entries = [_int(v) for v in values]
        if len(entries) == 1:
            entries *= rank
        if len(entries) != rank:
            raise Refused(f"{n.name}: {name} {entries} has neither 1 nor {rank} entries (one per spatial axis)")
        out[name] = entries
    return out


@converts(aten.convolution.default)
def _conv(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    from fusegraph.torch.aten_pad import folded

    x, w, b, stride, padding, dilation, transposed, _, _groups = _args(n)
    if transposed:
        raise Refused("transposed convolution")
    win = _window(n, x, stride=stride, padding=padding, dilation=dilation)
    fold = folded(x)  # a zero pad before it (TF-style "same" padding): its own padding, per side
    if fold is not None:
        if len(x.users) == 1:  # read by nothing else: the pad is part of this node
            c.absorb(x, None)
        x, pre, post = fold
        pad = win.pop("padding")
        win["pre_padding"] = [p + q for p, q in zip(pad, pre, strict=True)]
        win["post_padding"] = [p + q for p, q in zip(pad, post, strict=True)]
    y = c.g.conv_fprop(c.value(x), c.value(w), **win)
    if b is not None:
        k = _shape(meta(w))[0]
        y = c.g.add(y, _reshape(c, c.value(b), [1, k] + [1] * (len(_shape(meta(x))) - 2)))
    return y


@converts(aten.convolution_backward.default)
def _conv_bwd(c: Ctx, n: torch.fx.Node) -> list[TensorAttr | None]:
    dy, x, w, _bias_sizes, stride, padding, dilation, transposed, _, _groups, mask = _args(n)
    if transposed:
        raise Refused("transposed convolution")
    kw = _window(n, x, stride=stride, padding=padding, dilation=dilation)
    g, d = c.g, c.value(dy)
    out: list[TensorAttr | None] = [None, None, None]
    if mask[0]:
        out[0] = g.conv_dgrad(d, c.value(w), **kw).set_dim(_shape(meta(x)))
    if mask[1]:
        out[1] = g.conv_wgrad(c.value(x), d, **kw).set_dim(_shape(meta(w)))
    if mask[2]:
        k = _shape(meta(dy))[1]
        red = g.reduction(d, ReductionMode.SUM, [1, k] + [1] * (len(_shape(meta(dy))) - 2))
        out[2] = _reshape(c, red, [k])
    return out


# ---- matmul ------------------------------------------------------------------------------------------------
@converts(aten.mm.default, aten.bmm.default)
def _mm(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    return c.g.matmul(c.value(_args(n)[0]), c.value(_args(n)[1]))


@converts(aten.addmm.default)
def _addmm(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    bias, a, b = _args(n)[:3]
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        raise Refused("addmm with beta or alpha other than 1")
    return c.g.add(c.g.matmul(c.value(a), c.value(b)), c.value(bias))


# ---- norms ---------------------------------------------------------------------------------------------------
def _rows(shape: Sequence[int], normalized: Sequence[Any]) -> tuple[int, int]:
    f = math.prod(_int(s) for s in normalized)
    return math.prod(shape) // f, f


@converts(aten.native_layer_norm.default)
def _layernorm(c: Ctx, n: torch.fx.Node) -> list[TensorAttr | None]:
    x, normalized, w, b, eps = _args(n)
    if w is None or b is None:
        raise Refused("layer norm without weight or bias")
    v = meta(n)
    shape = _shape(meta(x))
    rows, f = _rows(shape, normalized)
    g = c.g
    y, mean, inv = g.layernorm(_reshape(c, c.value(x), [rows, f]), _reshape(c, c.value(w), [1, f]),
                               _reshape(c, c.value(b), [1, f]), float(eps), NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    return [_reshape(c, y, shape), _reshape(c, mean, _shape(v[1])), _reshape(c, inv, _shape(v[2]))]


@converts(aten.native_layer_norm_backward.default)
def _layernorm_bwd(c: Ctx, n: torch.fx.Node) -> list[TensorAttr | None]:
    dy, x, normalized, mean, rstd, w, b, mask = _args(n)
    if w is None or b is None:
        raise Refused("layer norm without weight or bias")
    shape = _shape(meta(x))
    rows, f = _rows(shape, normalized)
    dx, dw, db = c.g.layernorm_backward(
        _reshape(c, c.value(dy), [rows, f]), _reshape(c, c.value(x), [rows, f]), _reshape(c, c.value(w), [1, f]),
        _reshape(c, c.value(mean), [rows, 1]), _reshape(c, c.value(rstd), [rows, 1]))
    wshape = _shape(meta(w))
    return [_reshape(c, dx, shape) if mask[0] else None,
            _reshape(c, dw, wshape) if mask[1] else None,
            _reshape(c, db, wshape) if mask[2] else None]


# ---- pointwise ------------------------------------------------------------------------------------------------
def _binary(mode: PointwiseMode) -> Converter:
    def conv(c: Ctx, n: torch.fx.Node) -> TensorAttr:
        a, b = _args(n)[:2]
        if n.kwargs.get("alpha", 1) != 1:
            raise Refused("add/sub with alpha")
        if isinstance(a, torch.fx.Node):
            ta = c.value(a)
            tb = c.value(b) if isinstance(b, torch.fx.Node) else c.scalar(b, ta)
        else:
            tb = c.value(b)
            ta = c.scalar(a, tb)
        return c.g.pointwise(ta, tb, mode=mode)

    return conv


def _unary(mode: PointwiseMode) -> Converter:
    def conv(c: Ctx, n: torch.fx.Node) -> TensorAttr:
        return c.g.pointwise(c.value(_args(n)[0]), mode=mode)

    return conv


for _op, _mode in ((aten.add.Tensor, PointwiseMode.ADD), (aten.sub.Tensor, PointwiseMode.SUB),
                   (aten.mul.Tensor, PointwiseMode.MUL), (aten.div.Tensor, PointwiseMode.DIV),
                   (aten.add.Scalar, PointwiseMode.ADD), (aten.sub.Scalar, PointwiseMode.SUB),
                   (aten.mul.Scalar, PointwiseMode.MUL), (aten.div.Scalar, PointwiseMode.DIV),
                   (aten.maximum.default, PointwiseMode.MAX), (aten.minimum.default, PointwiseMode.MIN)):
    CONVERTERS[_op] = _binary(_mode)
for _op, _mode in ((aten.relu.default, PointwiseMode.RELU_FWD), (aten.sigmoid.default, PointwiseMode.SIGMOID_FWD),
                   (aten.tanh.default, PointwiseMode.TANH_FWD), (aten.neg.default, PointwiseMode.NEG),
                   (aten.exp.default, PointwiseMode.EXP), (aten.log.default, PointwiseMode.LOG),
                   (aten.sqrt.default, PointwiseMode.SQRT), (aten.rsqrt.default, PointwiseMode.RSQRT),
                   (aten.reciprocal.default, PointwiseMode.RECIPROCAL), (aten.abs.default, PointwiseMode.ABS),
                   (aten.erf.default, PointwiseMode.ERF), (aten.clone.default, PointwiseMode.IDENTITY)):
    CONVERTERS[_op] = _unary(_mode)
CONVERTERS[aten.silu.default] = _unary(PointwiseMode.SWISH_FWD)


@converts(aten.gelu.default)
def _gelu(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    tanh = n.kwargs.get("approximate", _args(n)[1] if len(_args(n)) > 1 else "none") == "tanh"
    mode = PointwiseMode.GELU_APPROX_TANH_FWD if tanh else PointwiseMode.GELU_FWD
    return c.g.pointwise(c.value(_args(n)[0]), mode=mode)


@converts(aten.gelu_backward.default)
def _gelu_bwd(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    tanh = n.kwargs.get("approximate", _args(n)[2] if len(_args(n)) > 2 else "none") == "tanh"
    mode = getattr(PointwiseMode, "GELU_APPROX_TANH_BWD", None) if tanh else PointwiseMode.GELU_BWD
    if mode is None:
        raise Refused("tanh-approximated GELU backward is not in the op table")
    return c.g.pointwise(c.value(_args(n)[0]), c.value(_args(n)[1]), mode=mode)


@converts(aten.threshold_backward.default)
def _relu_bwd(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    if _args(n)[2] != 0:
        raise Refused("threshold backward at a threshold other than 0")
    return c.g.pointwise(c.value(_args(n)[0]), c.value(_args(n)[1]), mode=PointwiseMode.RELU_BWD)


@converts(aten.silu_backward.default)
def _silu_bwd(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    mode = getattr(PointwiseMode, "SWISH_BWD", None)
    if mode is None:
        raise Refused("SiLU backward is not in the op table")
    return c.g.pointwise(c.value(_args(n)[0]), c.value(_args(n)[1]), mode=mode)


@converts(aten.sigmoid_backward.default, aten.tanh_backward.default)
def _from_output_bwd(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """PyTorch's sigmoid/tanh backward read the forward's output y: dy*y*(1-y), dy*(1-y*y)."""
    g = c.g
    dy, y = c.value(_args(n)[0]), c.value(_args(n)[1])
    one = c.scalar(1.0, y)
    if n.target is aten.sigmoid_backward.default:
        return g.mul(dy, g.mul(y, g.sub(one, y)))
    return g.mul(dy, g.sub(one, g.mul(y, y)))


@converts(aten.pow.Tensor_Scalar)
def _pow(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    x = c.value(_args(n)[0])
    return c.g.pow(x, c.scalar(_args(n)[1], x))


# ---- reductions, movement, casts ---------------------------------------------------------------------------
def _reduce(mode: ReductionMode) -> Converter:
    def conv(c: Ctx, n: torch.fx.Node) -> TensorAttr:
        x = _args(n)[0]
        dims = _args(n)[1] if len(_args(n)) > 1 else None
        keep = bool(_args(n)[2]) if len(_args(n)) > 2 else bool(n.kwargs.get("keepdim", False))
        if n.kwargs.get("dtype") is not None:
            raise Refused("reduction with a dtype")
        shape = _shape(meta(x))
        axes = range(len(shape)) if not dims else [int(d) % len(shape) for d in dims]
        reduced = [1 if i in axes else s for i, s in enumerate(shape)]
        y = c.g.reduction(c.value(x), mode, reduced)
        return y if keep else _reshape(c, y, _shape(meta(n)))

    return conv


CONVERTERS[aten.sum.dim_IntList] = _reduce(ReductionMode.SUM)
CONVERTERS[aten.mean.dim] = _reduce(ReductionMode.AVG)
CONVERTERS[aten.amax.default] = _reduce(ReductionMode.MAX)


@converts(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    if not meta(_args(n)[0]).is_contiguous():
        raise Refused("a view of a non-contiguous tensor")
    return _reshape(c, c.value(_args(n)[0]), _shape(meta(n)))


@converts(aten.t.default, aten.transpose.int, aten.permute.default)
def _transpose(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    rank = len(_shape(meta(_args(n)[0])))
    if n.target is aten.permute.default:
        perm = [int(p) % rank for p in _args(n)[1]]
    else:
        a, b = (0, 1) if n.target is aten.t.default else (int(_args(n)[1]) % rank, int(_args(n)[2]) % rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    return c.g.transpose(c.value(_args(n)[0]), perm)


@converts(aten.select.int)
def _select(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    x, dim, index = _args(n)
    shape = _shape(meta(x))
    d = int(dim) % len(shape)
    i = int(index) % shape[d]
    starts = [0] * len(shape)
    ends = list(shape)
    starts[d], ends[d] = i, i + 1
    return _reshape(c, c.g.slice(c.value(x), starts, ends, [1] * len(shape)), _shape(meta(n)))


@converts(aten._to_copy.default)
def _cast(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    v = meta(n)
    if v.dtype not in _FLOATS or set(n.kwargs) - {"dtype", "layout", "device"}:
        raise Refused("a copy that is not a floating-point cast")
    y = c.g.identity(c.value(_args(n)[0]))
    y.set_data_type(data_type(v.dtype))
    return y


# ---- the whole graph ----------------------------------------------------------------------------------------------
def convert(graph: torch.fx.Graph, name: str = "aten") -> Converted:
    """Every convertible node of ``graph`` into one fusegraph Graph (see the module docstring)."""
    out = Converted(Graph(name))
    ctx = Ctx(out)
    deps: dict[str, set[str]] = {}  # FX node -> graph tensors it reads through unconverted code
    for n in graph.nodes:
        if n.name in ctx.skip:
            continue
        if n.op != "call_function" or n.target is operator.getitem:
            if n.op == "call_function":  # getitem: the tuple's item (a graph tensor where converted)
                src, idx = _args(n)
                item = out.values.get((src.name, int(idx)))
                deps[n.name] = {item} if item is not None else deps.get(src.name, set())
            continue
        fn = CONVERTERS.get(n.target)
        before = len(out.graph.nodes)
        if fn is None:
            out.refused[n.name] = f"no converter for {_op_name(n)}"
        elif not _float_results(n):
            out.refused[n.name] = "results are not floating-point tensors"
        else:
            ctx.absorbed = []
            try:
                result = fn(ctx, n)
                _check_rules(out.graph.nodes[before:])
                _check_dims(n, result)
                ctx.done(n, result)
                for node in out.graph.nodes[before:]:
                    out.atoms[node.name] = n.name
                out.converted.append(n.name)
                if ctx.absorbed:
                    out.members[n.name] = [n.name, *ctx.absorbed]
                    out.converted += ctx.absorbed
                    ctx.skip.update(ctx.absorbed)
                    for name in ctx.absorbed:  # an earlier node taken in (a pad a convolution folds)
                        out.refused.pop(name, None)
                continue
            except (Refused, FusegraphError, NotImplementedError) as exc:
                out.refused[n.name] = str(exc) or type(exc).__name__
                del out.graph.nodes[before:]  # a half-converted node leaves nothing behind
                for name in ctx.absorbed:
                    ctx.forget(name)
        reads: set[str] = set()
        for a in n.all_input_nodes:
            reads |= deps.get(a.name, set())
            direct = out.values.get((a.name, None))
            if direct is not None:
                reads.add(direct)
        deps[n.name] = reads
    _prune(out)
    _mark_outputs(graph, out)
    for tname, key in out.inputs.items():
        out.opaque[tname] = sorted(deps.get(key[0], set()))
    return out


def _prune(out: Converted) -> None:
    """Tensors left by refused nodes are dropped; graph outputs are the converted values
    (each a graph output, so the region layer sees what leaves)."""
    g = out.graph
    used = {t.name for n in g.nodes for t in [*n.inputs.values(), *n.outputs.values()]}
    g.tensors[:] = [t for t in g.tensors if t.name in used]
    out.inputs = {k: v for k, v in out.inputs.items() if k in used}
    g._touch()


def _check_rules(nodes: Sequence[Any]) -> None:
    """Each graph node a converter added checked against its op's rules now (the inference
    validate() runs), so that a node built wrongly is refused alone: found by validate(), it
    refused the whole ATen graph (a held-out EfficientNet's backward lost every region to one
    convolution whose padding had one entry)."""
    for node in nodes:
        if all(t._dim is not None and t._data_type is not None for t in node.inputs.values()):
            # a broken rule raises ValidationError (the node is refused); what else is raised is
            # no rule of the op's: validate() says what it means, as Graph._try_infer leaves it
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                INFER[node.kind](node)


def _check_dims(n: torch.fx.Node, result: TensorAttr | Sequence[Result]) -> None:
    """Each result has the dims PyTorch's meta value has (shape inference ran as the nodes
    were added): a converter that got a shape wrong is caught here, not in validate()."""
    v = meta(n)
    pairs = [(result, v)] if isinstance(result, TensorAttr) else list(zip(result, v, strict=False))
    for t, m in pairs:
        if t is None or isinstance(t, Zeros):
            continue
        if not t.dim_set and t._dim is None:
            raise Refused("its result's dims could not be inferred")
        if not _shape(m):
            raise Refused("its result is a 0-dim tensor (a graph tensor has at least one dim)")
        if list(t.dim) != _shape(m):
            raise Refused(f"converted to dims {t.dim}, PyTorch has {_shape(m)}")


def _mark_outputs(graph: torch.fx.Graph, out: Converted) -> None:
    """A converted value read by an unconverted node (or returned) leaves the graph."""
    converted = set(out.converted)
    for n in graph.nodes:
        if n.name in converted or (n.op == "call_function" and n.target is operator.getitem
                                   and _args(n)[0].name in converted):
            continue
        for a in n.all_input_nodes:
            key: Key = (a.name, None)
            if a.op == "call_function" and a.target is operator.getitem:
                key = (a.args[0].name, int(a.args[1]))
            tname = out.values.get(key)
            if tname is not None:
                out.graph.tensor_by_name(tname).set_output(True)


# ops with results that are no floating-point tensor, which their converters handle
# (attention's sizes and RNG state; max pooling's indices, refused where they are read)
MIXED_RESULTS: set[Any] = set()  # filled by the converter modules (aten_attention.py, aten_norms.py)


def _float_results(n: torch.fx.Node) -> bool:
    if n.target in MIXED_RESULTS:
        return True
    v = n.meta.get("val")
    vals = v if isinstance(v, list | tuple) else [v]
    return all(x is None or (isinstance(x, torch.Tensor) and x.dtype in _FLOATS) for x in vals)


def _op_name(n: torch.fx.Node) -> str:
    t = n.target
    return str(getattr(t, "__name__", t)) if not hasattr(t, "_schema") else f"aten.{t._schema.name.split('::')[-1]}"


from fusegraph.torch import aten_attention, aten_clamp, aten_gather, aten_norms, aten_pad, aten_pool  # noqa: E402,F401  (register their converters in CONVERTERS)

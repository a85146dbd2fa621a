"""What a fusegraph Graph's cuDNN frontend graph will look like from outside, or why there
can be none: which fusegraph tensor gets which cuDNN uid, the rank every tensor is described
at, the constants passed by value, and the small per-channel precomputations (batchnorm
inference becomes a scale and shift). Pure Python (no cudnn, no torch), so CPU-only machines
and the plan loader can read a refusal's reason; lower.py builds the graph from a binding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusegraph.dtypes import DataType
from fusegraph.engines.cudnn.lower_backward import (
    NORM_BACKWARD_LOWERED,
    backward_refusal,
)
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    CONVOLUTIONS,
    DATA_MOVEMENT,
    INDEXING,
    NORMS,
    ConvAttrs,
    NormFwdPhase,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
    ReductionMode,
    SdpaAttrs,
)
from fusegraph.graph.tensor import TensorAttr

M = PointwiseMode

# fusegraph pointwise mode -> (cuDNN pygraph method, its tensor argument count)
POINTWISE_METHOD: dict[PointwiseMode, str] = {
    M.ADD: "add", M.SUB: "sub", M.MUL: "mul", M.DIV: "div", M.MAX: "max", M.MIN: "min",
    M.POW: "pow", M.ABS: "abs", M.NEG: "neg", M.EXP: "exp", M.LOG: "log", M.SQRT: "sqrt",
    M.RSQRT: "rsqrt", M.RECIPROCAL: "reciprocal", M.SIN: "sin", M.COS: "cos", M.ERF: "erf",
    M.FLOOR: "floor", M.CEIL: "ceil", M.IDENTITY: "identity", M.RELU_FWD: "relu",
    M.TANH_FWD: "tanh", M.SIGMOID_FWD: "sigmoid", M.GELU_FWD: "gelu",
    M.GELU_APPROX_TANH_FWD: "gelu_approx_tanh", M.ELU_FWD: "elu", M.SWISH_FWD: "swish",
    M.SOFTPLUS_FWD: "softplus", M.CMP_EQ: "cmp_eq", M.CMP_NEQ: "cmp_neq", M.CMP_GT: "cmp_gt",
    M.CMP_GE: "cmp_ge", M.CMP_LT: "cmp_lt", M.CMP_LE: "cmp_le", M.LOGICAL_AND: "logical_and",
    M.LOGICAL_OR: "logical_or", M.LOGICAL_NOT: "logical_not", M.BINARY_SELECT: "binary_select",
    M.RELU_BWD: "relu_backward", M.GELU_BWD: "gelu_backward", M.TANH_BWD: "tanh_backward",
    M.SIGMOID_BWD: "sigmoid_backward",
}

REDUCTION_MODE: dict[ReductionMode, str] = {
    ReductionMode.SUM: "ADD", ReductionMode.MIN: "MIN", ReductionMode.MAX: "MAX",
    ReductionMode.AMAX: "AMAX", ReductionMode.AVG: "AVG", ReductionMode.MUL: "MUL",
    ReductionMode.NORM1: "NORM1", ReductionMode.NORM2: "NORM2",
}

DATA_TYPE: dict[DataType, str] = {
    DataType.HALF: "HALF", DataType.BFLOAT16: "BFLOAT16", DataType.FLOAT: "FLOAT",
    DataType.DOUBLE: "DOUBLE", DataType.INT8: "INT8", DataType.UINT8: "UINT8",
    DataType.INT32: "INT32", DataType.INT64: "INT64", DataType.BOOLEAN: "BOOLEAN",
    DataType.FP8_E4M3: "FP8_E4M3", DataType.FP8_E5M2: "FP8_E5M2",
}

# Op kinds with no lowering here, and why (the reason supports() gives).
NOT_LOWERED: dict[OpKind, str] = {
    OpKind.SOFTMAX: "cuDNN's graph API has no softmax node (softmax exists only inside its sdpa)",
    OpKind.POOLING: "the cuDNN frontend's Python graph (1.32) exposes no resample (pooling) node",
    OpKind.POOLING_BACKWARD: "the cuDNN frontend's Python graph (1.32) exposes no resample backward node",
    **{k: f"cuDNN graphs here take no {k.value} node (data movement stays with other engines)" for k in DATA_MOVEMENT},
    **{k: f"cuDNN's graph API has no {k.value} (indexing) node; the torch engine runs it" for k in INDEXING},
}



class Refused(Exception):
    """The graph cannot be described to cuDNN; the message says why (naming the node)."""


@dataclass(frozen=True)
class Described:
    """How one fusegraph tensor is described to cuDNN: dims and strides at the graph's rank."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Prep:
    """A per-channel scale and shift computed on the device before the cuDNN graph runs:
    batchnorm inference's ``y = x * a + b`` with ``a = scale / sqrt(var + eps)`` and
    ``b = bias - mean * a`` (cuDNN's own batchnorm-inference node takes an inverse
    variance, and fusing it into a convolution's epilogue is a scale and a shift anyway)."""

    node: str
    scale: str
    bias: str
    mean: str
    var: str
    epsilon: float
    channels: int
    uid_a: int
    uid_b: int
    dims: tuple[int, ...]  # [1, C, 1, ...] at the graph's rank


@dataclass
class Binding:
    """What the cuDNN graph of a fusegraph graph looks like from outside."""

    rank: int
    trailing: bool  # unit dims appended (norm graphs) rather than prepended
    described: dict[str, Described]  # every non-scalar tensor
    uids: dict[str, int]  # graph inputs and outputs -> cuDNN uid
    scalars: dict[int, tuple[float | int | bool, DataType]]  # pass-by-value uid -> value
    preps: list[Prep] = field(default_factory=list)
    scalar_uid: dict[str, int] = field(default_factory=dict)  # scalar tensor name -> uid

    def to_json(self) -> dict[str, Any]:
        return {"uids": self.uids}


def _graph_rank(graph: Graph) -> tuple[int, bool]:
    kinds = {n.kind for n in graph.nodes}
    r = max((len(t.shape) for t in graph.tensors if not t.is_scalar), default=1)
    norms = kinds & ((NORMS - {OpKind.BATCHNORM_INFERENCE}) | NORM_BACKWARD_LOWERED | {OpKind.BATCHNORM_BACKWARD})
    if norms and OpKind.MATMUL in kinds:
        raise Refused(
            "a matmul and a layer/rms/batch norm in one graph: cuDNN describes the norm at rank 4 "
            "with unit dims appended and the matmul with batch dims prepended; split the graph"
        )
    if norms:
        return max(4, r), True
    if OpKind.MATMUL in kinds:
        return max(3, r), False
    return max(4, r), False


def _describe(t: TensorAttr, rank: int, trailing: bool, natural: int, order: tuple[int, ...] | None = None,
              channels: int | None = None) -> Described:
    """Dims and strides at cuDNN's rank. A tensor of lower rank than the graph's ``natural``
    one aligns right, as NumPy broadcasting (and the reference) align it; then unit dims are
    prepended, or appended for norm graphs (``trailing``). A batchnorm's per-channel ``[C]``
    tensor (``channels``: the rank of its x) is described as ``[1, C, 1, ...]``. A packed
    tensor (``order``: its memory order, outermost first, size-1 axes in their canonical
    place) gets strides recomputed from that order, so that a size-1 axis never carries a
    stride that ties with a real one: cuDNN reads a layout from the stride order."""
    dims = list(t.shape)
    strides = list(layout.packed_strides(dims, order) if order is not None else t.strides)
    if channels is not None and len(dims) == 1:
        dims, strides = [1, dims[0], *[1] * (channels - 2)], [dims[0], 1, *[1] * (channels - 2)]
    extent = max((d * s for d, s in zip(dims, strides, strict=True)), default=1) or 1
    lead = max(0, natural - len(dims))
    dims, strides = [1] * lead + dims, [extent] * lead + strides
    if trailing:
        return Described(tuple(dims + [1] * (rank - len(dims))), tuple(strides + [1] * (rank - len(dims))))
    pad = rank - len(dims)
    return Described(tuple([1] * pad + dims), tuple([extent] * pad + strides))


# The memory orders (outermost first) cuDNN's engines read correctly. The GPU fuzz run on the
# H200 (docs/reliability.md) found cuDNN 9.19 returning wrong numbers, silently, for packed
# tensors in other stride orders: a neg over a CNHW tensor (rel err 1.44), convolutions,
# dgrads and wgrads whose activations or filters were laid out e.g. HWNC (0.6-1.8).
LAYOUTS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "row-major": lambda r: tuple(range(r)),
    "channels-last": lambda r: (0, *range(2, r), 1),
    "transposed": lambda r: (*range(r - 2), r - 1, r - 2),  # a matmul operand, cuBLAS-style
    "heads-interleaved": lambda r: (0, 2, 1, 3) if r == 4 else tuple(range(r)),  # attention's [b, s, h, d]
}


def layout_order(t: TensorAttr, allowed: tuple[str, ...]) -> tuple[int, ...] | str:
    """The memory order of ``t`` among the ``allowed`` layouts (size-1 axes placed where the
    layout puts them), or why ``t`` is in none of them."""
    dims, strides = t.shape, t.strides
    if any(strides[a] == 0 for a in range(len(dims)) if dims[a] > 1):
        return f"tensor '{t.name}' {list(dims)} has an expanded (stride-0) axis; cuDNN is given packed tensors only"
    if not layout.is_packed(dims, strides):
        return f"tensor '{t.name}' {list(dims)} strides {list(strides)} are not packed (gaps or overlap)"
    if len(dims) < 2:
        return tuple(range(len(dims)))
    have = [a for a in layout.stride_order(dims, strides) if dims[a] > 1]
    for name in allowed:
        order = LAYOUTS[name](len(dims))
        if [a for a in order if dims[a] > 1] == have:
            return order
    return (f"tensor '{t.name}' {list(dims)} strides {list(strides)}: cuDNN reads only "
            f"{' or '.join(allowed)} layouts correctly (other stride orders gave wrong numbers)")


def _touching(graph: Graph) -> dict[str, set[OpKind]]:
    """Tensor name -> the kinds of the nodes that read or write it."""
    out: dict[str, set[OpKind]] = {}
    for n in graph.nodes:
        for t in (*n.inputs.values(), *n.outputs.values()):
            out.setdefault(t.name, set()).add(n.kind)
    return out


def allowed_layouts(kinds: set[OpKind], t: TensorAttr, rank: int, trailing: bool) -> tuple[str, ...]:
    """Which layouts ``t`` may have, by the ``kinds`` of the nodes that read or write it
    (``rank``: cuDNN's)."""
    if kinds & {OpKind.LAYERNORM, OpKind.RMSNORM, *NORM_BACKWARD_LOWERED} or (trailing and len(t.shape) < rank):
        # layer/RMS norms over a channels-last x (scale row-major) gave wrong numbers, as did
        # channels-last tensors of norm graphs of rank < 4, whose appended unit dims tie
        # with the channel's stride of 1
        return ("row-major",)
    if OpKind.MATMUL in kinds:
        return ("row-major", "transposed")
    if kinds & {OpKind.SDPA, OpKind.SDPA_BACKWARD}:
        return ("row-major", "heads-interleaved")
    if len(t.shape) >= 3:
        return ("row-major", "channels-last")
    return ("row-major",)


def _reason(node: Node, why: str) -> Refused:
    return Refused(f"node '{node.name}' ({node.kind.value}): {why}")


def _check_node(node: Node) -> None:
    if node.kind in NOT_LOWERED:
        raise _reason(node, NOT_LOWERED[node.kind])
    for port, t in node.inputs.items():
        if not t.is_scalar and t.dtype not in DATA_TYPE:
            raise _reason(node, f"input '{port}' is {t.dtype.name}, which cuDNN has no type for")
    for port, t in node.outputs.items():
        if t.dtype not in DATA_TYPE:
            raise _reason(node, f"output '{port}' is {t.dtype.name}, which cuDNN has no type for")
    attrs = node.attrs
    if isinstance(attrs, PointwiseAttrs):
        if attrs.mode == M.ELU_FWD and attrs.param("elu_alpha") != 1.0:
            raise _reason(node, "cuDNN's elu takes no alpha (only alpha = 1)")
        if attrs.mode == M.SOFTPLUS_FWD and attrs.param("softplus_beta") != 1.0:
            raise _reason(node, "cuDNN's softplus takes no beta (only beta = 1)")
    if isinstance(attrs, ConvAttrs) and len(next(iter(node.outputs.values())).shape) not in (4, 5):
        raise _reason(node, "cuDNN convolutions here are 2-D or 3-D (filter rank 4 or 5)")
    if isinstance(attrs, SdpaAttrs):
        mask = node.inputs.get("mask")
        if mask is not None and mask.dtype == DataType.BOOLEAN:
            raise _reason(node, "a boolean mask: cuDNN's sdpa takes an additive bias (pass 0 / -inf as floats)")
    if node.kind in (OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM, OpKind.BATCHNORM_INFERENCE):
        eps = node.inputs["epsilon"]
        if not eps.is_scalar:
            raise _reason(node, "epsilon must be a constant (graph.scalar) for cuDNN, not a tensor fed at run time")


# The ports each lowering below reads and writes; a node using any other (an optional port
# the op table gained) is refused rather than run with that port ignored.
PORTS: dict[OpKind, tuple[frozenset[str], frozenset[str]]] = {
    OpKind.BATCHNORM: (frozenset({"x", "scale", "bias", "epsilon"}), frozenset({"y", "mean", "inv_var"})),
    OpKind.LAYERNORM: (frozenset({"x", "scale", "bias", "epsilon"}), frozenset({"y", "mean", "inv_var"})),
    OpKind.RMSNORM: (frozenset({"x", "scale", "bias", "epsilon"}), frozenset({"y", "inv_rms"})),
    OpKind.SDPA: (frozenset({"q", "k", "v", "mask"}), frozenset({"o", "stats"})),
    OpKind.LAYERNORM_BACKWARD: (frozenset({"dy", "x", "scale", "mean", "inv_var"}), frozenset({"dx", "dscale", "dbias"})),
    OpKind.RMSNORM_BACKWARD: (frozenset({"dy", "x", "scale", "inv_rms"}), frozenset({"dx", "dscale", "dbias"})),
    OpKind.BATCHNORM_BACKWARD: (frozenset({"dy", "x", "scale", "mean", "inv_var"}), frozenset({"dx", "dscale", "dbias"})),
    OpKind.SDPA_BACKWARD: (frozenset({"q", "k", "v", "o", "do", "stats", "mask"}), frozenset({"dq", "dk", "dv"})),
}

# Operations that make one cuDNN graph's main kernel (the rest fuse into its prologue/epilogue).
MAIN_OPS = frozenset({OpKind.CONV_FPROP, OpKind.CONV_DGRAD, OpKind.CONV_WGRAD, OpKind.MATMUL, OpKind.SDPA,
                      OpKind.SDPA_BACKWARD})


def _check_graph(graph: Graph, tf32: bool) -> None:
    """Refusals about the graph as a whole (after every node passed _check_node)."""
    main = [n for n in graph.nodes if n.kind in MAIN_OPS]
    if len(main) > 1:
        names = ", ".join(f"'{n.name}' ({n.kind.value})" for n in main)
        raise Refused(
            f"{names}: a cuDNN graph here holds at most one convolution, matmul or sdpa (forward or backward: its main "
            "kernel); graphs holding a matmul and a convolution killed the process (SIGSEGV) in "
            "cuDNN on the H200 -- the graph is split instead"
        )
    why = backward_refusal(graph)
    if why is not None:
        raise Refused(why)
    _check_flow(graph)
    _check_epilogues(graph)
    made = {t.name for n in graph.nodes for t in n.outputs.values()}
    for node in graph.nodes:
        x = node.inputs.get("x")
        ins = node.inputs
        if (node.kind == OpKind.POINTWISE and "b" in ins and ins["a"].name not in made
                and any(t.name in made for p, t in ins.items() if p != "a")):
            raise _reason(node, "it reads a computed value as its second operand and a graph input as its first: "
                                "cuDNN computed such binary ops wrongly (rel err 0.4-15, H200)")
        images = [t for p, t in (*ins.items(), *node.outputs.items()) if p in ("x", "dy", "y", "dx")]
        if node.kind in CONVOLUTIONS and any(all(d == 1 for d in t.shape[2:]) for t in images):
            raise _reason(node, "a convolution over 1x1 images: cuDNN returned wrong numbers for such degenerate "
                                "shapes (rel err 1.4-15); they stay with other engines")
        if node.kind == OpKind.MATMUL and 1 in (ins["a"].shape[-2], ins["a"].shape[-1], ins["b"].shape[-1]):
            raise _reason(node, "a matmul with a unit M, N or K: cuDNN returned wrong numbers for such degenerate "
                                "shapes (rel err 0.38); they stay with cuBLAS")
        if not tf32 and node.kind == OpKind.MATMUL and all(t.dtype in (DataType.FLOAT, DataType.DOUBLE) for t in node.inputs.values()):
            raise _reason(node, "cuDNN 9.19's matmul engines round float32 operands to TF32 on every plan, those "
                                "without the tensor-core note too (rel err 2.5e-4 on 7x2x7, 64^3 and 256x512x256 "
                                "products, H200): float32 matmuls stay with cuBLAS unless knob tf32=True is pinned")
        if node.kind == OpKind.BATCHNORM_INFERENCE:
            computed = [p for p in ("scale", "bias", "mean", "var") if node.inputs[p].is_virtual]
            if computed:
                raise _reason(node, f"{computed} computed in the graph: the per-channel scale and shift cuDNN is given are "
                                    "prepared from graph inputs")
        if getattr(node.attrs, "phase", None) == NormFwdPhase.TRAINING or node.kind == OpKind.BATCHNORM:
            unread = [p for p, t in node.outputs.items() if p != "y" and not t.is_output]
            if unread:
                raise _reason(node, f"training-phase statistics {unread} are not graph outputs: cuDNN writes them and "
                                    "needs their memory (CUDNN_STATUS_BAD_PARAM_NULL_POINTER otherwise)")
            narrow = [p for p, t in node.outputs.items() if p != "y" and t.dtype != DataType.FLOAT]
            if narrow:
                raise _reason(node, f"statistics {narrow} are not float32: cuDNN writes its statistics as float32 "
                                    "(bfloat16 ones read back as garbage, rel err 3e30)")
        if node.kind in (OpKind.LAYERNORM, OpKind.RMSNORM, *NORM_BACKWARD_LOWERED) and x is not None:
            want = (1, *x.shape[1:])
            for port in ("scale", "bias"):
                t = node.inputs.get(port)
                if t is not None and (1,) * (len(x.shape) - len(t.shape)) + t.shape != want:
                    raise _reason(node, f"{port} {list(t.shape)} is broadcast: cuDNN's {node.kind.value} reads one value "
                                        f"per normalized element ({list(want)}), and a broadcast {port} gave wrong numbers")
        if node.kind == OpKind.BATCHNORM and x is not None:
            want = (1, x.shape[1], *[1] * (len(x.shape) - 2))
            for port in ("scale", "bias"):
                t = node.inputs[port]
                if t.shape not in (want, (x.shape[1],)):
                    raise _reason(node, f"{port} {list(t.shape)}: cuDNN's batchnorm takes per-channel tensors shaped "
                                        f"[{x.shape[1]}] or {list(want)}")
        handled = PORTS.get(node.kind)
        if handled is not None:
            extra = sorted((set(node.inputs) - handled[0]) | (set(node.outputs) - handled[1]))
            if extra:
                raise _reason(node, f"port(s) {extra} have no cuDNN lowering here")


def _check_flow(graph: Graph) -> None:
    """Every node's result reaches a graph output, and the graph is one piece: on the H200,
    cuDNN graphs with a dead branch (a virtual result no node reads) or two unconnected
    computations made its kernels read or write stray memory -- wrong numbers, NaNs, or an
    illegal/misaligned address that poisons the CUDA context."""
    live = {t.name for t in graph.outputs()}
    for node in reversed(graph.topological_order()):
        if any(t.name in live for t in node.outputs.values()):
            live.update(t.name for t in node.inputs.values())
        else:
            raise _reason(node, "its result reaches no graph output (a dead branch); cuDNN is given live nodes only")
    parent: dict[str, str] = {}

    def root(a: str) -> str:
        while parent.get(a, a) != a:
            a = parent[a]
        return a

    for node in graph.nodes:
        names = [t.name for t in (*node.inputs.values(), *node.outputs.values()) if not t.is_scalar]
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    pieces = {root(t.name) for n in graph.nodes for t in n.outputs.values()}
    if len(pieces) > 1:
        raise Refused(f"graph '{graph.name}' is {len(pieces)} unconnected computations; cuDNN is given one at a time")


# Nodes that anchor a cuDNN graph: everything else must be an epilogue reading their result.
ANCHORS = MAIN_OPS | {OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM, OpKind.BATCHNORM_BACKWARD} | NORM_BACKWARD_LOWERED


def _check_epilogues(graph: Graph) -> None:
    """With a convolution, matmul, sdpa or norm in the graph, every other node computes on
    its result (an epilogue). On the H200 a pointwise branch beside it -- reading the
    matmul's or convolution's input and written out as well -- gave wrong numbers and NaNs
    (270 fuzzed graphs) or a misaligned-address error that poisons the CUDA context."""
    anchors = [n for n in graph.nodes if n.kind in ANCHORS]
    if not anchors:
        return
    if len(anchors) > 1:
        names = ", ".join(f"'{n.name}' ({n.kind.value})" for n in anchors)
        raise Refused(f"{names}: a cuDNN graph here is one convolution, matmul, sdpa or norm with its epilogue")
    anchor = anchors[0]
    made = {t.name for t in anchor.outputs.values()}
    readers: dict[str, int] = {}
    for node in graph.topological_order():
        for t in node.inputs.values():
            if t.name in made:
                readers[t.name] = readers.get(t.name, 0) + 1
                if readers[t.name] > 1:
                    raise _reason(node, f"'{t.name}' is read by two nodes of the epilogue: cuDNN's forked epilogues gave "
                                        "wrong numbers (rel err 0.08-0.6)")
        if node is anchor:
            continue
        if not any(t.name in made for t in node.inputs.values()):
            raise _reason(node, f"it does not compute on the result of '{anchor.name}' ({anchor.kind.value}): cuDNN "
                                "fuses epilogues only, and a branch beside the main operation gave wrong numbers")
        a = node.attrs
        if isinstance(a, PointwiseAttrs):
            if a.mode == M.RELU_FWD and (a.param("relu_lower_clip") != 0.0 or math.isfinite(a.param("relu_upper_clip"))
                                         or a.param("relu_lower_clip_slope") != 0.0):
                raise _reason(node, "a clipped or leaky relu in an epilogue: cuDNN applied it wrongly (rel err 0.1-0.95)")
            ports = [p for p in ("a", "b", "c") if p in node.inputs]
            if len(ports) > 1 and node.inputs["a"].name not in made:
                # on the H200, 291 of 303 wrong epilogues read the main operation's result as a
                # binary op's second operand, and so did the epilogues that still failed when a
                # commutative op was handed over swapped
                raise _reason(node, f"the result of '{anchor.name}' is not its first operand: cuDNN's epilogues "
                                    "computed such binary ops wrongly (and took the process down after a norm)")
            chain = next(t for t in node.inputs.values() if t.name in made)
            for p in ports:
                _check_operand(node, node.inputs[p], chain, anchor.kind)
        made.update(t.name for t in node.outputs.values())


def _check_operand(node: Node, t: TensorAttr, chain: TensorAttr, anchor: OpKind) -> None:
    """An epilogue's other operand is the chain's shape, one value per channel (a matmul's
    channels are its columns) or one value: a [1, C, H, W] operand broadcast over the batch
    of a convolution's result gave wrong numbers (rel err 0.38-0.56, f16, NHWC)."""
    if t.is_scalar or t is chain:
        return
    full = chain.shape
    dims = (1,) * (len(full) - len(t.shape)) + t.shape
    axis = len(full) - 1 if anchor == OpKind.MATMUL else 1
    per_channel = len(full) >= 2 and all(d == (full[axis] if i == axis else 1) for i, d in enumerate(dims))
    if dims != full and not per_channel and any(d != 1 for d in dims):
        raise _reason(node, f"operand '{t.name}' {list(t.shape)} is broadcast against {list(full)} other than per "
                            "channel; cuDNN's epilogues read such operands wrongly")


def _family(graph: Graph) -> tuple[str, set[str]]:
    """The one layout (row-major or channels-last) that the image-like tensors of the graph
    share -- those of rank >= 3 not read by a matmul or sdpa -- and their names. On the H200
    a convolution's epilogue reading or writing tensors of the other layout gave wrong
    numbers (rel err 0.95-1.4); a tensor whose size-1 axes fit both layouts takes the shared one."""
    names: set[str] = set()
    fits = {"row-major", "channels-last"}
    special = {t.name for n in graph.nodes if n.kind in (OpKind.MATMUL, OpKind.SDPA, OpKind.SDPA_BACKWARD)
               for t in (*n.inputs.values(), *n.outputs.values())}
    for t in graph.tensors:
        if t.is_scalar or t.data_type is None or len(t.shape) < 3 or t.name in special:
            continue
        names.add(t.name)
        here = {f for f in ("row-major", "channels-last") if isinstance(layout_order(t, (f,)), tuple)}
        if here:  # unpacked or expanded tensors are refused with their own reason later
            fits &= here
    if not fits:
        raise Refused(f"graph '{graph.name}' mixes NCHW-ordered and channels-last tensors; cuDNN is given one layout "
                      "per graph (mixed ones gave wrong numbers)")
    return ("row-major" if "row-major" in fits else "channels-last"), names


def _per_channel(graph: Graph) -> dict[str, int]:
    """A batchnorm's (or its backward's) [C] tensors -> the rank of its x (see _describe)."""
    out: dict[str, int] = {}
    for node in graph.nodes:
        if node.kind == OpKind.BATCHNORM:
            for port in ("scale", "bias"):
                t = node.inputs[port]
                if len(t.shape) == 1:
                    out[t.name] = len(node.inputs["x"].shape)
        if node.kind == OpKind.BATCHNORM_BACKWARD:
            for t in (*(node.inputs[p] for p in ("scale", "mean", "inv_var")), *node.outputs.values()):
                if len(t.shape) == 1:
                    out[t.name] = len(node.inputs["x"].shape)
    return out


def binding(graph: Graph, *, tf32: bool = False) -> Binding:
    """Decides the outside of the cuDNN graph; raises Refused with the reason. ``tf32``: the
    knob pinned, float32 matmuls accepted with TF32's rounding."""
    graph.ensure_valid()
    for node in graph.nodes:
        _check_node(node)
    rank, trailing = _graph_rank(graph)
    _check_graph(graph, tf32)
    natural = max((len(t.shape) for t in graph.tensors if not t.is_scalar), default=1)
    channels = _per_channel(graph)
    described: dict[str, Described] = {}
    family = _family(graph)
    touching = _touching(graph)
    for t in graph.tensors:
        if t.is_scalar or t.data_type is None or not t.dim:
            continue
        allowed = allowed_layouts(touching.get(t.name, set()), t, rank, trailing)
        if t.name in family[1]:
            allowed = tuple(a for a in allowed if a == family[0]) or allowed
        order = layout_order(t, allowed)
        if isinstance(order, str):
            raise Refused(order)
        described[t.name] = _describe(t, rank, trailing, natural, order, channels.get(t.name))
    uids: dict[str, int] = {}
    for t in [*graph.inputs(), *graph.outputs()]:
        uids.setdefault(t.name, len(uids) + 1)
    next_uid = len(uids) + 1
    b = Binding(rank, trailing, described, uids, {})
    for node in graph.nodes:
        for t in node.inputs.values():
            if t.is_scalar and t.name not in b.scalar_uid:
                assert t.value is not None
                b.scalar_uid[t.name] = next_uid
                b.scalars[next_uid] = (t.value, t.dtype)
                next_uid += 1
        if node.kind == OpKind.BATCHNORM_INFERENCE:
            x = node.inputs["x"]
            c = x.shape[1]
            dims = described[x.name].dims
            cdims = tuple(c if i == (rank - len(x.shape) + 1 if not trailing else 1) else 1 for i in range(len(dims)))
            eps = node.inputs["epsilon"].value
            assert eps is not None
            ins = node.inputs
            b.preps.append(
                Prep(node.name, ins["scale"].name, ins["bias"].name, ins["mean"].name, ins["var"].name,
                     float(eps), c, next_uid, next_uid + 1, cdims)
            )
            next_uid += 2
    return b


def refusal(graph: Graph, *, tf32: bool = False) -> str | None:
    """Why cuDNN cannot be given this graph (without asking cuDNN), or None."""
    try:
        binding(graph, tf32=tf32)
    except Refused as exc:
        return str(exc)
    return None

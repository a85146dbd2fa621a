"""Which graphs are one row kernel: every tensor seen as a [rows, cols] view of one frame.

Softmax, layer/RMS norms and reductions over a tensor's trailing dims are memory-bound:
eager PyTorch runs each as its own kernel and its pointwise neighbours as more, so a
layernorm followed by GELU reads and writes the activation twice. Held in registers, one
row (or a few) per program, the whole graph reads each input once and writes each output
once -- on the H100, layernorm+GELU 8192x4096 f16 ran 0.063 ms as one such kernel against
0.114 ms eager and 0.072 ms for cuDNN's fused norm (docs/gpu.md).

A graph qualifies when one *frame* (the shape of its row ops' input) and one *split*
(frame dims before it index rows, from it on columns) describe every tensor as one of:

- ``full``: the frame's shape;
- ``row``: the row dims, unit column dims (a norm's mean, a reduction's result);
- ``col``: unit row dims, the column dims (a norm's scale and bias);
- ``scalar``: every dim 1.

Graph inputs and outputs must also be addressable as ``row * row_stride + col *
col_stride``: the dims of each group must collapse (NumPy's contiguity within the group).
Everything else is refused with the reason, so another engine takes the graph.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from fusegraph.dtypes import DataType
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import (
    POINTWISE,
    NormAttrs,
    NormFwdPhase,
    OpKind,
    PointwiseAttrs,
    ReductionAttrs,
    SoftmaxAttrs,
)
from fusegraph.graph.tensor import TensorAttr

FORWARD_ROW_OPS = frozenset({OpKind.SOFTMAX, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.REDUCTION})
# every op the engine runs as row kernels: the forward ones above, fused with pointwise ops
# into one kernel here, and norm backward (its own kernel pair: norm_backward.py)
ROW_OPS = FORWARD_ROW_OPS | {OpKind.LAYERNORM_BACKWARD, OpKind.RMSNORM_BACKWARD}
FLOATS = frozenset({DataType.HALF, DataType.BFLOAT16, DataType.FLOAT})
MAX_COLS = 16384  # one row in registers: beyond this a looped kernel would be needed


@dataclass(frozen=True)
class Access:
    """How a tensor is addressed in the [rows, cols] view."""

    kind: str  # "full", "row", "col", "scalar"
    row_stride: int = 0
    col_stride: int = 0


@dataclass(frozen=True)
class RowGraph:
    """A graph accepted as one row kernel: the view and how each tensor is reached."""

    rows: int
    cols: int
    access: dict[str, Access]  # every tensor by name (virtual tensors: kind only)
    order: tuple[Node, ...]  # topological


class Refusal(Exception):
    """Why a graph is not one row kernel (the text supports() reports)."""


def _frame_of(node: Node) -> tuple[tuple[int, ...], int]:
    x = node.inputs["x"].shape
    if node.kind == OpKind.SOFTMAX:
        assert isinstance(node.attrs, SoftmaxAttrs)
        axis = node.attrs.axis % len(x)
        if any(d != 1 for d in x[axis + 1:]):
            raise Refusal(f"node '{node.name}': softmax over axis {node.attrs.axis} of {list(x)} is not over the trailing dims")
        return x, axis
    if node.kind == OpKind.REDUCTION:
        y = node.outputs["y"].shape
        reduced = [i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b]
        if not reduced:
            raise Refusal(f"node '{node.name}': reduction of {list(x)} reduces no dim")
        split = reduced[0]
        if any(y[i] != 1 for i in range(split, len(x))):
            raise Refusal(f"node '{node.name}': reduction of {list(x)} to {list(y)} is not over the trailing dims")
        return x, split
    return x, 1  # layernorm and rmsnorm normalize every dim but the first


def _kind(shape: tuple[int, ...], frame: tuple[int, ...], split: int) -> str | None:
    if len(shape) > len(frame):
        return None
    s = (1,) * (len(frame) - len(shape)) + shape
    rows_unit = all(d == 1 for d in s[:split])
    cols_unit = all(d == 1 for d in s[split:])
    if rows_unit and cols_unit:
        return "scalar"
    rows_match = s[:split] == frame[:split]
    cols_match = s[split:] == frame[split:]
    if rows_match and cols_match:
        return "full"
    if rows_match and cols_unit:
        return "row"
    if rows_unit and cols_match:
        return "col"
    return None


def _group_stride(dims: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The one stride that walks these dims in row-major order, or None if they do not collapse."""
    live = [(d, s) for d, s in zip(dims, strides, strict=True) if d != 1]
    if not live:
        return 0
    for (_, s_outer), (d_inner, s_inner) in itertools.pairwise(live):
        if s_outer != s_inner * d_inner:
            return None
    return live[-1][1]


def access_of(t: TensorAttr, kind: str, frame: tuple[int, ...], split: int) -> Access:
    pad = len(frame) - len(t.shape)
    dims = (1,) * pad + t.shape
    strides = (0,) * pad + tuple(t.strides)
    rs = _group_stride(dims[:split], strides[:split]) if kind in ("full", "row") else 0
    cs = _group_stride(dims[split:], strides[split:]) if kind in ("full", "col") else 0
    if rs is None or cs is None:
        raise Refusal(
            f"tensor '{t.name}': strides {list(t.strides)} of dims {list(t.shape)} do not collapse to one row and one "
            f"column stride (row dims {list(frame[:split])}, column dims {list(frame[split:])})"
        )
    return Access(kind, rs, cs)


def _check_types(graph: Graph, node: Node) -> None:
    for port, t in [*node.inputs.items(), *node.outputs.items()]:
        boundary = not t.is_virtual
        if t.dtype in FLOATS:
            continue
        if t.dtype == DataType.BOOLEAN and not boundary and node.kind == OpKind.POINTWISE:
            continue  # comparisons and logic in registers
        if t.is_scalar:
            continue  # inlined into the kernel's text as a literal
        where = "at the graph's boundary" if boundary else "inside the graph"
        raise Refusal(f"node '{node.name}': {port} '{t.name}' is {t.dtype.name} {where}; the row kernel takes half, bfloat16 and float tensors")
    cdt = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    if cdt is not None and cdt != DataType.FLOAT:
        raise Refusal(f"node '{node.name}': computes in {cdt.name}; the row kernel computes in float32")


def analyze(graph: Graph) -> RowGraph:
    """The row view of a validated graph, or Refusal with the reason."""
    order = tuple(graph.topological_order())
    row_ops = [n for n in order if n.kind in FORWARD_ROW_OPS]
    if not row_ops:
        raise Refusal("no softmax, norm or reduction: pointwise-only graphs go to engines that fuse them (torch compile)")
    for n in order:
        if n.kind not in FORWARD_ROW_OPS and n.kind != OpKind.POINTWISE:
            raise Refusal(f"node '{n.name}' ({n.kind.value}): the row kernel takes pointwise ops, softmax, norms and trailing reductions only")
        if n.kind in (OpKind.LAYERNORM, OpKind.RMSNORM):
            assert isinstance(n.attrs, NormAttrs)
            if n.attrs.phase not in (NormFwdPhase.INFERENCE, NormFwdPhase.TRAINING):
                raise Refusal(f"node '{n.name}': norm phase {n.attrs.phase.value} is not a forward phase")
            if not n.inputs["epsilon"].is_scalar and any(d != 1 for d in n.inputs["epsilon"].shape):
                raise Refusal(f"node '{n.name}': epsilon must be one value")
        if n.kind == OpKind.POINTWISE:
            assert isinstance(n.attrs, PointwiseAttrs)
            if n.attrs.mode not in POINTWISE:
                raise Refusal(f"node '{n.name}': pointwise mode {n.attrs.mode.value} has no row-kernel form")
        if n.kind == OpKind.REDUCTION:
            assert isinstance(n.attrs, ReductionAttrs)
        _check_types(graph, n)
    frame, split = _frame_of(row_ops[0])
    for n in row_ops[1:]:
        f2, s2 = _frame_of(n)
        if (f2, s2) != (frame, split):
            raise Refusal(f"node '{n.name}': rows {list(f2[:s2])} x columns {list(f2[s2:])} differ from node "
                          f"'{row_ops[0].name}''s {list(frame[:split])} x {list(frame[split:])}: not one row kernel")
    cols = math.prod(frame[split:])
    if cols > MAX_COLS:
        raise Refusal(f"rows of {cols} elements: the row kernel holds a row in registers, up to {MAX_COLS}")
    access: dict[str, Access] = {}
    for n in order:
        for t in [*n.inputs.values(), *n.outputs.values()]:
            if t.name in access:
                continue
            kind = _kind(t.shape, frame, split)
            if kind is None:
                raise Refusal(f"tensor '{t.name}' of dims {list(t.shape)} is neither the frame {list(frame)}, one value per "
                              f"row, one per column, nor a scalar (rows are dims {list(frame[:split])})")
            access[t.name] = Access(kind) if t.is_virtual or t.is_scalar else access_of(t, kind, frame, split)
        for port, t in n.inputs.items():
            if n.kind in FORWARD_ROW_OPS and port == "x" and access[t.name].kind != "full":
                raise Refusal(f"node '{n.name}': its input '{t.name}' must span the frame {list(frame)}")
    for t in graph.outputs():
        if access[t.name].kind not in ("full", "row"):
            raise Refusal(f"output '{t.name}' varies only along columns (or not at all): every row's program would write it")
    return RowGraph(math.prod(frame[:split]), cols, access, order)

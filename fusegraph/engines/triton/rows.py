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

Graphs with reshapes (``views``): a reshape of all the frame's elements is no data
movement in registers -- the kernel's element (row, col) is the element at linear index
``row * cols + col`` of every full-size tensor, whatever its shape -- so each tensor is
placed in the frame through the shape it is broadcast against (its *view*). A group norm
as exported (a layer norm over [N*G, K] rows, reshaped back to [N, C, H, W], times a
per-channel [C, 1, 1] weight, plus bias, SiLU) then reads channel ``c = (row % G) * C/G +
col // (H*W)``: the views' dims cut the frame into *atoms* (here N, G | C/G, H, W), each
tensor has one stride per atom (0 where it is broadcast), and its address is a sum of
``((row or col) // div % mod) * stride`` terms (``Term``) -- plain row and column strides
where its atoms collapse. The output written channels-last [N, H, W, C] from the same
rows is one more such address.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from fusegraph.dtypes import DataType
from fusegraph.graph import layout
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
class Term:
    """One part of a split address: ``((index // div) % mod) * stride``, index the row
    (``axis`` "r") or the column ("c"); ``mod`` 0: no modulo (the axis's outermost part)."""

    axis: str
    div: int
    mod: int
    stride: int

    def top(self, extent: int) -> int:
        """The largest offset this term adds for an index below ``extent``."""
        hi = (extent - 1) // self.div
        return (min(hi, self.mod - 1) if self.mod else hi) * self.stride


@dataclass(frozen=True)
class Access:
    """How a tensor is addressed in the [rows, cols] view."""

    kind: str  # "full", "row", "col", "scalar"
    row_stride: int = 0
    col_stride: int = 0
    # set (graphs with reshapes): the address is the sum of these, the strides above unused
    terms: tuple[Term, ...] = ()

    def max_offset(self, rows: int, cols: int) -> int:
        """The largest element offset the [rows, cols] view reads or writes."""
        if not self.terms:
            return self.row_stride * (rows - 1) + self.col_stride * (cols - 1)
        return sum(t.top(rows if t.axis == "r" else cols) for t in self.terms)


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
        if n.kind not in FORWARD_ROW_OPS and n.kind not in (OpKind.POINTWISE, OpKind.RESHAPE):
            raise Refusal(f"node '{n.name}' ({n.kind.value}): the row kernel takes pointwise ops, reshapes, softmax, norms and "
                          "trailing reductions only")
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
    views = any(n.kind == OpKind.RESHAPE for n in order)
    for n in row_ops[1:]:
        f2, s2 = _frame_of(n)
        # with reshapes, another shape of the same rows and columns is the same frame
        same = (math.prod(f2[:s2]), math.prod(f2[s2:])) == (math.prod(frame[:split]), math.prod(frame[split:])) \
            if views else (f2, s2) == (frame, split)
        if not same:
            raise Refusal(f"node '{n.name}': rows {list(f2[:s2])} x columns {list(f2[s2:])} differ from node "
                          f"'{row_ops[0].name}''s {list(frame[:split])} x {list(frame[split:])}: not one row kernel")
    cols = math.prod(frame[split:])
    if cols > MAX_COLS:
        raise Refusal(f"rows of {cols} elements: the row kernel holds a row in registers, up to {MAX_COLS}")
    if views:
        return RowGraph(math.prod(frame[:split]), cols, _view_access(graph, order, frame, split), order)
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


# ---- graphs with reshapes: every tensor placed in the frame through its view ------------------------
Atom = tuple[int, int]  # (size, inner): the frame's linear index // inner % size


def _suffixes(shape: tuple[int, ...]) -> list[int]:
    """Elements per index of each dim (and 1 past the last): [prod(shape[i:]) for i in 0..len]."""
    out = [1]
    for d in reversed(shape):
        out.append(out[-1] * d)
    return out[::-1]


def _atoms(shapes: list[tuple[int, ...]], total: int) -> tuple[Atom, ...]:
    """The coarsest cut of the frame's elements that every shape's dims are groups of
    (outer first); Refusal where two shapes split the elements across each other's dims."""
    bounds = sorted({b for s in shapes for b in _suffixes(s)} | {1, total})
    for inner, outer in itertools.pairwise(bounds):
        if outer % inner:
            crossing = [list(s) for s in shapes if inner in _suffixes(s) or outer in _suffixes(s)]
            raise Refusal(f"shapes {crossing} split the frame's {total} elements across each other's dims "
                          f"(blocks of {inner} and {outer}): no reshape-free view of one frame")
    return tuple((outer // inner, inner) for inner, outer in reversed(list(itertools.pairwise(bounds))))


def _atom_strides(t: TensorAttr, strides: tuple[int, ...], view: tuple[int, ...], atoms: tuple[Atom, ...]) -> tuple[int, ...]:
    """``t`` (laid out by ``strides``) broadcast against ``view``: its stride per atom (0 where broadcast)."""
    dims, st = tuple(t.shape), tuple(strides)
    while len(dims) > len(view) and dims[0] == 1:  # leading unit dims beyond the view's rank
        dims, st = dims[1:], st[1:]
    pad = len(view) - len(dims)
    if pad < 0:
        raise Refusal(f"tensor '{t.name}' of dims {list(t.shape)} has more dims than the shape {list(view)} it is read in")
    dims, st = (1,) * pad + dims, (0,) * pad + st
    suffix = _suffixes(view)
    out = []
    for _, inner in atoms:
        i = max(k for k in range(len(view)) if suffix[k] > inner)  # the view's dim holding the atom
        if dims[i] == view[i]:
            out.append(st[i] * (inner // suffix[i + 1]))
        elif dims[i] == 1:
            out.append(0)
        else:
            raise Refusal(f"tensor '{t.name}' of dims {list(t.shape)} does not broadcast to {list(view)}")
    return tuple(out)


def _terms(strides: tuple[int, ...], atoms: tuple[Atom, ...], cols: int) -> tuple[Term, ...]:
    """Per-atom strides as address terms: adjacent atoms that collapse merged, broadcast ones dropped."""
    terms: list[Term] = []
    for axis in ("r", "c"):
        parts = [(size, inner // cols if axis == "r" else inner, s) for (size, inner), s in zip(atoms, strides, strict=True)
                 if (inner >= cols) == (axis == "r")]
        merged: list[tuple[int, int, int]] = []
        for size, div, s in parts:
            if merged and merged[-1][2] == s * size:
                merged[-1] = (merged[-1][0] * size, div, s)
            else:
                merged.append((size, div, s))
        terms += [Term(axis, div, 0 if k == 0 else size, s) for k, (size, div, s) in enumerate(merged) if s]
    return tuple(terms)


def _address(kind: str, terms: tuple[Term, ...]) -> Access:
    """The plain row and column strides where each axis is one term over the whole index, else the terms."""
    plain = {}
    for axis in ("r", "c"):
        mine = [t for t in terms if t.axis == axis]
        if len(mine) > 1 or (mine and (mine[0].div != 1 or mine[0].mod)):
            return Access(kind, terms=terms)
        plain[axis] = mine[0].stride if mine else 0
    return Access(kind, plain["r"], plain["c"])


def _view_access(graph: Graph, order: tuple[Node, ...], frame: tuple[int, ...], split: int) -> dict[str, Access]:
    """Every tensor's access in a graph with reshapes (module docstring): each node reads and
    writes its tensors in a view -- a reshape its input's shape and its output's, a row op
    its input's, a pointwise op its output's where that spans the frame (else the view its
    first operand was seen in) -- and a tensor seen in two views must be the same function
    of (row, col) in both."""
    total, cols = math.prod(frame), math.prod(frame[split:])
    home: dict[str, tuple[int, ...]] = {}  # tensor -> the view it was first seen in
    uses: list[tuple[Node, TensorAttr, tuple[int, ...]]] = []
    for n in order:
        ins, outs = list(n.inputs.values()), list(n.outputs.values())
        if n.kind == OpKind.RESHAPE:
            (x,), (y,) = ins, outs
            if math.prod(x.shape) != total:
                raise Refusal(f"node '{n.name}': reshapes '{x.name}' {list(x.shape)}, not the frame's {total} elements "
                              f"(frame {list(frame)}): only reshapes of whole frames are views in registers")
            pairs = [(x, tuple(x.shape)), (y, tuple(y.shape))]
        else:
            if n.kind in FORWARD_ROW_OPS:
                view = tuple(n.inputs["x"].shape)
            elif math.prod(n.outputs["y"].shape) == total:
                view = tuple(n.outputs["y"].shape)
            else:
                view = next((home[t.name] for t in ins if t.name in home), frame)
            pairs = [(t, view) for t in [*ins, *outs]]
        for t, view in pairs:
            home.setdefault(t.name, view)
            uses.append((n, t, view))
    atoms = _atoms([frame, *home.values(), *(v for _, _, v in uses)], total)
    row_atoms = [k for k, (_, inner) in enumerate(atoms) if inner >= cols]
    outputs = {t.name for t in graph.outputs()}
    logical: dict[str, tuple[int, ...]] = {}
    access: dict[str, Access] = {}
    for n, t, view in uses:
        packed = tuple(layout.packed_strides(t.shape))
        lin = _atom_strides(t, packed, view, atoms)  # the tensor's own linear index, per atom
        seen = logical.setdefault(t.name, lin)
        if seen != lin:
            raise Refusal(f"node '{n.name}': tensor '{t.name}' of dims {list(t.shape)} is read in view {list(view)} as "
                          f"other elements of the frame than in view {list(home[t.name])}")
        if t.name in access:
            continue
        r_any, c_any = any(lin[k] for k in row_atoms), any(s for k, s in enumerate(lin) if k not in row_atoms)
        # one row (or one column) in all: a tensor that varies at all spans the frame, as plain row graphs have it
        rows_vary = r_any or (not row_atoms and c_any)
        cols_vary = c_any or (len(row_atoms) == len(atoms) and r_any)
        kind = {(True, True): "full", (True, False): "row", (False, True): "col", (False, False): "scalar"}[(rows_vary, cols_vary)]
        if t.is_virtual or t.is_scalar:
            access[t.name] = Access(kind)
            continue
        mem = _atom_strides(t, tuple(t.strides), view, atoms)
        if t.name in outputs and any(lin[k] and not mem[k] for k in range(len(atoms))):
            raise Refusal(f"output '{t.name}': strides {list(t.strides)} repeat elements of dims {list(t.shape)}")
        access[t.name] = _address(kind, _terms(mem, atoms, cols))
    for n in order:
        if n.kind in FORWARD_ROW_OPS and access[n.inputs["x"].name].kind != "full":
            raise Refusal(f"node '{n.name}': its input '{n.inputs['x'].name}' must span the frame {list(frame)}")
    for t in graph.outputs():
        if access[t.name].kind not in ("full", "row"):
            raise Refusal(f"output '{t.name}' varies only along columns (or not at all): every row's program would write it")
    return access

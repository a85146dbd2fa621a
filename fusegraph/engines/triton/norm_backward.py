"""Layer and RMS norm backward as two generated kernels: the row pass and the column sum.

dX is a row computation like the forward's (each row needs only its own dY, X, saved
statistics and the scale): ``dx = inv * (g - mean(g) - xhat * mean(g * xhat))`` with
``g = dy * scale`` (RMS norm drops ``mean(g)``). dScale and dBias are sums over *rows*,
which no one row's program can finish. The row pass therefore runs a fixed number of
programs, each walking the row tiles ``pid, pid + P, pid + 2P, ...`` and keeping its part
of ``sum(dy * xhat)`` and ``sum(dy)`` in registers, written once into a float32 workspace
``[P, sums, BLOCK]``; the second kernel adds the ``P`` parts of each column. The split is
fixed by the kernel's text, so the result is the same bits on every run (atomics would
add in arrival order). Both kernels take the same pointers: the graph's inputs, its
outputs, then the workspace.

Accepted: a graph of exactly one ``layernorm_backward`` or ``rmsnorm_backward`` node (its
rows are x's first dim, its columns the rest, as the forward's), half/bfloat16/float
tensors computed in float32, a scale that spans every column (not broadcast within the
row), boundary tensors whose row and column dims collapse to one stride each (rows.py's
rule). Everything else is refused with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fusegraph.dtypes import DataType
from fusegraph.engines.triton.rows import FLOATS, Access, Refusal, access_of
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind

NORM_BACKWARD_OPS = frozenset({OpKind.LAYERNORM_BACKWARD, OpKind.RMSNORM_BACKWARD})
ROW_KERNEL = "fg_norm_bwd_rows"
SUM_KERNEL = "fg_norm_bwd_sums"
SUM_COLS = 32  # columns per program of the column sum (128 programs for 4096 columns)
SUM_PARTS = 64  # workspace rows each of its steps adds
# Register use decides the tiling. Compiled for sm_90 (Triton 3.9, bf16 16384 x 4096, prefetch
# on), the row pass took 121 registers a thread at 8 elements a thread (16 warps), 201 at 16
# (8 warps) and 255 plus 192 bytes of spills at 32 (4 warps); 8192 columns at 16 warps spilled
# 296 bytes. So: 8 elements a thread, at most 16 warps, and rows up to 4096 elements. Tiles
# loading ahead cost little (raw 16-bit values): 108 registers with none, 118 with two, 128
# with three (f32 layer norm with three spilled 24 bytes).
ELEMENTS_PER_THREAD = 8
MAX_COLS = 4096
RESIDENT_WARPS = 16  # ~128 registers a thread leave room for 16 warps an SM (64K registers)
PREFETCH = 2  # tiles each program has loading ahead of the one it computes (knob ``prefetch``)
TL_TYPE = {DataType.HALF: "tl.float16", DataType.BFLOAT16: "tl.bfloat16", DataType.FLOAT: "tl.float32"}


@dataclass(frozen=True)
class NormBwdView:
    """A graph accepted as a norm-backward kernel pair."""

    node: Node
    rows: int
    cols: int
    access: dict[str, Access]  # boundary tensors by name
    sums: tuple[str, ...]  # the column sums computed, in workspace order: "dscale" [, "dbias"]

    @property
    def centred(self) -> bool:
        return self.node.kind == OpKind.LAYERNORM_BACKWARD


def is_norm_backward(graph: Graph) -> bool:
    """Whether ``graph`` holds a node of NORM_BACKWARD_OPS (then only this module may run it)."""
    return any(n.kind in NORM_BACKWARD_OPS for n in graph.nodes)


def analyze_norm_backward(graph: Graph) -> NormBwdView:
    """The view of a validated graph, or Refusal with the reason."""
    nodes = list(graph.nodes)
    if len(nodes) != 1 or nodes[0].kind not in NORM_BACKWARD_OPS:
        kinds = sorted({n.kind.value for n in nodes})
        raise Refusal(
            f"norm backward runs as its own kernel pair: the graph must be one layernorm_backward or rmsnorm_backward "
            f"node, got nodes {kinds} (split the graph; pointwise neighbours are not fused into it yet)"
        )
    node = nodes[0]
    cdt = getattr(node.attrs, "compute_data_type", None) or graph.compute_data_type
    if cdt is not None and cdt != DataType.FLOAT:
        raise Refusal(f"node '{node.name}': computes in {cdt.name}; the norm-backward kernels compute in float32")
    for port, t in [*node.inputs.items(), *node.outputs.items()]:
        if t.dtype not in FLOATS:
            raise Refusal(f"node '{node.name}': {port} '{t.name}' is {t.dtype.name}; the kernels take half, bfloat16 and float")
        if t.is_scalar:
            raise Refusal(f"node '{node.name}': {port} '{t.name}' is a constant; the kernels read it from memory")
    x = node.inputs["x"]
    frame, split = x.shape, 1
    cols = math.prod(frame[1:])
    if cols > MAX_COLS:
        raise Refusal(f"rows of {cols} elements: the norm-backward row pass holds a row in registers, up to {MAX_COLS} "
                      "(wider rows spilled registers when compiled for sm_90); cudnn and torch run them")
    scale = node.inputs["scale"]
    padded = (1,) * (len(frame) - len(scale.shape)) + scale.shape
    if padded[1:] != frame[1:]:
        raise Refusal(
            f"node '{node.name}': scale '{scale.name}' of dims {list(scale.shape)} is broadcast within the row "
            f"(columns {list(frame[1:])}); the kernels take one scale value per column"
        )
    port_kind = {"dy": "full", "x": "full", "scale": "col", "mean": "row", "inv_var": "row", "inv_rms": "row",
                 "dx": "full", "dscale": "col", "dbias": "col"}
    access: dict[str, Access] = {}
    for port, t in [*node.inputs.items(), *node.outputs.items()]:
        if t.is_virtual or t.name in access:
            continue
        access[t.name] = access_of(t, port_kind[port], frame, split)
    sums = tuple(p for p in ("dscale", "dbias") if p in node.outputs and not node.outputs[p].is_virtual)
    return NormBwdView(node, x.shape[0], cols, access, sums)


def block_of(cols: int) -> int:
    return 1 << max(0, (cols - 1).bit_length())


def _lit(x: float) -> str:
    return repr(float(x))


def norm_backward_source(graph: Graph, view: NormBwdView, rows_per_program: int, programs: int,
                         prefetch: int = PREFETCH) -> str:
    """The module text: ``fg_norm_bwd_rows`` launched on ``programs`` programs, then
    ``fg_norm_bwd_sums`` on ``ceil(cols / SUM_COLS)`` (or none where no column sum is
    asked), both taking ``(inputs..., outputs..., workspace)`` in ``graph.inputs()`` and
    ``graph.outputs()`` order; the workspace holds ``workspace_floats(...)`` float32.

    ``prefetch``: how many of its next tiles each program has loading (dy, x and the
    statistics, held in their own types) while it computes the current one -- the bytes a
    program keeps in flight, at a few registers a tile (the knob of that name; 0: a tile's
    loads wait for the previous tile's stores to be issued)."""
    node, rows, cols, acc = view.node, view.rows, view.cols, view.access
    block = block_of(cols)
    tiles = -(-rows // rows_per_program)
    ptr = {t.name: f"p{i}" for i, t in enumerate([*graph.inputs(), *graph.outputs()])}
    params = ", ".join([*ptr.values(), "ws"])
    row_mask = tiles * rows_per_program != rows
    col_mask = block != cols
    wide = max([a.row_stride * (rows - 1) + a.col_stride * (cols - 1) for a in acc.values()] + [0]) >= 2**31 - 1
    nsum = len(view.sums)

    def both(rmask: str | None) -> str | None:
        return f"{rmask} & cm" if rmask and col_mask else (rmask or ("cm" if col_mask else None))

    def m(mask: str | None) -> str:
        return f", mask={mask}, other=0.0" if mask else ""

    def port(p: str) -> tuple[str, Access]:
        t = node.inputs.get(p) or node.outputs[p]
        return ptr[t.name], acc[t.name]

    stat_ports = ("inv_var", "mean") if view.centred else ("inv_rms",)
    stat_names = {"inv_var": "inv", "inv_rms": "inv", "mean": "mean"}

    def loads(r: str, rmask: str | None, suffix: str, widen: str) -> list[str]:
        """dy, x and the row statistics of the rows ``r`` (masked by ``rmask``)."""
        out = []
        for name in ("dy", "x"):
            pt, a = port(name)
            out.append(f"{name}{suffix} = tl.load({pt} + {r} * {a.row_stride} + c * {a.col_stride}{m(both(rmask))}){widen}")
        for sp in stat_ports:
            pt, a = port(sp)
            out.append(f"{stat_names[sp]}{suffix} = tl.load({pt} + {r} * {a.row_stride}{m(rmask)}){widen}")
        return out

    lines = [
        f"# fusegraph norm-backward kernels for graph '{graph.name}' ({node.kind.value}): {rows} rows x {cols} columns",
        "import triton",
        "import triton.language as tl",
        "",
        f"ROWS = tl.constexpr({rows_per_program})",
        f"BLOCK = tl.constexpr({block})",
        "",
        "",
        "@triton.jit",
        f"def {ROW_KERNEL}({params}):",
    ]
    body: list[str] = []
    e = body.append
    e("pid = tl.program_id(0)")
    e("c = tl.arange(0, BLOCK)[None, :]")
    if col_mask:
        e(f"cm = c < {cols}")
    ps, a_s = port("scale")
    e(f"w = tl.load({ps} + c * {a_s.col_stride}{m('cm' if col_mask else None)}).to(tl.float32)")
    for k in range(nsum):
        e(f"acc{k} = tl.zeros([ROWS, BLOCK], tl.float32)")
    int64 = ".to(tl.int64)" if wide else ""
    for j in range(prefetch):  # tiles pid, pid + P, ... in flight before the loop
        e(f"r = (pid + {j * programs}) * ROWS + tl.arange(0, ROWS)[:, None]{int64}")
        if row_mask or j:
            e(f"rm = r < {rows}")
        body.extend(loads("r", "rm" if (row_mask or j) else None, f"_p{j}", ""))
    e(f"for t in range(pid, {tiles}, {programs}):")
    body_in: list[str] = []
    f = body_in.append
    f(f"r = t * ROWS + tl.arange(0, ROWS)[:, None]{int64}")
    if row_mask:
        f(f"rm = r < {rows}")
    if prefetch:
        names = ("dy", "x", *(stat_names[sp] for sp in stat_ports))
        for name in names:
            f(f"{name} = {name}_p0.to(tl.float32)")
        for j in range(1, prefetch):
            for name in names:
                f(f"{name}_p{j - 1} = {name}_p{j}")
        f(f"rn = r + {prefetch * programs * rows_per_program}")
        f(f"rnm = rn < {rows}")
        body_in.extend(loads("rn", "rnm", f"_p{prefetch - 1}", ""))
    else:
        body_in.extend(loads("r", "rm" if row_mask else None, "", ".to(tl.float32)"))
    full_mask = both("rm" if row_mask else None)
    f("xhat = (x - mean) * inv" if view.centred else "xhat = x * inv")
    # lanes past a row's end, and rows past the last, load dy = 0: g and every product
    # summed below vanish there whatever xhat holds
    f("g = dy * w")
    f(f"c1 = tl.sum(g * xhat, 1)[:, None] / {_lit(cols)}")
    if view.centred:
        f(f"c2 = tl.sum(g, 1)[:, None] / {_lit(cols)}")
        f("dx = inv * (g - c2 - xhat * c1)")
    else:
        f("dx = inv * (g - xhat * c1)")
    dx = node.outputs["dx"]
    if not dx.is_virtual:
        a = acc[dx.name]
        mask = f", mask={full_mask}" if full_mask else ""
        f(f"tl.store({ptr[dx.name]} + r * {a.row_stride} + c * {a.col_stride}, dx.to({TL_TYPE[dx.dtype]}){mask})")
    for k, p in enumerate(view.sums):
        f(f"acc{k} += dy * xhat" if p == "dscale" else f"acc{k} += dy")
    body += ["    " + s for s in body_in]
    for k in range(nsum):
        e(f"tl.store(ws + pid * {nsum * block} + {k * block} + c, tl.sum(acc{k}, 0)[None, :])")
    lines += ["    " + s for s in body]
    if nsum:
        lines += ["", "", "@triton.jit", f"def {SUM_KERNEL}({params}):"]
        s = [
            "pid = tl.program_id(0)",
            f"c = pid * {SUM_COLS} + tl.arange(0, {SUM_COLS})[None, :]",
            f"cm = c < {cols}",
        ]
        for k in range(nsum):
            s.append(f"acc{k} = tl.zeros([{SUM_PARTS}, {SUM_COLS}], tl.float32)")
        s.append(f"for part in range(0, {programs}, {SUM_PARTS}):")
        s.append(f"    pp = part + tl.arange(0, {SUM_PARTS})[:, None]")
        s.append(f"    pm = (pp < {programs}) & cm")
        for k in range(nsum):
            s.append(f"    acc{k} += tl.load(ws + pp * {nsum * block} + {k * block} + c, mask=pm, other=0.0)")
        for k, p in enumerate(view.sums):
            t = node.outputs[p]
            a = acc[t.name]
            s.append(f"tl.store({ptr[t.name]} + c * {a.col_stride}, tl.sum(acc{k}, 0)[None, :].to({TL_TYPE[t.dtype]}), mask=cm)")
        lines += ["    " + x for x in s]
    return "\n".join(lines) + "\n"


def workspace_floats(view: NormBwdView, programs: int) -> int:
    """float32 elements of the workspace (at least one, so a pointer always exists)."""
    return max(1, programs * len(view.sums) * block_of(view.cols))


def sum_programs(view: NormBwdView) -> int:
    """Programs of the column-sum kernel (0: no column sum asked for)."""
    return -(-view.cols // SUM_COLS) if view.sums else 0


def default_tiling(rows: int, cols: int, sms: int) -> tuple[int, int, int, int]:
    """(rows a tile, warps, programs per SM, programs): tiles of at least 1024 elements,
    ELEMENTS_PER_THREAD a thread, RESIDENT_WARPS an SM, fewer programs where there are
    fewer tiles."""
    block = block_of(cols)
    per = max(1, min(64, 1024 // block, block_of(rows)))
    warps = max(1, min(16, per * block // (32 * ELEMENTS_PER_THREAD)))
    per_sm = max(1, min(8, RESIDENT_WARPS // warps))
    tiles = -(-rows // per)
    return per, warps, per_sm, max(1, min(tiles, sms * per_sm))

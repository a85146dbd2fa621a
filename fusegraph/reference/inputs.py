"""Random inputs for a graph: what autotuning, probes and tests feed a plan.

They live beside the reference engine because they are part of its contract: values are
drawn from each op's domain (positive where a log, root or division needs it), so the
reference and every engine compute finite numbers from them.
"""

from __future__ import annotations

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import (
    GatherAttrs,
    GatherBackwardAttrs,
    OpKind,
    PointwiseAttrs,
    PointwiseMode,
)
from fusegraph.graph.tensor import TensorAttr

__all__ = ["random_inputs"]

_POSITIVE_MODES = {
    PointwiseMode.LOG, PointwiseMode.SQRT, PointwiseMode.RSQRT, PointwiseMode.POW,
    PointwiseMode.RECIPROCAL, PointwiseMode.DIV,
}


def _positive_ports(graph: Graph) -> set[str]:
    """Input tensors that must be positive for the graph's math to be defined."""
    names: set[str] = set()
    pos_graph = any(
        n.kind == OpKind.POINTWISE and isinstance(n.attrs, PointwiseAttrs) and n.attrs.mode in _POSITIVE_MODES
        for n in graph.nodes
    )
    for n in graph.nodes:
        for port, t in n.inputs.items():
            if port == "var" or pos_graph:
                names.add(t.name)
    return names


def _index_rows(graph: Graph) -> dict[str, int]:
    """Index tensors of gathers and the rows they index (the fewest, where several read one):
    their random values are drawn in ``[-rows, rows)``, negative ones included."""
    rows: dict[str, int] = {}
    for n in graph.nodes:
        if isinstance(n.attrs, GatherAttrs):
            data = n.inputs["data"]
            size = data.shape[n.attrs.axis % len(data.shape)]
        elif isinstance(n.attrs, GatherBackwardAttrs):
            size = n.attrs.num_rows
        else:
            continue
        name = n.inputs["indices"].name
        rows[name] = min(rows.get(name, size), size)
    return rows


def random_inputs(graph: Graph, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Random inputs laid out as the graph declares them (stride-0 axes stay broadcast)."""
    rng = rng or np.random.default_rng()
    positive = _positive_ports(graph)
    has_div = any(isinstance(n.attrs, PointwiseAttrs) and n.attrs.mode == PointwiseMode.DIV for n in graph.nodes)
    index_rows = _index_rows(graph)
    out = {}
    for t in graph.inputs():
        if t.name in index_rows:
            n = index_rows[t.name]
            out[t.name] = _random_tensor(t, rng, positive=False, nonzero=False, bounds=(-n, n))
            continue
        out[t.name] = _random_tensor(t, rng, positive=t.name in positive, nonzero=has_div)
    return out


def _random_tensor(
    t: TensorAttr, rng: np.random.Generator, *, positive: bool, nonzero: bool, bounds: tuple[int, int] | None = None
) -> np.ndarray:
    dense = tuple(1 if s == 0 else d for d, s in zip(t.shape, t.strides, strict=True))
    dt = t.dtype
    if dt == DataType.BOOLEAN:
        vals: np.ndarray = rng.random(dense) < 0.8
    elif bounds is not None:
        vals = rng.integers(bounds[0], bounds[1], dense)
    elif dt.is_integer:
        lo = 1 if (positive or nonzero) else (0 if dt == DataType.UINT8 else -5)
        vals = rng.integers(lo, 6, dense)
    elif positive:
        vals = rng.uniform(0.5, 1.5, dense)
    else:
        vals = rng.uniform(-1.0, 1.0, dense)
    arr = layout.empty_strided(dense, layout.packed_strides(dense, layout.stride_order(t.shape, t.strides)), dt.numpy)
    arr[...] = vals.astype(dt.numpy) if dt.is_float else vals
    if dense != t.shape:
        arr = np.broadcast_to(arr, t.shape)
    return arr

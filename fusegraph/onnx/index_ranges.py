"""Model inputs that index a constant table: ids fed to a ``Gather`` whose data is an
initializer (an embedding lookup), and position ids fed to the contrib ``RotaryEmbedding``
whose caches are initializers (ids in [0, rows): ONNX Runtime refuses negative ones, which
the graph's gather would count from the end). fusegraph's gather checks its ids' range as PyTorch's
indexing does -- a typed error on the CPU, but a device-side assert on CUDA, which poisons
the process's CUDA context -- so a session checks ids arriving from the host against the
table before they reach a device: a typed error naming the input and the node instead of a
dead context. Ids already on the device (io_binding) are not checked: that would cost a
synchronization on every run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx


@dataclass(frozen=True)
class IndexRange:
    node: str
    rows: int  # valid ids are in [-rows, rows), negative ones counting from the end as ONNX's Gather
    negative: bool = True  # False: valid ids are in [0, rows)


def index_ranges(model: onnx.ModelProto) -> dict[str, list[IndexRange]]:
    """Model input name -> the tables it indexes directly."""
    graph = model.graph
    tables = {t.name: list(t.dims) for t in graph.initializer}
    inits = set(tables)
    inputs = {i.name for i in graph.input if i.name not in inits}
    out: dict[str, list[IndexRange]] = {}
    for n in graph.node:
        if n.op_type == "RotaryEmbedding" and n.domain in ("com.microsoft", "", "ai.onnx") and len(n.input) >= 3:
            contrib = n.domain == "com.microsoft"  # (input, ids, cos, sin); the default domain's (X, cos, sin, ids?)
            ids, cache = (n.input[1], n.input[2]) if contrib else (n.input[3] if len(n.input) > 3 else "", n.input[1])
            if ids in inputs and cache in tables and tables[cache]:
                out.setdefault(ids, []).append(
                    IndexRange(n.name or f"RotaryEmbedding({n.input[0]})", int(tables[cache][0]), negative=False))
            continue
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        data, ids = n.input[0], n.input[1]
        if ids not in inputs or data not in tables:
            continue
        dims = tables[data]
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        if not dims or not -len(dims) <= axis < len(dims):
            continue
        out.setdefault(ids, []).append(IndexRange(n.name or f"Gather({data})", int(dims[axis])))
    return out


def out_of_range(ids: np.ndarray, ranges: list[IndexRange]) -> str:
    """Why ``ids`` cannot index its tables ('' when every id is in range)."""
    if ids.size == 0 or ids.dtype.kind not in "iu":
        return ""
    lo, hi = int(ids.min()), int(ids.max())
    for r in ranges:
        low = -r.rows if r.negative else 0
        if lo < low or hi >= r.rows:
            bad = hi if hi >= r.rows else lo
            return (f"index {bad} is out of range for node '{r.node}', whose table has {r.rows} rows "
                    f"(ids must be in [{low}, {r.rows}))")
    return ""

"""A session plan's partition report: which units run where and why, and the copies made
where values cross units (``SessionPlan.report``)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from fusegraph.graph.layout import packed_strides, same_strides
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.plan_regions import RegionUnit
from fusegraph.onnx.report import Boundaries, PartitionReport, SubgraphEntry, UnclaimedEntry
from fusegraph.onnx.units import FusegraphUnit, Unit

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan


def report(plan: SessionPlan) -> PartitionReport:
    subs = []
    unclaimed = []
    for u in plan.units:
        sources = tuple(s for n in u.nodes for s in n.sources)
        ops = collections.Counter(_source_ops(plan.og, u.nodes))
        if isinstance(u, RegionUnit):
            subs.append(
                SubgraphEntry(u.name, "fusegraph", u.engine_name, sources, dict(ops), u.fusions,
                              note=" | ".join(u.engine_notes), compile_s=plan.compile_s.get(u.name, 0.0),
                              floor=u.floor_line(), regions=tuple(u.rows))
            )
            continue
        if isinstance(u, FusegraphUnit):
            v = plan._floor.get(frozenset(n.name for n in u.nodes))
            subs.append(
                SubgraphEntry(u.name, "fusegraph", u.engine_name, sources, dict(ops), u.fusions,
                              note=" | ".join(u.engine_notes), compile_s=plan.compile_s.get(u.name, 0.0),
                              floor=v.describe() if v else floor_off(plan),
                              fusegraph_ms=v.fusegraph_ms if v else None, ort_ms=v.ort_ms if v else None)
            )
            continue
        engine = "onnxruntime" if u.kind == "onnxruntime" else "iree (torch-mlir onnx importer)"
        subs.append(
            SubgraphEntry(u.name, u.kind, engine, sources, dict(ops), note=plan.notes.get(u.name, ""),
                          compile_s=plan.compile_s.get(u.name, 0.0))
        )
        for n in u.nodes:
            for s, op in n.origin():
                reason = plan.reasons.get(n.name, "not claimed")
                unclaimed.append(UnclaimedEntry(s, op, reason, u.kind))
    return PartitionReport(
        model=plan.model_name,
        total_nodes=len(plan.og.all_node_names),
        folded_nodes=len(plan.og.folded),
        subgraphs=tuple(subs),
        unclaimed=tuple(unclaimed),
        rewrites={k: v for k, v in plan.rewrites.items() if v},
        patterns_refused=tuple(plan.pattern_refusals.values()),
        input_shapes=plan.input_shapes,
        setup_s=plan.setup_s,
        floor=f"whole model {plan.floor_whole.describe()}" if plan.floor_whole else "",
        boundaries=boundaries(plan),
    )

def floor_off(plan: SessionPlan) -> str:
    if plan.floor_budget <= 0:
        return "floor: off"
    if plan.handle.device.is_gpu and not plan.regions:
        return "floor: none (regions=off on a GPU: ONNX Runtime's CPU provider is no incumbent there)"
    return "floor: not measured (lazy_compile)" if plan.opts.lazy_compile else ""

def boundaries(plan: SessionPlan) -> Boundaries:
    """Static count of the values crossing units and the copies made there (see Boundaries)."""
    producer: dict[str, Unit] = {o: u for u in plan.units for o in u.outputs}
    values = copies = nbytes = 0

    def size(v: str) -> int:
        info = plan.og.types.get(v)
        if info is None or info.shape is None or not info.elem:
            return 0
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(info.elem).itemsize
        return int(np.prod(info.shape, dtype=np.int64)) * itemsize

    def strided(u: Unit, v: str, out: bool) -> bool:
        """True where fusegraph holds ``v`` in another layout than contiguous (or on a device)."""
        if not isinstance(u, FusegraphUnit):
            return False
        if u._buffers:
            return True
        try:
            t = u.graph.tensor_by_name(u._out[v]) if out else u._in[v]
        except (KeyError, Exception):
            return False
        return not same_strides(t.shape, t.strides, packed_strides(t.shape))

    for u in plan.units:
        for v in u.inputs:
            p = producer.get(v)
            if p is None and v not in plan.og.inputs:
                continue
            values += 1
            if p is None:  # a feed: contiguous
                moved = strided(u, v, out=False)
            elif isinstance(p, FusegraphUnit) and isinstance(u, FusegraphUnit):
                moved = False  # passed as it is (the next unit declares the same strides)
            else:
                moved = strided(p, v, out=True) or strided(u, v, out=False)
            if moved:
                copies += 1
                nbytes += size(v)
    for v in plan.og.outputs:
        p = producer.get(v)
        if p is not None and strided(p, v, out=True):
            copies += 1
            nbytes += size(v)
    return Boundaries(values, copies, nbytes)


def _source_ops(og: OnnxGraph, nodes: Sequence[ONode]) -> list[str]:
    return [op for n in nodes for _, op in n.origin()]

"""A region unit (plan_regions.py) at the session's ``precision`` (precision.py).

With fp16 / bf16 each region's graph is converted before it is chosen (so both sides are
timed in that type and its verdict is keyed apart), unless the region would overflow --
judged on one float32 run of the unit's pieces op by op on sample inputs, which is also the
reference the finished unit's accuracy is stated against in the report; tf32 builds with
TF32 allowed. Here: the conversion (``reduce``), that float32 run (``observe``) and the
report's line on the outcome (``state``); the unit keeps the bookkeeping they fill
(``kept_fp32``, its converted graphs' keys and their float32 originals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fusegraph.graph.graph import Graph
from fusegraph.onnx import region_pieces
from fusegraph.onnx.precision import accuracy, convert, max_abs, refusal, tf32_allowed
from fusegraph.onnx.region_pieces import Cut, Piece
from fusegraph.onnx.region_values import declared as _declared
from fusegraph.onnx.region_values import random_laid_out
from fusegraph.regions.split import Region

if TYPE_CHECKING:
    from fusegraph.onnx.plan_regions import RegionUnit


def reduce(unit: RegionUnit, regions: list[Region], cuts: list[Cut]) -> tuple[list[Region], list[Cut]]:
    """Regions and cuts in the reduced type, except those that would overflow (kept
    float32, the reason in ``kept_fp32``); observed on one float32 run (``observe``)."""
    dtype = unit.precision.reduced
    assert dtype is not None
    observed = observe(unit, [(r.nodes, r.graph, r.inputs, r.outputs) for r in regions]
                       + [(c.nodes, c.graph, c.inputs, c.outputs) for c in cuts])

    def reduced(nodes: tuple[str, ...], graph: Graph, ins: tuple[str, ...], outs: tuple[str, ...]) -> Graph | None:
        why = refusal(graph, ins, outs, observed, unit.precision, unit.graph, unit.origin)
        if not why:
            try:
                g = convert(graph, dtype)
            except Exception as exc:
                why = f"its graph does not validate in {dtype.value}: {type(exc).__name__}: {exc}"
            else:
                unit._reduced.add(g.key())
                unit._fp32[nodes] = graph
                return g
        unit.kept_fp32[nodes] = why
        return None

    out_r = []
    for r in regions:
        g = reduced(r.nodes, r.graph, r.inputs, r.outputs)
        out_r.append(r if g is None else dataclasses.replace(r, graph=g, key=g.key()))
    out_c = []
    for c in cuts:
        g = reduced(c.nodes, c.graph, c.inputs, c.outputs)
        out_c.append(c if g is None else dataclasses.replace(c, graph=g))
    return out_r, out_c


def observe(unit: RegionUnit, items: Sequence[tuple[tuple[str, ...], Graph, tuple[str, ...], tuple[str, ...]]]) -> dict[str, float]:
    """The largest magnitude of every tensor crossing a piece (weights included) on one
    float32 run of the pieces op by op on PyTorch over sample inputs; the unit's outputs
    of that run are kept as the reference its reduced plan is measured against."""
    import torch

    gen = torch.Generator(device=unit._device).manual_seed(0)
    feed = {t.name: random_laid_out(t, unit._device, gen) for t in unit._in.values()}
    env: dict[str, Any] = {**unit._weights_dev, **feed}
    shells = [Piece(n, g, i, o, None, "", "", "") for n, g, i, o in items]  # type: ignore[arg-type]
    with tf32_allowed(False, force=True):
        for k in region_pieces.run_order(shells, unit.graph):
            p = shells[k]
            res = unit._eager(p.graph, tf32=False).execute({f"in{i}": env[name] for i, name in enumerate(p.inputs)})
            for j, name in enumerate(p.outputs):
                env[name] = res[f"out{j}"]
    unit._sample = feed
    unit._reference = {tname: env[tname] for tname in unit._out.values()}
    return {name: max_abs(v) for name, v in env.items()}


def state(unit: RegionUnit, n: int) -> None:
    """The report's line on the precision: how many regions took it, and (fp16 / bf16)
    the finished unit against its float32 path on the sample inputs."""
    p = unit.precision
    if p.tf32:
        unit.precision_note = (f"precision tf32: torch's TF32 flags on while the unit runs; {unit._tf32_regions}/{n} "
                               "regions built with an engine's tf32 knob (cudnn's, or the torch engine's for its "
                               "float32 convolutions / matmuls / attention; the incumbent runs at tf32 too)")
        if not unit.handle.device.is_gpu:
            unit.precision_note += "; no effect on the CPU"
    if unit._sample is None or unit._reference is None:
        return
    import torch

    assert unit.plan is not None
    with torch.inference_mode(), tf32_allowed(p.tf32):
        got = unit.plan.execute(unit._sample)
    got = {k: _declared(v, unit.graph.tensor_by_name(k)) for k, v in got.items()}
    acc = accuracy(got, unit._reference)
    kept = len(unit.kept_fp32)
    if p.tf32:
        unit.precision_note += f"; {acc.describe()}"
    else:
        unit.precision_note = f"precision {p.name}: {n - kept}/{n} regions in {p.name}" + (
            f", {kept} kept float32 (see their rows)" if kept else "") + f"; {acc.describe()}"
    unit.accuracy = acc
    unit._sample = unit._reference = None


__all__ = ["observe", "reduce", "state"]

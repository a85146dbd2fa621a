"""A region unit's plan rebuilt by its background upgrade (region_upgrade.py runs the thread
and the gate): the deferred regions chosen, the plan rebuilt with the new choices and swapped
in between two of the user's runs, captured there, then the kept plans' compiled code
packaged for later processes. The unit (plan_regions.py) sets this up in ``build`` -- its
pending pieces in ``_later`` -- and starts it after its first run (``_start_upgrade``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fusegraph.onnx import region_precision
from fusegraph.onnx.precision import tf32_allowed
from fusegraph.onnx.region_pieces import Piece
from fusegraph.onnx.region_values import random_laid_out
from fusegraph.onnx.units import engine_cache
from fusegraph.regions.plan import RegionPlan

if TYPE_CHECKING:
    from fusegraph.onnx.plan_regions import RegionUnit

log = logging.getLogger("fusegraph.onnx")


def choose_later(unit: RegionUnit, cancel: Any) -> None:
    """The background thread's work: each deferred region chosen (built, checked and
    measured, its verdict stored); the plan rebuilt with the new choices, swapped in and
    captured between two runs; then the kept plans' compiled code packaged for later
    processes. Stops after the region at hand where ``cancel`` is set."""
    import torch

    from fusegraph.engines.cuda_capture import postponed

    assert unit._later is not None
    pieces, order, steps = unit._later
    regions = list(unit._deferred.values())
    # No plan captures a CUDA graph on this thread while the user's runs go on: a capture
    # makes a device-wide synchronize on any other thread fail. (The user's thread captured
    # the incumbent plan at its first run, before this thread started, and only replays.)
    with engine_cache(unit.cache_dir), torch.inference_mode(), postponed():
        choices = unit.chooser.choose_all(regions, unit._example, stop=cancel.is_set)
        if len(choices) < len(regions):
            log.info("%s: background choice stopped with %d of %d regions chosen (their verdicts are kept)",
                     unit.name, len(choices), len(regions))
            return
        fresh = {c.region.nodes: unit._chosen(c) for c in choices}
        fresh.update(rebench(unit, (p for p in pieces if p.nodes not in fresh)))
        new_steps = list(steps)
        for k, i in enumerate(order):
            piece = fresh.get(pieces[i].nodes)
            if piece is not None:
                pieces[i] = piece
                new_steps[k] = unit._step(f"r{k}", piece)
        plan = RegionPlan(new_steps, [unit._out[o] for o in unit.outputs])
        rows = [unit._row(k, pieces[i]) for k, i in enumerate(order)]
    with unit.gate.run(), torch.inference_mode(), postponed():  # between two of the user's runs
        unit.plan, unit.rows, unit._swapped = plan, rows, True
        region_precision.state(unit, len(pieces))
        if unit.handle.device.is_gpu:  # captured here, where no run of the user's can interleave
            unit.capture_note = unit._capture(plan, sample_inputs(unit))
        unit._ran = True
    unit._weights_dev, unit._cast, unit._later = {}, {}, None
    log.info("%s: regions chosen in the background: %s", unit.name, unit.engine_name)
    with engine_cache(unit.cache_dir), torch.inference_mode(), postponed():
        for piece in fresh.values():  # the user's thread only replays now: nothing of it is captured
            if cancel.is_set():
                return
            if piece.where.startswith("fusegraph:"):
                kept = piece.plan.persist()
                if kept:
                    log.info("%s: %s: %s", unit.name, piece.pattern, kept)


def rebench(unit: RegionUnit, pieces: Iterable[Piece]) -> dict[tuple[str, ...], Piece]:
    """The provisional pieces (built with ``cudnn_benchmark=False`` by the unit's ``_pieces``)
    rebuilt to time cuDNN's algorithms, each run once here between two of the user's runs, so
    that the timing happens on this thread rather than in the run or the capture that swaps
    the upgraded plan in."""
    import torch

    out: dict[tuple[str, ...], Piece] = {}
    for piece in pieces:
        if ("cudnn_benchmark", False) not in piece.plan.config.knobs:
            continue
        try:
            plan = unit._eager(piece.graph)
            pack = unit._pack(piece.graph, piece.inputs)
            with unit.gate.measure(), tf32_allowed(unit.precision.tf32):
                plan.execute(pack)
                torch.cuda.synchronize(unit._device)
        except Exception as exc:  # the untimed piece ran already: it stays rather than the upgrade failing
            log.info("%s: %s kept untimed: %s: %s", unit.name, piece.pattern or "piece", type(exc).__name__, exc)
            continue
        out[piece.nodes] = dataclasses.replace(piece, plan=plan)
    return out


def sample_inputs(unit: RegionUnit, gen: Any = None) -> dict[str, Any]:
    """Random inputs of the unit's declared shapes and layouts (what a capture runs on)."""
    return {t.name: random_laid_out(t, unit._device, gen) for t in unit._in.values()}


__all__ = ["choose_later", "rebench", "sample_inputs"]

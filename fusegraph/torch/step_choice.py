"""Where a Dynamo graph's way of running is chosen among Inductor's own compile, eager and
fusegraph's trace: by its step timed at compile time (step_floor.py), then, where that
leaves more than one side close and the step has a backward, on the user's own training
steps (loop_trial.py); in a piece of DDP's graph split, whose first call is fake, both wait
for real calls (ddp_split.py). compile_backend.py asks here and nowhere else."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusegraph.regions.verdicts import Verdict
from fusegraph.torch import ddp_split, loop_trial, step_floor
from fusegraph.torch.ddp_split import DEFERRED, Deferred
from fusegraph.torch.loop_trial import LOOPED, Piece
from fusegraph.torch.step_floor import Settled


def settle(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compile_own: Callable[[], Callable[..., Any]],
           eager: Callable[..., Any], trace: Callable[..., Any] | None = None, *, margin: float,
           warmup_s: float, samples: int = loop_trial.SAMPLES,
           record: Callable[[Verdict], None] | None = None,
           graphed: Callable[[], Callable[..., Any]] | None = None) -> Settled:
    """The side chosen and what runs the graph (step_floor.settle's arguments; ``samples``:
    the loop's steps timed per side, 0 for the compile-time check alone; ``graphed``:
    Inductor's own compile in CUDA graphs, compiled where the check finds it may win). Where ``fn`` is
    still choosing (``pending``), its verdict is stored through ``record`` once taken; the
    verdict returned is the compile-time check's, or None (not taken yet, or not at all)."""
    sides = 3 if trace is not None else 2
    if step_floor.fakified_first_call() and step_floor.why_not(gm, example_inputs, sides) == step_floor.FAKIFIED:
        return ddp_split.defer(compile_own, eager, trace, margin=margin, warmup_s=warmup_s, samples=samples,
                               record=record)
    settled = step_floor.settle(gm, example_inputs, compile_own, eager, trace, margin=margin, warmup_s=warmup_s,
                                graphed=graphed)
    if settled.check is None:
        return settled
    fn = loop_trial.weigh(settled.candidates, settled.check, margin=margin, samples=samples, record=record)
    return dataclasses.replace(settled, fn=fn)


def pending(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` still chooses on real calls (its verdict is stored when it does)."""
    return isinstance(fn, Piece)


def later(fn: Callable[..., Any]) -> str:
    """What a report row adds where the choice is taken on real calls ('' where it was not)."""
    if isinstance(fn, Deferred):
        return f"; {DEFERRED}"
    return f"; {LOOPED}" if isinstance(fn, Piece) else ""

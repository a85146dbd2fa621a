"""Where a ``torch.compile`` under the backend spends its time, by phase: a cold compile
took 1.1-2.2x Inductor's on an H200 (issue 23's target is "no longer than Inductor's"),
and which phase to cut can only be read off a breakdown measured on that machine.

    with compile_phases() as seconds:
        loss = compiled(x).sum(); loss.backward()
    print(seconds)  # {"first pass": 2.1, "region floor": 1.7, ...}

Phases nest (the region floor runs inside the first pass), so the numbers are inclusive and
do not add up to the compile. Collectors are open in any thread: the region floor runs in a
thread of its own (partition.py), as autograd's device thread compiles a CUDA backward."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

FIRST_PASS = "first pass (AOTAutograd trace, conversion, region floor)"
REGION_FLOOR = "region floor"
SCREEN = "region floor: screen against eager"
INCUMBENT = "region floor: Inductor compiles of regions"
BUILDS = "region floor: fusegraph plan builds"
GRAPH_CHECK = "ATen-graph check"
OWN = "Inductor's own compile"
STEP_TIMING = "step check: timing"

_OPEN: list[dict[str, float]] = []  # the collectors of the blocks now open


@contextlib.contextmanager
def compile_phases() -> Iterator[dict[str, float]]:
    """Seconds per phase (inclusive) of every compile inside the block."""
    seconds: dict[str, float] = {}
    _OPEN.append(seconds)
    try:
        yield seconds
    finally:
        _OPEN.remove(seconds)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Adds the block's wall time to ``name`` in every open collector (none open: nothing)."""
    if not _OPEN:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - t0
        for seconds in list(_OPEN):
            seconds[name] = seconds.get(name, 0.0) + spent

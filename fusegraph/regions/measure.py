"""One region, fusegraph's plan against the incumbent, timed side by side with the
project's one timing routine (select/timing.py: warm-up until steady, interleaved rounds,
medians). The incumbent is always a candidate and wins ties: fusegraph's plan is kept
only where its median beats the incumbent's by ``margin`` (a fraction), because a region
handed to fusegraph costs a graph break, its launches and its memory, and a win inside
the noise is no win."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fusegraph.regions.verdicts import Verdict
from fusegraph.select import timing

MARGIN = 0.03  # fusegraph must be at least 3% faster to take a region over

Timer = Callable[..., Mapping[str, timing.Timing]]


def measure(
    fusegraph_call: Callable[[], object],
    incumbent_call: Callable[[], object],
    *,
    incumbent: str,
    engine: str,
    margin: float = MARGIN,
    sync: Callable[[], None] | None = None,
    timer: Timer | None = None,
    **timing_options: Any,
) -> Verdict:
    """The verdict for one region. ``timer`` defaults to ``timing.time_candidates`` (tests
    pass its virtual clock through ``timing_options``); a fusegraph call that raises loses
    (refused, with the error), an incumbent that raises leaves fusegraph the region."""
    errors: dict[str, Exception] = {}
    run = timer or timing.time_candidates
    timings = run(
        {"incumbent": incumbent_call, "fusegraph": fusegraph_call},
        sync=sync,
        on_error=lambda name, exc: errors.__setitem__(name, exc),
        **timing_options,
    )
    if "fusegraph" not in timings:
        exc = errors.get("fusegraph")
        return Verdict(False, "refused", f"fusegraph's plan failed when timed: {type(exc).__name__}: {exc}",
                       engine, incumbent=incumbent)
    fg_ms = timings["fusegraph"].median_ms
    if "incumbent" not in timings:
        exc = errors.get("incumbent")
        return Verdict(True, "measured", f"the incumbent failed when timed: {type(exc).__name__}: {exc}",
                       engine, fg_ms, None, incumbent)
    inc_ms = timings["incumbent"].median_ms
    winner = timing.fastest(timings, order=["incumbent", "fusegraph"], tie_margin=margin)
    keep = winner == "fusegraph"
    ratio = inc_ms / fg_ms if fg_ms > 0 else float("inf")
    why = (f"{ratio:.2f}x the incumbent" + ("" if keep else f" (needs > {1 + margin:.2f}x)"))
    return Verdict(keep, "measured", why, engine, fg_ms, inc_ms, incumbent)

"""`fusegraph tune show` stars the fastest measurement (and names the chosen config when it
is another one)."""

from __future__ import annotations

from fusegraph.engines.base import EngineConfig
from fusegraph.select.autotune import format_entry
from fusegraph.select.tuning_db import Measurement, TuningEntry


def test_star_marks_the_chosen_row_and_a_tie_says_why() -> None:
    """docs/engines.md: the star is the stored choice; where that is not the fastest (a tie
    within the margin, going to the heuristic's earlier config), both rows say so."""
    first, fast, broken = EngineConfig("iree"), EngineConfig("torch"), EngineConfig("reference")
    entry = TuningEntry(
        graph_key="k" * 32, graph_name="g", device="cpu", versions={}, chosen=first,
        measurements=[
            Measurement(first, "ok", median_ms=1.015, runs=5, build_s=0.1, rel_error=1e-7),
            Measurement(broken, "build_failed", detail="no"),
            Measurement(fast, "ok", median_ms=1.0, runs=5, build_s=0.1, rel_error=1e-7),
            Measurement(EngineConfig("torch", (("threads", 1),)), "skipped", detail="budget of 1s spent"),
            Measurement(EngineConfig("torch", (("threads", 2),)), "skipped", detail="budget of 1s spent"),
        ],
    )
    rows = format_entry(entry).splitlines()[1:]
    starred = [r for r in rows if r.startswith(" *")]
    assert len(starred) == 1 and " iree " in starred[0], rows
    assert "<- chosen: 1.5% over the fastest, within the tie margin" in starred[0], rows
    fastest = [r for r in rows if "<- fastest" in r]
    assert len(fastest) == 1 and " torch " in fastest[0], rows
    assert rows[-1].strip() == "2 more configs not built: budget of 1s spent", rows
    entry.chosen = fast  # the usual case: the fastest is chosen, no notes
    rows = format_entry(entry).splitlines()[1:]
    assert " torch " in next(r for r in rows if r.startswith(" *")) and "<-" not in "".join(rows)

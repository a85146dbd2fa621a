"""`fusegraph tune show` stars the fastest measurement (and names the chosen config when it
is another one)."""

from __future__ import annotations

from fusegraph.engines.base import EngineConfig
from fusegraph.select.autotune import format_entry
from fusegraph.select.tuning_db import Measurement, TuningEntry


def test_star_marks_the_fastest_row() -> None:
    slow, fast, broken = EngineConfig("iree"), EngineConfig("torch"), EngineConfig("reference")
    entry = TuningEntry(
        graph_key="k" * 32, graph_name="g", device="cpu", versions={}, chosen=slow,
        measurements=[
            Measurement(slow, "ok", median_ms=2.0, runs=5, build_s=0.1, rel_error=1e-7),
            Measurement(broken, "build_failed", detail="no"),
            Measurement(fast, "ok", median_ms=1.0, runs=5, build_s=0.1, rel_error=1e-7),
        ],
    )
    rows = format_entry(entry).splitlines()[1:]
    starred = [r for r in rows if r.startswith(" *")]
    assert len(starred) == 1 and " torch " in starred[0], rows
    chosen = [r for r in rows if "<- chosen" in r]
    assert len(chosen) == 1 and " iree " in chosen[0], rows

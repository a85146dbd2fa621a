"""Which side won a region, kept on disk: keyed by the region's content key, the device
(select/device_id.py), the incumbent's name and every library version a timing depends on
(select/tuning_db.engine_versions: fusegraph, each engine and its libraries), so that a new
fusegraph, engine, torch or GPU measures again and nothing else does. The measurements are
kept with the verdict, so a report read months later still says why.

One JSON table in the cache directory (``regions-verdicts.json``), read once per store and
written back under its lock (runtime/cache_dir.py: atomic writes, concurrent writers keep
each other's entries). ``FUSEGRAPH_CACHE=0`` turns it off like every other cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusegraph.runtime.cache_dir import cache_enabled, cache_root, read_table, update_table

log = logging.getLogger("fusegraph.regions")

FILE = "regions-verdicts.json"
# What a verdict's measurement means; part of every key, so verdicts measured the old way are
# never read back. 2: torch.compile's regions timed through their call in the graph (the op
# ``fusegraph::region``, host cost included), no longer as the plan alone. 3: on a GPU the
# torch front door's regions run on kernel engines only, their border reshapes folded.
KEY_VERSION = 3


@dataclass(frozen=True)
class Verdict:
    """Who runs a region. ``fusegraph``: fusegraph's plan (on ``engine``) runs it; else the
    incumbent does. ``source``: "measured" (timed side by side), "claimed" (the floor was
    off: fusegraph runs it unmeasured), "refused" (fusegraph cannot run it: ``why``),
    "cached" (a measured verdict read back), "unmeasured" (the floor's budget was spent: the
    incumbent runs it until a later session measures it; never stored), "concluded" (drawn
    from measured and cached verdicts: a torch Dynamo graph in which no region was kept)."""

    fusegraph: bool
    source: str
    why: str = ""
    engine: str = ""
    fusegraph_ms: float | None = None
    incumbent_ms: float | None = None
    incumbent: str = ""

    def describe(self) -> str:
        side = f"fusegraph ({self.engine})" if self.fusegraph else (self.incumbent or "incumbent")
        parts = [f"{side}: {self.source}"]
        if self.fusegraph_ms is not None and self.incumbent_ms is not None:
            parts.append(f"fusegraph {self.fusegraph_ms:.4f} ms vs {self.incumbent or 'incumbent'} "
                         f"{self.incumbent_ms:.4f} ms")
        if self.why:
            parts.append(self.why)
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(entry: Any) -> Verdict | None:
        """A verdict from its table entry; None for anything malformed (treated as absent)."""
        if not isinstance(entry, dict):
            return None
        try:
            v = Verdict(**{f.name: entry[f.name] for f in dataclasses.fields(Verdict) if f.name in entry})
        except TypeError:
            return None
        if not isinstance(v.fusegraph, bool) or not isinstance(v.source, str):
            return None
        return v


def verdict_key(region_key: str, device: str, incumbent: str, versions: Mapping[str, str],
                settings: Mapping[str, Any] | None = None) -> str:
    """The table key: everything a verdict depends on, hashed."""
    text = json.dumps(
        {"version": KEY_VERSION, "region": region_key, "device": device, "incumbent": incumbent, "versions": dict(versions),
         "settings": dict(settings or {})},
        sort_keys=True, separators=(",", ":"), default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


class VerdictStore:
    """The verdict table: ``lookup`` reads it once, ``record`` keeps measured verdicts in
    memory, ``flush`` writes them back (one locked read-modify-write)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.path = (Path(directory) if directory else cache_root()) / FILE
        self.enabled = cache_enabled()
        self._table: dict[str, Any] | None = None
        self._dirty: dict[str, Any] = {}

    def lookup(self, key: str) -> Verdict | None:
        if not self.enabled:
            return None
        if key in self._dirty:
            return Verdict.from_json(self._dirty[key])
        if self._table is None:
            self._table = read_table(self.path)
        found = Verdict.from_json(self._table.get(key))
        return dataclasses.replace(found, source="cached") if found is not None else None

    def record(self, key: str, verdict: Verdict) -> None:
        """Only measured (or concluded) verdicts are kept: a claim without measuring or a
        refusal says nothing a later run could reuse."""
        if self.enabled and verdict.source in ("measured", "concluded"):
            self._dirty[key] = verdict.to_json()

    def flush(self) -> None:
        if not self._dirty:
            return
        dirty = dict(self._dirty)
        try:
            table = update_table(self.path, lambda t: t.update(dirty))
            self._table, self._dirty = table, {}
        except OSError as exc:
            log.info("could not record region verdicts in %s: %s", self.path, exc)

"""The tuning database: what autotuning measured and chose, so later builds need no timing.

One JSON file, ``<cache dir>/tuning/tuning.json`` (cache dir: ``FUSEGRAPH_CACHE_DIR``, else
the platform's user cache dir). An entry is keyed by graph key + device identity +
versions (fusegraph, and every available engine with its libraries): any version change
gives a new key, so old timings are never used; the stale entry stays visible to
``fusegraph tune show`` until the graph is tuned again or ``fusegraph tune clear`` runs.
Writes are atomic (temporary file + fsync + rename) under an advisory file lock; a torn or
foreign file reads as empty; an unwritable location warns once and tuning runs unrecorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusegraph import __version__
from fusegraph.engines.base import Engine, EngineConfig, distribution_version
from fusegraph.runtime.cache_dir import atomic_write_bytes, cache_root, file_lock, warn_unavailable

log = logging.getLogger("fusegraph.select")

FORMAT = "fusegraph.tuning"
VERSION = 1


def cache_dir() -> Path:
    return cache_root()


def default_path() -> Path:
    return cache_dir() / "tuning" / "tuning.json"


# Python distributions whose version decides an engine's speed (beyond the engine's own).
_DISTRIBUTIONS = {"iree": ("iree-base-compiler", "iree-base-runtime"), "torch": ("torch",)}


def engine_versions(engines: Sequence[Engine]) -> dict[str, str]:
    """What a timing depends on: fusegraph and each engine with its libraries."""
    from importlib import metadata

    out = {"fusegraph": __version__}
    for e in sorted(engines, key=lambda e: e.name):
        out[f"engine:{e.name}"] = str(e.version)
        libs = getattr(e, "library_versions", None)
        if callable(libs):
            with contextlib.suppress(Exception):
                for k, v in dict(libs()).items():
                    out[f"lib:{k}"] = str(v)
        for dist in _DISTRIBUTIONS.get(e.name, ()):
            with contextlib.suppress(metadata.PackageNotFoundError):
                out[f"lib:{dist}"] = distribution_version(dist)
    return out


def _freeze(v: Any) -> Any:
    """JSON lists back to tuples, so configs stay hashable."""
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def config_to_json(c: EngineConfig) -> dict[str, Any]:
    return {"engine": c.engine, "knobs": [[k, v] for k, v in c.knobs]}


def config_from_json(d: dict[str, Any]) -> EngineConfig:
    return EngineConfig(str(d["engine"]), tuple((str(k), _freeze(v)) for k, v in d.get("knobs", [])))


@dataclass
class Measurement:
    """One timed (engine, config): status "ok", "mismatch", "build_failed", "run_failed",
    "unsupported" or "skipped" (budget spent)."""

    config: EngineConfig
    status: str
    median_ms: float | None = None
    min_ms: float | None = None
    runs: int = 0
    build_s: float | None = None
    rel_error: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = config_to_json(self.config)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Measurement:
        d = dict(d)
        d["config"] = config_from_json(d["config"])
        return Measurement(**d)


@dataclass
class TuningEntry:
    graph_key: str
    graph_name: str
    device: str
    versions: dict[str, str]
    chosen: EngineConfig
    measurements: list[Measurement] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    elapsed_s: float = 0.0
    budget_s: float = 0.0

    @property
    def key(self) -> str:
        return entry_key(self.graph_key, self.device, self.versions)

    def to_json(self) -> dict[str, Any]:
        return {
            "graph_key": self.graph_key,
            "graph_name": self.graph_name,
            "device": self.device,
            "versions": dict(self.versions),
            "chosen": config_to_json(self.chosen),
            "measurements": [m.to_json() for m in self.measurements],
            "created": self.created,
            "elapsed_s": self.elapsed_s,
            "budget_s": self.budget_s,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> TuningEntry:
        return TuningEntry(
            graph_key=d["graph_key"],
            graph_name=d.get("graph_name", ""),
            device=d["device"],
            versions=dict(d["versions"]),
            chosen=config_from_json(d["chosen"]),
            measurements=[Measurement.from_json(m) for m in d.get("measurements", [])],
            created=float(d.get("created", 0.0)),
            elapsed_s=float(d.get("elapsed_s", 0.0)),
            budget_s=float(d.get("budget_s", 0.0)),
        )


def entry_key(graph_key: str, device: str, versions: dict[str, str]) -> str:
    fingerprint = json.dumps(versions, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{device}\n{fingerprint}".encode()).hexdigest()[:16]
    return f"{graph_key}:{digest}"


class TuningDB:
    """The JSON file behind autotuning; reads are cached until the file changes."""

    def __init__(self, path: Path | str | None = None) -> None:
        self._path = Path(path) if path is not None else None
        self._cache: tuple[tuple[str, int, int], dict[str, Any]] | None = None

    @property
    def path(self) -> Path:
        return self._path if self._path is not None else default_path()

    # -- reading ----------------------------------------------------------------------------
    def _read(self) -> dict[str, Any]:
        p = self.path
        try:
            st = p.stat()
        except OSError:  # missing, or a file where a directory should be
            return {}
        stamp = (str(p), st.st_mtime_ns, st.st_size)
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            entries = {str(k): v for k, v in dict(doc["entries"]).items() if isinstance(v, dict)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("tuning database %s is unreadable (%s); ignoring it (it is rewritten on the next tune)", p, exc)
            entries = {}
        self._cache = (stamp, entries)
        return entries

    def entries(self) -> list[TuningEntry]:
        out = []
        for raw in self._read().values():
            try:
                out.append(TuningEntry.from_json(raw))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("skipping a malformed tuning entry: %s", exc)
        return out

    def lookup(self, graph_key: str, device: str, versions: dict[str, str]) -> TuningEntry | None:
        raw = self._read().get(entry_key(graph_key, device, versions))
        if raw is not None:
            try:
                return TuningEntry.from_json(raw)
            except (KeyError, TypeError, ValueError):
                return None
        for e in self.stale(graph_key, device, versions):
            changed = sorted(
                f"{k}: {e.versions.get(k, '-')} -> {versions.get(k, '-')}"
                for k in set(e.versions) | set(versions)
                if e.versions.get(k) != versions.get(k)
            )
            log.info("tuning entry for graph %s on %s is stale (%s); using heuristics", graph_key[:12], device, "; ".join(changed))
        return None

    def stale(self, graph_key: str, device: str, versions: dict[str, str]) -> list[TuningEntry]:
        """Entries of this graph and device measured under other versions."""
        return [
            e for e in self.entries()
            if e.graph_key == graph_key and e.device == device and e.versions != versions
        ]

    # -- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with file_lock(self.path.with_suffix(".lock")):
            yield

    def _write(self, entries: dict[str, Any]) -> None:
        doc = {"format": FORMAT, "version": VERSION, "entries": entries}
        atomic_write_bytes(self.path, json.dumps(doc, indent=1, sort_keys=True).encode("utf-8"))
        self._cache = None

    def put(self, entry: TuningEntry) -> None:
        """Stores an entry, replacing this graph's entries on this device (stale ones too).
        A location that cannot be written (read-only, full, a file) is warned about once and
        the entry is not kept: tuning still returns its choice."""
        try:
            self._put(entry)
        except OSError as exc:
            warn_unavailable(self.path.parent, exc)

    def _put(self, entry: TuningEntry) -> None:
        with self._locked():
            self._cache = None
            entries = dict(self._read())
            for k, raw in list(entries.items()):
                if raw.get("graph_key") == entry.graph_key and raw.get("device") == entry.device:
                    del entries[k]
            entries[entry.key] = entry.to_json()
            self._write(entries)

    def clear(self, graph_key: str | None = None) -> int:
        """Removes every entry (or those of one graph key, a prefix is enough); returns how many."""
        with self._locked():
            self._cache = None
            entries = dict(self._read())
            keep = {
                k: v for k, v in entries.items()
                if graph_key is not None and not str(v.get("graph_key", "")).startswith(graph_key)
            }
            removed = len(entries) - len(keep)
            if removed or not self.path.exists():
                self._write(keep)
            return removed


_DEFAULT: dict[str, TuningDB] = {}


def default_db() -> TuningDB:
    """The process's database at the default path (re-resolved when FUSEGRAPH_CACHE_DIR changes)."""
    path = str(default_path())
    if path not in _DEFAULT:
        _DEFAULT[path] = TuningDB(path)
    return _DEFAULT[path]

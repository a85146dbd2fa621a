"""Which engine, config and filter packing won the autotuning of a claimed subgraph.

Each engine is tuned on its own filter packing, so the engine layer's tuning database
(keyed by the graph, whose strides differ per packing) cannot record the choice *between*
engines. This small JSON file does: keyed by the subgraph's canonical graph key (as
lowered before packing for any engine), the device and the fusegraph version, it holds
the winner, and later sessions build it directly without tuning again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusegraph import __version__
from fusegraph.engines.base import EngineConfig
from fusegraph.runtime.cache_dir import cache_root, read_table, update_table

log = logging.getLogger("fusegraph.onnx")

FILE = "onnx-choices.json"


@dataclass(frozen=True)
class Choice:
    config: EngineConfig
    filter_layout: str
    median_ms: float


def _root(cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir else cache_root()


def _key(graph_key: str, device: str) -> str:
    return f"{graph_key}|{device}|{__version__}"


def _tuple(v: Any) -> Any:
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


def lookup(cache_dir: str | None, graph_key: str, device: str) -> Choice | None:
    entry = read_table(_root(cache_dir) / FILE).get(_key(graph_key, device))
    if not isinstance(entry, dict):
        return None
    try:
        knobs = tuple(sorted((str(k), _tuple(v)) for k, v in entry["knobs"].items()))
        return Choice(EngineConfig(str(entry["engine"]), knobs), str(entry["filter_layout"]), float(entry["median_ms"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def record(cache_dir: str | None, graph_key: str, device: str, choice: Choice) -> None:
    root = _root(cache_dir)
    try:
        entry = {
            "engine": choice.config.engine,
            "knobs": dict(choice.config.knobs),
            "filter_layout": choice.filter_layout,
            "median_ms": choice.median_ms,
        }
        # under the table's lock: two sessions recording at once keep both entries
        update_table(root / FILE, lambda table: table.__setitem__(_key(graph_key, device), entry))
    except OSError as exc:
        log.info("could not record the tuned choice in %s: %s", root, exc)

"""Built cuDNN plans kept on disk, so that a new process builds a known graph without
cuDNN's heuristics query and kernel compilation: ``<cache dir>/cudnn/<key>.plan``, keyed by
the graph key, the engine config, the GPU and the library versions."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import atomic_write_bytes, cache_enabled, cache_root

log = logging.getLogger("fusegraph.engines.cudnn")


def plan_key(graph_key: str, config: str, device: str, versions: Mapping[str, str]) -> str:
    text = "|".join([graph_key, config, device, *(f"{k}={v}" for k, v in sorted(versions.items()))])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_root() / "cudnn" / f"{key}.plan"


def load(key: str) -> bytes | None:
    if not cache_enabled():
        return None
    path = _path(key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    cache_limit.touch(path)
    return data


def save(key: str, data: bytes) -> None:
    """Atomic (a reader never sees half a plan); failures are logged, never raised."""
    if not cache_enabled():
        return
    path = _path(key)
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        log.warning("could not store the cuDNN plan in %s: %s", path, exc)
        return
    cache_limit.enforce(keep=[path])


def forget(key: str) -> None:
    with contextlib.suppress(OSError):
        _path(key).unlink()

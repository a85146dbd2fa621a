"""One size limit for everything fusegraph compiles into its cache directory, least recently
used out first.

Why one limit over every store: the compiled artifacts are what grows -- IREE modules,
cuDNN plans, AOTInductor packages (tens of MB per model), the ONNX provider's tier modules,
OpenVINO's compiled models -- and a user sets one number for the directory
(``fusegraph cache limit``), not one per engine. After any store writes an artifact it calls
:func:`enforce`, which removes the least recently used artifacts of every store (by mtime;
readers :func:`touch` what they load) until the total fits, never the one just written.
Tables (the tuning database, verdicts) and kept compile-failure reproducers are not
artifacts: small, and worth more than their bytes.

A directory artifact (an IREE entry) is renamed aside before it is removed, so a reader
sees it whole or not at all; a file artifact goes with one unlink, and every reader treats
a missing artifact as a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusegraph.runtime.cache_dir import cache_root, file_lock, read_table, update_table

log = logging.getLogger("fusegraph.runtime.cache")

LIMITS = "limits.json"
DEFAULT_MAX_BYTES = 2 * 1024**3
LOCK = ".evict.lock"


@dataclass(frozen=True)
class Store:
    """Where one kind of artifact lives under the cache directory."""

    name: str
    pattern: str  # glob relative to the cache directory
    is_dir: bool = False  # an artifact is a directory (its files' sizes summed)


STORES: tuple[Store, ...] = (
    Store("iree", "iree/*/*", is_dir=True),
    Store("cudnn", "cudnn/*.plan"),
    Store("torch-aoti", "torch-aoti/*.pt2"),
    Store("onnx-tier", "onnx-tier/*.vmfb"),
    Store("openvino", "openvino/*"),
    Store("onnx-specialized", "onnx-specialized/*.fgspec"),
)


@dataclass(frozen=True)
class Artifact:
    store: str
    path: Path
    size: int
    mtime: float


def limit(root: Path | None = None) -> int:
    """The most bytes the artifacts may take (``limits.json``, else the default)."""
    value = read_table((root or cache_root()) / LIMITS).get("max_bytes", DEFAULT_MAX_BYTES)
    return int(value) if isinstance(value, int) and value >= 0 else DEFAULT_MAX_BYTES


def set_limit(max_bytes: int | None, root: Path | None = None,
              removed_hook: Callable[[Artifact], None] | None = None) -> int:
    """Sets (None: back to the default) the limit, evicts down to it; returns how many went
    (``removed_hook`` sees each)."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"a cache size limit must be >= 0 bytes, not {max_bytes}")

    def change(t: dict[str, Any]) -> None:
        if max_bytes is None:
            t.pop("max_bytes", None)
        else:
            t["max_bytes"] = int(max_bytes)

    root = root or cache_root()
    update_table(root / LIMITS, change)
    return len(enforce(root, removed_hook=removed_hook))


def artifacts(root: Path | None = None) -> list[Artifact]:
    """Every artifact of every store (temporary files and directories, named with a leading
    dot, are a writer's and not counted)."""
    root = root or cache_root()
    out: list[Artifact] = []
    for store in STORES:
        for p in root.glob(store.pattern):
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
                if store.is_dir != p.is_dir():
                    continue
                size = sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if store.is_dir else st.st_size
            except OSError:  # removed meanwhile
                continue
            out.append(Artifact(store.name, p, size, st.st_mtime))
    return out


def usage(root: Path | None = None) -> dict[str, int]:
    """Bytes per store."""
    sizes = {s.name: 0 for s in STORES}
    for a in artifacts(root):
        sizes[a.store] += a.size
    return sizes


def touch(path: Path) -> None:
    """Marks an artifact used now (its mtime), so eviction takes it last."""
    with contextlib.suppress(OSError):
        os.utime(path)


def enforce(root: Path | None = None, keep: Iterable[Path] = (),
            removed_hook: Callable[[Artifact], None] | None = None) -> list[Artifact]:
    """Removes least recently used artifacts until the total is within :func:`limit`, never
    those in ``keep``; returns what went (``removed_hook`` sees each)."""
    root = root or cache_root()
    kept = {Path(p) for p in keep}
    gone: list[Artifact] = []
    try:
        with file_lock(root / LOCK):
            cap = limit(root)
            found = artifacts(root)
            total = sum(a.size for a in found)
            for a in sorted(found, key=lambda a: a.mtime):
                if total <= cap:
                    break
                if a.path in kept:
                    continue
                if _remove(a):
                    total -= a.size
                    gone.append(a)
                    if removed_hook is not None:
                        removed_hook(a)
    except OSError as exc:
        log.info("could not evict from %s: %s", root, exc)
    if gone:
        log.info("evicted %d least recently used cache artifact(s) (limit %d bytes): %s", len(gone), limit(root),
                 ", ".join(sorted({a.store for a in gone})))
    return gone


def _remove(a: Artifact) -> bool:
    try:
        if a.path.is_dir():
            trash = a.path.with_name(f".trash-{a.path.name[:12]}-{os.getpid()}-{time.monotonic_ns()}")
            os.rename(a.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            a.path.unlink()
    except OSError:
        return False
    return True

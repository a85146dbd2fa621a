"""On-disk cache of compiled IREE modules, plus an in-memory layer over it.

Layout: ``<root>/iree/<key[:2]>/<key>/`` holding ``module.vmfb``, ``module.mlir``,
``flags.txt``, ``command.sh`` (the exact iree-compile command that reproduces the
module), ``stats.json`` (IREE's scheduling statistics: dispatch count...), ``graph.json``
and ``manifest.json`` (sizes and sha256 of every file, plus metadata). An entry is built in
a temporary directory and renamed into place, so readers never see half an entry; a
reader that finds a checksum or size mismatch warns, removes the entry and rebuilds it.

Concurrency and limits: :meth:`ModuleCache.compile_once` holds a per-key file lock
(``<root>/iree/<key[:2]>/.<key>.lock``) around "look up, else compile and store", so N
processes asking for one key compile it once. Every file is fsynced before the rename, and
a process killed mid-write leaves only a ``.tmp-*`` directory (never loaded; swept after an
hour). The cache's total size is capped (``limits.json``'s ``max_bytes``, default
``runtime/cache_limit.DEFAULT_MAX_BYTES``; ``fusegraph cache limit``), these entries together with every
other store's artifacts (``runtime/cache_limit.py``): after each store the least recently
used artifacts (mtime, touched on every hit) are removed. A location that cannot
be written (read-only, full, a file) gives one :class:`CacheUnavailableWarning` and the
engine runs uncached.

``root`` is ``platformdirs.user_cache_dir("fusegraph")``; ``FUSEGRAPH_CACHE_DIR``
overrides it and ``FUSEGRAPH_CACHE=0`` turns the cache off (compile reproducers are still
kept under ``<root>/failures/``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import (
    CacheUnavailableWarning,
    cache_enabled,
    cache_root,
    ensure_dir,
    file_lock,
    warn_unavailable,
)

log = logging.getLogger("fusegraph.iree.cache")

SCHEMA = 1
MANIFEST = "manifest.json"
VMFB = "module.vmfb"
MEMORY_ENTRIES = 256
STALE_TMP_S = 3600.0

__all__ = ["CacheCorruptionWarning", "CacheEntry", "CacheUnavailableWarning", "ModuleCache", "clear_memory"]


class CacheCorruptionWarning(RuntimeWarning):
    """A cache entry failed its checksum and is being rebuilt."""


def failures_dir() -> Path:
    return cache_root() / "failures"


@dataclass(frozen=True)
class CacheEntry:
    """A compiled module and what describes it (``meta`` is the manifest's metadata)."""

    key: str
    vmfb: bytes
    meta: Mapping[str, Any]
    path: Path | None = None
    source: str = "compiled"  # "compiled" | "memory" | "disk"

    @property
    def dispatch_count(self) -> int:
        return int(self.meta.get("statistics", {}).get("dispatch_count", -1))


class ModuleCache:
    """The cache (see the module docstring); thread-safe, cheap to construct."""

    def __init__(self, root: Path | None = None, enabled: bool | None = None) -> None:
        self._root = root
        self._enabled = enabled

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache_root()

    @property
    def enabled(self) -> bool:
        return self._enabled if self._enabled is not None else cache_enabled()

    @property
    def entries_root(self) -> Path:
        return self.root / "iree"

    def entry_dir(self, key: str) -> Path:
        return self.entries_root / key[:2] / key

    # ---- read ------------------------------------------------------------------------------
    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` from memory, else from disk (verified), else None."""
        if not self.enabled:
            return None
        hit = _MEMORY.get(key)
        if hit is not None:
            if hit.path is not None:
                _touch(hit.path)
            return CacheEntry(hit.key, hit.vmfb, hit.meta, hit.path, "memory")
        path = self.entry_dir(key)
        if not path.exists():
            return None
        try:
            entry = _read_entry(path, key)
        except _Corrupt as exc:
            if not path.exists():  # evicted or replaced by another process meanwhile: a miss
                return None
            self._discard_corrupt(path, str(exc))
            return None
        _touch(path)
        _MEMORY.put(entry)
        return entry

    def has(self, key: str) -> bool:
        """Whether an entry for ``key`` is in memory or on disk (not read nor verified: a
        stat, for questions that only need to know that the module was once compiled)."""
        if not self.enabled:
            return False
        if _MEMORY.get(key) is not None:
            return True
        try:
            return (self.entry_dir(key) / MANIFEST).is_file()
        except OSError:
            return False

    def compile_once(self, key: str, build: Callable[[], CacheEntry]) -> CacheEntry:
        """The entry for ``key``, calling ``build`` (which compiles and stores it) only
        when no process has it: a per-key file lock makes concurrent askers wait for the
        first one's compile instead of compiling too."""
        hit = self.get(key)
        if hit is not None or not self.enabled:
            return hit if hit is not None else build()
        parent = self.entry_dir(key).parent
        if not ensure_dir(parent, self.root):
            return build()
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(file_lock(parent / f".{key}.lock"))
            except OSError as exc:
                warn_unavailable(self.root, exc)
                return build()
            hit = self.get(key)
            return hit if hit is not None else build()
        raise AssertionError("unreachable")  # pragma: no cover

    def _discard_corrupt(self, path: Path, why: str) -> None:
        msg = f"fusegraph: IREE cache entry {path} is corrupt ({why}); removing it and recompiling"
        log.warning(msg)
        warnings.warn(msg, CacheCorruptionWarning, stacklevel=4)
        _remove_tree(path)

    # ---- write -----------------------------------------------------------------------------
    def put(
        self,
        key: str,
        vmfb: bytes,
        files: Mapping[str, str | bytes],
        meta: Mapping[str, Any],
    ) -> CacheEntry:
        """Stores an entry atomically (when enabled) and returns it."""
        uncached = CacheEntry(key, vmfb, dict(meta), None, "compiled")
        if not self.enabled:
            return uncached
        final = self.entry_dir(key)
        if not ensure_dir(final.parent, self.root):
            return uncached
        tmp: Path | None = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:12]}-", dir=final.parent))
            listing: dict[str, dict[str, Any]] = {}
            for name, content in {VMFB: vmfb, **files}.items():
                data = content.encode() if isinstance(content, str) else bytes(content)
                _write_synced(tmp / name, data)
                listing[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            manifest = {"schema": SCHEMA, "key": key, "created": time.time(), "files": listing, "meta": dict(meta)}
            # the manifest last: an entry without one never loads
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            if (tmp / "command.sh").exists():
                (tmp / "command.sh").chmod(0o755)
            installed = self._install(tmp, final, key)
        except OSError as exc:  # full disk, vanished directory...: keep running uncached
            warn_unavailable(self.root, exc)
            return uncached
        finally:
            if tmp is not None and tmp.exists():
                _remove_tree(tmp)
        if not installed:
            return uncached
        entry = CacheEntry(key, vmfb, dict(meta), final, "compiled")
        _MEMORY.put(entry)
        self.evict(keep=key)
        return entry

    def _install(self, tmp: Path, final: Path, key: str) -> bool:
        for _ in range(3):
            try:
                os.rename(tmp, final)
                return True
            except OSError:
                if not final.exists():
                    continue
            try:  # someone else installed it first: keep theirs if it is sound
                _read_entry(final, key)
                return True
            except _Corrupt:
                trash = final.with_name(f".trash-{key[:12]}-{os.getpid()}-{time.monotonic_ns()}")
                try:
                    os.rename(final, trash)
                except OSError:
                    continue
                _remove_tree(trash)
        log.warning("could not install cache entry %s; continuing without it", final)
        return False

    # ---- size limit ------------------------------------------------------------------------
    def limit(self) -> int:
        """The most bytes the cache's artifacts may take, these entries among them
        (``runtime/cache_limit.py``: one limit for every store)."""
        return cache_limit.limit(self.root)

    def set_limit(self, max_bytes: int | None) -> None:
        """Sets (None: resets to the default) the size limit and evicts down to it."""
        cache_limit.set_limit(max_bytes, self.root, removed_hook=_forget_evicted)

    def evict(self, keep: str | None = None) -> int:
        """Removes temporary directories older than an hour (left by killed writers), then
        the least recently used artifacts of every store until the cache is within
        :meth:`limit` (never ``keep``, the entry just stored); returns how many went."""
        root = self.entries_root
        if root.is_dir():
            now = time.time()
            for d in root.glob("*/.*"):
                try:
                    if d.is_dir() and d.name.startswith((".tmp-", ".trash-")) and now - d.stat().st_mtime > STALE_TMP_S:
                        _remove_tree(d)
                except OSError:
                    continue

        keep_paths = [self.entry_dir(keep)] if keep else []
        return len(cache_limit.enforce(self.root, keep=keep_paths, removed_hook=_forget_evicted))

    # ---- management ------------------------------------------------------------------------
    def list_entries(self) -> list[dict[str, Any]]:
        """Manifests of all entries on disk (unverified), each with its ``path`` added."""
        out: list[dict[str, Any]] = []
        if not self.entries_root.exists():
            return out
        for manifest in sorted(self.entries_root.glob(f"*/*/{MANIFEST}")):
            if manifest.parent.name.startswith("."):  # a writer's temporary directory
                continue
            try:
                data = json.loads(manifest.read_text())
            except (OSError, ValueError):
                data = {"key": manifest.parent.name, "corrupt": True}
            if not isinstance(data, dict):
                data = {"key": manifest.parent.name, "corrupt": True}
            data["path"] = str(manifest.parent)
            try:
                data["size"] = sum(p.stat().st_size for p in manifest.parent.iterdir() if p.is_file())
            except OSError:  # evicted meanwhile
                continue
            out.append(data)
        return out

    def verify(self, key: str) -> str | None:
        """None when the entry on disk is sound, else what is wrong."""
        try:
            _read_entry(self.entry_dir(key), key)
        except _Corrupt as exc:
            return str(exc)
        return None

    def clear(self, *, failures: bool = True) -> int:
        """Removes every entry (and kept failure reproducers); returns how many entries."""
        n = len(list(self.entries_root.glob(f"*/*/{MANIFEST}"))) if self.entries_root.exists() else 0
        _remove_tree(self.entries_root)
        if failures:
            _remove_tree(self.root / "failures")
        _MEMORY.clear()
        return n

    def info(self) -> dict[str, Any]:
        entries = self.list_entries()
        fails = self.root / "failures"
        return {
            "root": str(self.root),
            "enabled": self.enabled,
            "entries": len(entries),
            "bytes": sum(int(e.get("size", 0)) for e in entries),
            "failures": len(list(fails.iterdir())) if fails.is_dir() else 0,
            "max_bytes": self.limit(),
            "memory_entries": len(_MEMORY),
        }


def _forget_evicted(a: cache_limit.Artifact) -> None:
    """An IREE entry evicted from disk leaves the in-memory layer too."""
    if a.store == "iree":
        _MEMORY.drop(a.path.name)


class _Corrupt(Exception):
    pass


def _read_entry(path: Path, key: str) -> CacheEntry:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise _Corrupt("no manifest") from None
    except (OSError, ValueError) as exc:
        raise _Corrupt(f"unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or manifest.get("key") != key:
        raise _Corrupt("manifest of another schema or key")
    files = manifest.get("files", {})
    if VMFB not in files:
        raise _Corrupt("manifest lists no module")
    vmfb = b""
    for name, info in files.items():
        try:
            data = (path / name).read_bytes()
        except OSError:
            raise _Corrupt(f"{name} is missing") from None
        if len(data) != info.get("size") or hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise _Corrupt(f"{name} fails its checksum (size {len(data)}, expected {info.get('size')})")
        if name == VMFB:
            vmfb = data
    return CacheEntry(key, vmfb, manifest.get("meta", {}), path, "disk")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _touch(path: Path) -> None:
    """Marks an entry as just used (its directory's mtime orders the LRU eviction)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class _MemoryCache:
    """Process-wide LRU of compiled modules (bytes + metadata), keyed like the disk."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[str, CacheEntry] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, key: str) -> CacheEntry | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, entry: CacheEntry) -> None:
        with self._lock:
            self._items[entry.key] = entry
            self._items.move_to_end(entry.key)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def drop(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


_MEMORY = _MemoryCache(MEMORY_ENTRIES)


def clear_memory() -> None:
    """Forgets in-memory entries (the disk stays), e.g. to time a disk-cache build."""
    _MEMORY.clear()

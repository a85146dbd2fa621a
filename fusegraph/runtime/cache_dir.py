"""Where fusegraph keeps what it learns on a machine: compiled modules, tuning results,
autotune choices, oneDNN Graph verdicts. One directory, one rule for finding it.

Several processes share the directory, any of them may be killed at any moment, and the
location may turn out read-only, full, or a file. So: writers hold an advisory file lock
(``fcntl.flock``; no-op where there is none), write a temporary file, ``fsync`` it and
``os.replace`` it into place; readers treat anything unparsable as absent; and a location
that cannot be written is reported once (a :class:`CacheUnavailableWarning`) after which
fusegraph runs uncached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("fusegraph.cache")

CACHE_DIR_ENV = "FUSEGRAPH_CACHE_DIR"  # overrides the directory
CACHE_ENV = "FUSEGRAPH_CACHE"  # "0" turns the caches off


class CacheUnavailableWarning(RuntimeWarning):
    """The cache location cannot be written; fusegraph runs without it."""


def cache_root() -> Path:
    """``FUSEGRAPH_CACHE_DIR``, else the user cache directory (``platformdirs``)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusegraph"))


def cache_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


# ---- an unusable location: one warning per location and process ---------------------------
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn_unavailable(path: Path, exc: BaseException | str) -> None:
    """Says once per location that the cache there cannot be used (and why)."""
    where = str(path)
    with _WARNED_LOCK:
        if where in _WARNED:
            log.debug("cache location %s still unusable: %s", where, exc)
            return
        _WARNED.add(where)
    msg = f"fusegraph: cannot use the cache at {where} ({exc}); running uncached"
    log.warning(msg)
    warnings.warn(msg, CacheUnavailableWarning, stacklevel=3)


def ensure_dir(path: Path, cache: Path | None = None) -> bool:
    """Creates ``path`` (and parents); False (after one warning per ``cache`` location, by
    default ``path`` itself) when that is impossible, e.g. a read-only location or a file
    where the directory should be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        warn_unavailable(cache or path, exc)
        return False
    return True


# ---- locking and atomic writes ---------------------------------------------------------------
@contextlib.contextmanager
def file_lock(lock_path: Path, *, shared: bool = False) -> Iterator[None]:
    """An advisory lock held by this process until the block ends (released by the kernel
    if the process dies). Raises OSError when the lock file cannot be created."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # no advisory locks here (Windows): last writer wins
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``path`` so that no reader, and no crash, ever leaves half of it there:
    temporary file in the same directory, fsync, rename. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# ---- JSON tables ---------------------------------------------------------------------------
def read_table(path: Path) -> dict[str, Any]:
    """A JSON object kept in the cache directory; {} when missing or unreadable (a torn
    or foreign file is never half-used: it either parses as one object or counts as empty)."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.info("cache table %s is unreadable (%s); treating it as empty", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Replaces the file atomically (a reader never sees half a table); raises OSError."""
    data = json.dumps(table, indent=1, sort_keys=True, default=list).encode()
    with file_lock(_lock_of(path)):
        atomic_write_bytes(path, data)


def update_table(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read-modify-write of a table under its lock, so that concurrent writers (threads or
    processes) never lose each other's entries; returns the table written. Raises OSError."""
    with file_lock(_lock_of(path)):
        table = read_table(path)
        change(table)
        atomic_write_bytes(path, json.dumps(table, indent=1, sort_keys=True, default=list).encode())
    return table


def _lock_of(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")

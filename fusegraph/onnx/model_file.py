"""A model file as it is on disk: whether this fusegraph and ONNX version checked it as it is
now (its record in the cache directory), and a read-only memory map of it for a session that
copies its weights out during the open. Both identify the file by its resolved path, size
and mtime (ns), as the floor's verdicts do: a file rewritten in place gets a new mtime."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
from pathlib import Path

import onnx

from fusegraph import __version__
from fusegraph.runtime.cache_dir import cache_enabled, cache_root, read_table, update_table

log = logging.getLogger("fusegraph.onnx")


# ---- files checked before ------------------------------------------------------------------------
CHECKED_FILE = "onnx-checked.json"
CHECKED_KEEP = 512  # records kept (the oldest go): one per model file version opened
CHECKS = 1  # bump when the checks below change within one fusegraph version


class CheckedRecord:
    """Whether a model file, as it is now, passed the checker and the initializer counts
    under this fusegraph and ONNX version: ``onnx.checker`` took 0.25 s of a warm ViT-B/16
    session's setup (H200 host) and says the same of the same bytes every time. The file's
    identity is its resolved path, size and mtime (ns), as the floor's verdicts key it; a
    file rewritten in place gets a new mtime and is checked again."""

    def __init__(self, path: str, key: str, table: Path, size: int, mtime_ns: int) -> None:
        self.path, self.key, self.table = path, key, table
        self.size, self.mtime_ns = size, mtime_ns

    @classmethod
    def of(cls, path: Path, cache_dir: str | os.PathLike[str] | None) -> CheckedRecord | None:
        """The file's record handle; None where caching is off or the file cannot be stat'ed."""
        if not cache_enabled():
            return None
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            return None
        ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|fusegraph {__version__}|onnx {onnx.__version__}|checks {CHECKS}"
        table = (Path(cache_dir) if cache_dir else cache_root()) / CHECKED_FILE
        return cls(real, hashlib.sha256(ident.encode()).hexdigest(), table, st.st_size, st.st_mtime_ns)

    def unchanged(self, size_read: int) -> bool:
        """The file still is what its key says after it was read (``size_read`` bytes)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return size_read == self.size == st.st_size and st.st_mtime_ns == self.mtime_ns

    def passed(self) -> bool:
        return self.key in read_table(self.table)

    def record(self) -> None:
        """Notes that the file passed; a cache that cannot be written only costs the next check."""
        def add(table: dict[str, object]) -> None:
            table[self.key] = time.time()
            if len(table) > CHECKED_KEEP:
                for old in sorted(table, key=lambda k: _stamp(table[k]))[: len(table) - CHECKED_KEEP]:
                    del table[old]

        try:
            update_table(self.table, add)
        except OSError as exc:
            log.debug("could not record that %s passed the checks: %s", self.path, exc)


def _stamp(v: object) -> float:
    return float(v) if isinstance(v, int | float) else 0.0


class FileMap:
    """A model file's read-only memory map, held while a session copies weights out of it."""

    def __init__(self, mapped: mmap.mmap, record: CheckedRecord) -> None:
        self._map, self._record = mapped, record
        self.size = len(mapped)
        self.closed = False  # unmapped by release (views still alive keep it mapped until they go)

    def release(self) -> bool:
        """Unmaps the file where nothing views it any more; whether it is unchanged (size and
        mtime) since it was mapped: where not, the weights copied out may not be the ones
        the parsed model describes."""
        try:
            self._map.close()
            self.closed = True
        except BufferError:  # a view still lives: the map goes with the last of them
            log.debug("%s: views of the mapped file still alive; unmapped when they go", self._record.path)
        return self._record.unchanged(self.size)


def mapped(path: Path, checked: CheckedRecord | None) -> tuple[memoryview, FileMap] | None:
    """The file mapped read-only where its record says it passed the checks as it is now
    (size and mtime); None otherwise (read into memory instead)."""
    if checked is None or not checked.passed():
        return None
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # an empty file, a file system that cannot map
        return None
    if not checked.unchanged(len(m)):  # changed since stat'ed: read (and checked) as a new file
        m.close()
        return None
    return memoryview(m), FileMap(m, checked)

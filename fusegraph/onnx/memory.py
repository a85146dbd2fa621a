"""Memory accounting: what the session holds live, and the process's peak while running.

Two measurements, because neither alone is honest:

* :class:`LiveBytes` counts the bytes of the intermediate tensors the session itself keeps
  between partitions (each freed at its last use). It is exact for what the session holds
  and blind to what the engines and ONNX Runtime allocate inside a call.
* :func:`measure_peak` brackets a call with the process's peak resident set size: it
  resets the kernel's high-water mark (``/proc/self/clear_refs`` <- ``5``), records VmRSS,
  runs the call, and reads VmHWM. The difference is the peak extra resident memory of
  that call, whoever allocated it -- NumPy, IREE or ONNX Runtime arenas -- so the same
  measurement applies to a plain ONNX Runtime session side by side. Where the reset is
  not possible (not Linux), it falls back to ``tracemalloc``'s peak, which sees only
  Python/NumPy allocations; ``method`` says which was used.
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def nbytes(value: Any) -> int:
    n = getattr(value, "nbytes", None)
    if isinstance(n, int):
        return n
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


class LiveBytes:
    """Bytes of the values the session holds; tracks the peak."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, name: str, value: Any) -> None:
        self.drop(name)
        n = nbytes(value)
        self._sizes[name] = n
        self.current += n
        self.peak = max(self.peak, self.current)

    def drop(self, name: str) -> None:
        self.current -= self._sizes.pop(name, 0)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    bytes: int = 0  # peak extra memory during the call
    method: str = ""  # "rss-hwm" or "tracemalloc"

    def __str__(self) -> str:
        return f"{self.bytes / 2**20:.1f} MiB ({self.method})"


@contextlib.contextmanager
def measure_peak() -> Iterator[PeakMemory]:
    """Peak extra memory of the block (see the module docstring for the method)."""
    result = PeakMemory()
    before = rss_bytes()
    if before is not None and _reset_peak():
        before = rss_bytes() or before
        yield result
        hwm = _status_kib("VmHWM")
        result.bytes = max(0, (hwm or 0) * 1024 - before)
        result.method = "rss-hwm"
        return
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        yield result
    finally:
        _, peak = tracemalloc.get_traced_memory()
        result.bytes = max(0, peak - base)
        result.method = "tracemalloc"
        if started:
            tracemalloc.stop()


def peak_of(fn: Callable[[], T]) -> tuple[T, PeakMemory]:
    with measure_peak() as m:
        out = fn()
    return out, m

"""Safe CUDA-graph captures for every GPU plan that captures one (torch's CUDA-graph plans,
the cuDNN and Triton launch replays), and timely release of the graphs of dropped plans.

Why both:
- A capture forbids, on the capturing thread, the CUDA calls that would break it, and
  destroying another CUDA graph is one of them. A plan is freed by Python's cycle collector
  (a Graph keeps its plans and a plan its Graph), and that collector may run in the middle
  of a capture, on any allocation: the dropped plan's graph then fails to destroy ("CUDA
  warning: operation not permitted when stream is capturing (function reset)") and its
  memory pool is never given back. Seen on the H100: 10,000 build/execute/drop cycles of a
  captured torch plan kept 92 MiB of dead pools for good. So the collector is paused for
  the length of a capture.
- A dropped plan's captured graph holds its memory pool until the collector frees the plan;
  the collector runs by object counts, not device bytes, so dead graphs piled up (43 after
  2,000 cycles, ~100 MiB). Each capture first collects when the captured graphs alive, the
  dead not yet collected included, have doubled since the last collection (at least
  ``FIRST_COLLECTION``): the dead are bounded by the living, at one collection per doubling.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

FIRST_COLLECTION = 32

_THREAD = threading.local()
_WARM_UP: dict[str, Any] = {}  # device -> the one stream capture warm-ups run on (warm_up_stream)
_WARM_UP_LOCK = threading.Lock()


def warm_up_stream(torch: Any, device: Any) -> Any:
    """The side stream a capture's warm-up runs on before it captures, one per device for the
    process. cuBLAS keeps a workspace (32 MiB on Hopper) per stream it has run on, for the
    process's life, and torch's pool hands out up to 32 streams per device: a fresh stream
    per capture left a workspace behind on each (four of them, 128 MiB, after one ONNX
    session on an H200). Threads may share it: warm-ups only queue work on it, and each
    capture waits for it before capturing on a stream of its own."""
    dev = torch.device(device)
    key = str(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))
    with _WARM_UP_LOCK:
        stream = _WARM_UP.get(key)
        if stream is None:
            stream = _WARM_UP[key] = torch.cuda.Stream(torch.device(key))
        return stream


@contextlib.contextmanager
def postponed() -> Iterator[None]:
    """No plan captures a CUDA graph on this thread meanwhile: each runs eagerly and captures
    at a later call made elsewhere. For a thread that builds and measures plans beside the
    user's own CUDA work (onnx/region_upgrade.py): while a stream captures, a device-wide
    synchronize from any other thread fails ("operation not permitted when stream is
    capturing"), so a capture there could break the user's run (seen on an H200: a
    ResNet-50 session's step failed that way in the user's thread)."""
    before = getattr(_THREAD, "postponed", False)
    _THREAD.postponed = True
    try:
        yield
    finally:
        _THREAD.postponed = before


def allowed() -> bool:
    """Whether a plan may capture a CUDA graph on this thread now (``postponed``)."""
    return not getattr(_THREAD, "postponed", False)


class CaptureCensus:
    """How many captured graphs are alive (their owners not yet freed), and when to collect.

    One per process (``CENSUS``): the graphs of every plan share the device's memory."""

    def __init__(self, first: int = FIRST_COLLECTION) -> None:
        self._lock = threading.Lock()
        self.alive = 0
        self.collections = 0
        self._first = first
        self._threshold = first

    def track(self, owner: Any) -> None:
        """Counts one captured graph, alive until ``owner`` (what holds it) is freed."""
        with self._lock:
            self.alive += 1
        weakref.finalize(owner, self._dropped)

    def _dropped(self) -> None:
        with self._lock:
            self.alive -= 1

    def before_capture(self) -> None:
        """Collects dropped plans first where the graphs alive have reached the threshold."""
        with self._lock:
            due = self.alive >= self._threshold
        if not due:
            return
        gc.collect()
        with self._lock:
            self.collections += 1
            self._threshold = max(self._first, 2 * self.alive)


CENSUS = CaptureCensus()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Around a capture: dropped plans collected first where due, then the cycle collector
    paused until the capture ends (see the module docstring)."""
    CENSUS.before_capture()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""A plan's launch replayed from a CUDA graph when the same device pointers come back (the
cuDNN and Triton plans).

Why: a library launch costs host time -- cuDNN's ``execute`` ~8 us, a Triton launch more
-- and a graph small or fast enough to finish before the next call is issued is timed by
that host time, not by its kernels. Calls that come back to back usually repeat their
pointers: the same input tensors, outputs given, or outputs allocated where the caching
allocator puts a freed block of the same size again. A replay (``cudaGraphLaunch``, ~5 us
on the H200's host) runs the same kernels on the same addresses with the same constants
and workspace, so its result is the launch's.

The rules, each for a reason:
- only on the legacy default stream (raw handle 0): a graph replays on the stream current
  at the call, the plan's own workspace belongs to one stream, and nothing can be capturing
  on the default stream (so a caller's own capture never sees a replay);
- a capture after ``REPEATS`` calls running with the same pointers (a capture costs ~1 ms
  and memory; one-off pointers never pay it), made after a real launch of them, so a
  capture never replaces a launch;
- at most ``MAX_GRAPHS`` per plan, never evicted (destroying a graph a pending replay still
  runs is not something to reason about per call);
- a failed capture turns replays off for the plan (logged) and launches go on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from fusegraph.engines.cuda_capture import CENSUS, allowed, capturing

log = logging.getLogger("fusegraph.engines")

DEFAULT_STREAM = 0


class LaunchReplay:
    """Pointer tuples -> captured CUDA graphs of one plan's launch (see the module docstring)."""

    MAX_GRAPHS = 4
    REPEATS = 3

    def __init__(self, torch: Any, device: Any, on: bool) -> None:
        self._torch, self._device = torch, device
        self.on = on
        self.graphs: dict[tuple[int, ...], Any] = {}
        self._last: tuple[int, ...] | None = None
        self._repeats = 0
        self._side: Any = None
        self._lock = threading.Lock()  # one replay of a graph at a time

    def describe(self) -> dict[str, Any]:
        """For a plan's ``describe()``: whether replays are on, and how many graphs are held."""
        return {"cuda_graph": "auto" if self.on else "off", "cuda_graphs_captured": len(self.graphs)}

    def replay(self, key: tuple[int, ...]) -> bool:
        """Replays the graph captured for ``key`` on the default stream; False if none."""
        graph = self.graphs.get(key)
        if graph is None:
            return False
        with self._lock:
            graph.replay()
        return True

    def launched(self, key: tuple[int, ...], capture: Callable[[int], None], guard: Any = None) -> None:
        """After a launch with ``key`` on the default stream: counts the repeats and, at
        ``REPEATS``, captures ``capture(stream)`` -- the same launch on the given raw
        stream -- under ``guard`` (a lock the launch itself takes, e.g. the handle's)."""
        if not self.on or not allowed():
            return
        if key == self._last:
            self._repeats += 1
        else:
            self._last, self._repeats = key, 1
        if self._repeats == self.REPEATS and len(self.graphs) < self.MAX_GRAPHS and key not in self.graphs:
            self._capture(key, capture, guard)

    def _capture(self, key: tuple[int, ...], capture: Callable[[int], None], guard: Any) -> None:
        torch = self._torch
        try:
            if self._side is None:
                self._side = torch.cuda.Stream(self._device)
            side = self._side
            graph = torch.cuda.CUDAGraph()
            with capturing(), guard if guard is not None else contextlib.nullcontext(), torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    capture(int(side.cuda_stream))
                finally:
                    graph.capture_end()
        except Exception as exc:
            self.on = False
            log.info("launch not captured into a CUDA graph (%s: %s); plain launches from now on", type(exc).__name__, exc)
            return
        self.graphs[key] = graph
        CENSUS.track(self)

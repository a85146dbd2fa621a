"""timing.DeviceClock on an NVIDIA GPU: CUDA events around a block issued behind a spin
kernel (``torch.cuda._sleep``). Without the spin, a block of short calls is timed at the
speed the host issues it: a region whose kernels take 30 us and whose call takes 80 us of
Python measures 80, although inside a replayed CUDA graph, or behind a busy GPU queue, it
costs 30. The spin's length comes from a one-time calibration of the spin kernel's clock
against the events (cycles per millisecond differ by card and clock state)."""

from __future__ import annotations

import threading
from typing import Any

_CYCLES_PER_MS: dict[int, float] = {}  # device index -> the spin kernel's cycles per ms (a cache)
_LOCK = threading.Lock()


def _torch() -> Any:
    import torch

    return torch


def _calibrate(index: int) -> float:
    torch = _torch()
    with _LOCK:
        got = _CYCLES_PER_MS.get(index)
        if got is not None:
            return got
        with torch.cuda.device(index):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 2_000_000
            torch.cuda._sleep(cycles)  # first launch loads the kernel
            torch.cuda.synchronize()
            per_ms = []
            for _ in range(3):
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
                b.synchronize()
                per_ms.append(cycles / max(a.elapsed_time(b), 1e-3))
        got = float(sorted(per_ms)[1])
        _CYCLES_PER_MS[index] = got
        return got


class CudaClock:
    """Device time of a block on the current stream of ``device`` (a torch.device or an
    index). The spin lasts 1.5x the host's estimate plus 0.2 ms: a spin too short would let
    the host's issue time back into the sample, one too long only costs wall time."""

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self.index = device if isinstance(device, int) else (torch.device(device).index or 0)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self, host_ms: float) -> None:
        torch = _torch()
        per_ms = _calibrate(self.index)
        torch.cuda._sleep(int(per_ms * (1.5 * max(host_ms, 0.0) + 0.2)))
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end))

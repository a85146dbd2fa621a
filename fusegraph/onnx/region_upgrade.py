"""A GPU session's regions chosen after it opens (issue 24 item 6: a session usable within
seconds).

Choosing a model's regions the first time builds every candidate plan (Triton and cuDNN
compiles, an Inductor compile where the torch engine fuses) and times each against the
incumbent: 4-56 s on an H200 before the first run; and a warm session in a new process still
built every kept plan first (1.8-17.5 s). With ``floor_mode=background`` (the default) a GPU
session does not wait: the regions without a stored verdict, and those whose stored verdict
keeps fusegraph's plan, start on the incumbent itself -- the same nodes op by op on PyTorch,
what the region is measured against -- so the session runs from the first call at the speed
the user had without fusegraph. A background thread then builds (and, without a verdict,
measures) those regions and swaps the upgraded plan in between two runs.

The user's runs and the thread's measurements take turns (``Gate``, one per device): a region
is timed only while no run of a deferred unit on that device is in flight, and a run waits at
most for one region's timing; building a plan (compiles, trial runs) overlaps the runs. Where
regions are measured (long), the first run captures the incumbent plan as one CUDA graph
before the thread starts, and later runs replay it; where plans are only built, the runs go
step by step meanwhile. The thread captures nothing while the user's runs go on
(engines/cuda_capture.postponed: a capture makes other threads' device-wide synchronizes
fail); it captures the upgraded plan under the gate.

Why a thread, not the CPU floor's child process: on a GPU the incumbent is PyTorch in this
process, and the plan the verdicts choose must be built in this process anyway (its
kernels, its device memory); a child would build it twice.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusegraph.onnx.options import ProviderOptions
    from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.onnx")


class Gate:
    """Runs and measurements of one unit, one at a time, runs first: a measurement starts
    only when no run is waiting (a plain lock would let the thread take it back at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        while self._waiting:
            time.sleep(0.0005)
        with self._lock:
            yield


# One gate per device, shared by every deferred unit of the process: a unit's region is
# timed only while no run of any unit on that device is in flight (two sessions' background
# choices, or a model split into several units, would otherwise time each other's kernels).
_GATES: dict[str, Gate] = {}
_GATES_LOCK = threading.Lock()


def gate_for(device: str) -> Gate:
    with _GATES_LOCK:
        gate = _GATES.get(device)
        if gate is None:
            gate = _GATES[device] = Gate()
        return gate


class Upgrade:
    """The background choice of one unit: ``work`` (the unit's own, given the cancel flag)
    runs on a daemon thread; ``wait`` joins it. A failure is logged and kept in ``error``
    (the unit keeps running its incumbent steps: nothing the user sees breaks)."""

    def __init__(self, name: str, work: Callable[[threading.Event], None]) -> None:
        self.name = name
        self.cancel = threading.Event()
        self.error: BaseException | None = None

        def target() -> None:
            try:
                work(self.cancel)
            except BaseException as exc:  # the thread must never take the process down
                self.error = exc
                log.warning("%s: choosing its regions in the background failed (%s: %s); it keeps running "
                            "them op by op on PyTorch", name, type(exc).__name__, exc)

        self.thread = threading.Thread(target=target, name=f"fusegraph-regions-{name}", daemon=True)
        _LIVE.add(self)
        self.thread.start()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return self.done

    def stop(self, timeout: float | None = None) -> None:
        """Asks the thread to stop after the region at hand (its verdicts so far are kept)."""
        self.cancel.set()
        self.thread.join(timeout)


# The upgrades still running, so the interpreter's exit stops them first (a daemon thread
# killed inside a CUDA call at exit can crash the process). Weak: a finished or dropped
# upgrade is not kept alive by this registry.
_LIVE: weakref.WeakSet[Upgrade] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for up in list(_LIVE):
        if not up.done:
            log.info("%s: stopping the background choice of its regions at exit (the verdicts measured so "
                     "far are kept; the region at hand is dropped after 5 s)", up.name)
            up.stop(timeout=5.0)


def deferred(opts: ProviderOptions, handle: Handle) -> bool:
    """Whether a region unit of this session defers its unmeasured regions: on a GPU with the
    floor on, ``floor_mode=background`` (the default), no autotuning (a tuned plan is chosen at
    once) and not ``precision=tf32`` (its TF32 flags are process-wide: a thread setting them
    would change the user's own float32 math)."""
    return (bool(handle.device.is_gpu) and opts.floor_mode == "background" and opts.autotune <= 0
            and not opts.lazy_compile and opts.precision != "tf32")


__all__ = ["Gate", "Upgrade", "deferred", "gate_for"]

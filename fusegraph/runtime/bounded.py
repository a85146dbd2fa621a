"""Child processes under a memory and time ceiling: how fusegraph runs native code it cannot
trust with its host process (an ``iree-compile``, a oneDNN Graph probe).

The memory ceiling is on the child's *resident* memory, read every ``POLL_S``: what a machine
runs out of, and what the kernel's OOM killer judges. The child is killed past it; an
address-space limit (RLIMIT_AS) of twice the ceiling plus 4 GiB catches an allocation too
fast for the reading (address space runs well ahead of resident memory, so a tighter one
would refuse honest work). The time ceiling is a timeout. Either way the caller learns
which ceiling stopped the child and the peak it had reached.
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

POLL_S = 0.05
DEFAULT_MEMORY_CAP = 8 << 30  # a default ceiling is min(this, half the machine)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def default_memory_ceiling() -> int:
    """min(8 GiB, half the physical memory), at least 1 GiB."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 2 * DEFAULT_MEMORY_CAP
    return min(DEFAULT_MEMORY_CAP, max(physical // 2, 1 << 30))


@dataclass(frozen=True)
class BoundedRun:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int  # the largest resident size read
    stopped: str | None  # "memory" or "time" when a ceiling stopped the child, else None


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def address_space_backstop(memory_bytes: int | None) -> tuple[int, int] | None:
    """The child's RLIMIT_AS (soft, hard): twice the ceiling plus 4 GiB, never above a limit
    this process already lives under."""
    if memory_bytes is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = 2 * memory_bytes + (4 << 30)
    for cap in (soft, hard):
        if cap != resource.RLIM_INFINITY:
            want = min(want, cap)
    return want, hard


def run_bounded(
    cmd: Sequence[str], *, memory_bytes: int | None = None, seconds: float | None = None
) -> BoundedRun:
    """Runs ``cmd`` (text output captured) until it exits or passes a ceiling."""
    backstop = address_space_backstop(memory_bytes)

    def ceiling() -> None:  # runs in the child before exec: nothing here may raise
        if backstop is not None:
            resource.setrlimit(resource.RLIMIT_AS, backstop)

    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        preexec_fn=ceiling if backstop is not None else None,
    )
    stopped: list[str] = []
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            rss = rss_bytes(proc.pid)
            peak[0] = max(peak[0], rss)
            if memory_bytes is not None and rss > memory_bytes:
                stopped.append("memory")
                proc.kill()
                return

    watcher = threading.Thread(target=watch, name="fusegraph-bounded-watch", daemon=True)
    watcher.start()
    try:
        stdout, stderr = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        stopped.append("time")
        proc.kill()
        stdout, stderr = proc.communicate()
    except BaseException:  # KeyboardInterrupt: the child must not outlive the call
        proc.kill()
        proc.wait()
        raise
    finally:
        done.set()
        watcher.join()
    return BoundedRun(proc.returncode, stdout or "", stderr or "", peak[0], stopped[0] if stopped else None)

"""A stable, human-readable name of the device a handle runs on (tuning-DB key part).

Timings only transfer between identical devices: the CPU model and the cores this process
may use, or the GPU's marketing name.
"""

from __future__ import annotations

import functools
import os
import platform

from fusegraph.runtime.handle import Handle


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@functools.cache
def gpu_name(kind: str, index: int) -> str:
    try:
        import torch

        if torch.cuda.is_available() and index < torch.cuda.device_count():
            return str(torch.cuda.get_device_name(index))
    except Exception:
        pass
    if kind == "cuda":
        import subprocess  # only here: importing it costs a cached CPU build ~2 ms

        try:
            out = subprocess.run(
                ["nvidia-smi", f"--id={index}", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            )
            return out.stdout.strip() or "unknown-gpu"
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown-gpu"


def device_id(handle: Handle) -> str:
    d = handle.device
    if d.kind == "cpu":
        return f"cpu[{cpu_model()} x{usable_cores()}]"
    return f"{d.kind}[{gpu_name(d.kind, d.index)}]"

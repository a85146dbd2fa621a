"""The one table of IREE compile targets: which flags select a device, and which runtime
driver runs the result.

IREE 3.13 knows no ``sm_90`` CUDA target, so CUDA compiles to ``sm_80`` PTX, which the
driver JIT-compiles for the H200; when a newer IREE learns sm_90, change ``arch`` in the
``cuda`` row below and nowhere else.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from fusegraph.runtime.handle import Device
from fusegraph.runtime.iree_hal import HAL_DRIVERS


@dataclass(frozen=True)
class Target:
    """A compile target: the device kind it serves, its architecture and runtime driver."""

    kind: str  # "cpu" | "cuda" | "hip": the Handle device kind that runs it
    arch: str  # llvm cpu name ("host", "znver4"...), "sm_80", "gfx942"...
    driver: str  # IREE runtime HAL driver
    backend: str  # IREE target device name for --iree-hal-target-device

    @property
    def spec(self) -> str:
        """The canonical spelling: the kind alone for its default arch, else ``kind:arch``."""
        return self.kind if self.arch == _DEFAULT_ARCH[self.kind] else f"{self.kind}:{self.arch}"

    def flags(self) -> tuple[str, ...]:
        """The iree-compile flags that select this target (input type included)."""
        base = ("--iree-input-type=torch", f"--iree-hal-target-device={self.backend}")
        if self.kind == "cpu":
            return (
                *base,
                "--iree-hal-local-target-device-backends=llvm-cpu",
                f"--iree-llvmcpu-target-cpu={self.arch}",
            )
        if self.kind == "cuda":
            return (*base, f"--iree-cuda-target={self.arch}")
        return (*base, f"--iree-rocm-target={self.arch}")

    def cache_identity(self) -> str:
        """What the compiled code depends on: for ``cpu:host``, the host CPU itself."""
        if self.kind == "cpu" and self.arch == "host":
            return f"cpu:host[{host_cpu_id()}]"
        return f"{self.kind}:{self.arch}"

    def __str__(self) -> str:
        return self.spec


_DEFAULT_ARCH = {"cpu": "host", "cuda": "sm_80", "hip": "gfx942"}

# kind -> the default target of that kind. Architectures known to work with IREE 3.13.
TARGETS: dict[str, Target] = {
    "cpu": Target("cpu", _DEFAULT_ARCH["cpu"], driver=HAL_DRIVERS["cpu"], backend="local"),
    "cuda": Target("cuda", _DEFAULT_ARCH["cuda"], driver=HAL_DRIVERS["cuda"], backend="cuda"),
    "hip": Target("hip", _DEFAULT_ARCH["hip"], driver=HAL_DRIVERS["hip"], backend="hip"),
}
KNOWN_ARCHES: dict[str, tuple[str, ...]] = {
    "cpu": ("host", "generic", "x86-64-v2", "x86-64-v3", "x86-64-v4", "znver3", "znver4", "skylake-avx512"),
    "cuda": ("sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89"),
    "hip": ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201"),
}
_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "rocm": "hip", "amd": "hip", "llvm-cpu": "cpu", "host": "cpu"}


def parse_target(spec: str | Target) -> Target:
    """``"cpu"``, ``"cpu:znver4"``, ``"cuda"``, ``"cuda:sm_80"``, ``"hip:gfx90a"`` -> Target.

    Unknown architectures are passed through to IREE (which may know more than this table),
    but a known kind is required.
    """
    if isinstance(spec, Target):
        return spec
    kind, _, arch = spec.strip().lower().partition(":")
    kind = _ALIASES.get(kind, kind)
    if kind not in TARGETS:
        raise ValueError(f"unknown IREE target {spec!r}: expected one of {sorted(TARGETS)} (optionally ':<arch>')")
    base = TARGETS[kind]
    if arch and arch.isdigit():  # "cuda:0" is a device, not an architecture
        arch = ""
    return replace(base, arch=arch) if arch else base


def target_for_device(device: Device) -> Target:
    """The default target for a Handle's device kind."""
    return TARGETS[device.kind]


@cache
def host_cpu_id() -> str:
    """A short, stable id of this host's CPU (model and feature flags): code compiled for
    ``--iree-llvmcpu-target-cpu=host`` is only valid on a CPU with the same features."""
    text = platform.machine()
    info = Path("/proc/cpuinfo")
    try:
        lines = info.read_text().splitlines() if info.exists() else []
    except OSError:
        lines = []
    for prefix in ("model name", "flags", "Features"):
        for line in lines:
            if line.startswith(prefix):
                text += "|" + line.split(":", 1)[-1].strip()
                break
    return hashlib.sha256(text.encode()).hexdigest()[:12]

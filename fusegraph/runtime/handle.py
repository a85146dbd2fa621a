"""Handle: which device a graph runs on ("cpu", "cuda", "cuda:N", "hip:N")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_SPEC = re.compile(r"^(cpu|cuda|hip)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" | "cuda" | "hip"
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "cpu" else f"{self.kind}:{self.index}"

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"


def parse_device(spec: str) -> Device:
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"unknown device {spec!r}: expected 'cpu', 'cuda', 'cuda:N' or 'hip:N'")
    return Device(m.group(1), int(m.group(2) or 0))


class Handle:
    """A device plus the per-engine runtime state opened on it (created lazily)."""

    def __init__(self, device: str | Device = "cpu") -> None:
        self.device = device if isinstance(device, Device) else parse_device(device)
        # Engines keep their per-device state here (an IREE VM instance and device...).
        self.state: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Handle({str(self.device)!r})"

    def buffer(self, array: Any, tensor: Any = None) -> Any:
        """``fusegraph.Buffer.from_numpy(array, self, tensor)``: the data in this device's memory."""
        from fusegraph.runtime.buffer import Buffer

        return Buffer.from_numpy(array, self, tensor)

    def synchronize(self) -> None:
        """Waits for this device's queued work. Plans run synchronously today (their
        results are complete when execute returns), so there is nothing to wait for."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)


def as_handle(handle: Handle | str | None) -> Handle:
    if handle is None:
        return default_handle()
    if isinstance(handle, Handle):
        return handle
    return Handle(handle)


_DEFAULT: dict[str, Handle] = {}


def default_handle() -> Handle:
    """The process's CPU handle (one, so its runtime state is shared)."""
    if "cpu" not in _DEFAULT:
        _DEFAULT["cpu"] = Handle("cpu")
    return _DEFAULT["cpu"]

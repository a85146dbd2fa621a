"""The engines a session builds on: which of them may claim a node (``EngineChoice``), and
what they said while building or first running a unit (``engine_warnings``), for the report."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from fusegraph.engines.registry import REGISTRY
from fusegraph.errors import FusegraphError, OptionError
from fusegraph.graph.graph import Graph
from fusegraph.onnx.options import PROVIDER
from fusegraph.runtime.handle import Handle


class EngineChoice:
    """Which engines build claimed subgraphs, and whether they can run a given graph.

    A named engine is used alone (``g.build(handle, engine=name)``). By default the
    selection layer picks per graph (``g.build(handle, engine=None)``) among the available
    engines, and a node is claimed when a compiling engine (not the float64 reference,
    unless it is the only one) runs it.
    """

    def __init__(self, name: str | None, handle: Handle) -> None:
        self.handle = handle
        if name in (None, "auto"):
            self.name: str | None = None
            avail = [e for e in REGISTRY.engines() if _available(e)]
            if handle.device.is_gpu:
                avail = [e for e in avail if e.name != "reference"]
            compiled = [e for e in avail if e.name != "reference"]
            self.candidates = compiled or avail
            if not self.candidates:
                raise ValueError(f"{PROVIDER}: no fusegraph engine is available on {handle.device}")
            return
        try:
            eng = REGISTRY.get(name)
        except FusegraphError as exc:
            raise OptionError(f"{PROVIDER} option engine={name!r}: {exc}") from None
        state = eng.available()
        if not state:
            raise OptionError(f"{PROVIDER} option engine={name!r}: not available here ({state.reason})")
        self.name = name
        self.candidates = [eng]

    def why_not(self, graph: Graph) -> str | None:
        reasons = []
        for eng in self.candidates:
            try:
                sup = eng.supports(graph, self.handle)
            except Exception as exc:  # a plugin's bug must not break the session
                reasons.append(f"engine '{eng.name}': supports() failed: {exc}")
                continue
            if sup:
                return None
            reasons.append(f"engine '{eng.name}': {sup.reason}")
        return "; ".join(reasons) or "no engine available"


def _available(e: Any) -> bool:
    try:
        return bool(e.available())
    except Exception:
        return False


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(one_line(record.getMessage(), 300))


@contextlib.contextmanager
def engine_warnings() -> Iterator[list[str]]:
    """The engines' warnings meanwhile (e.g. the torch engine running a graph eagerly because
    oneDNN Graph refused it), for the report: no path falls back silently."""
    said = _Said()
    loggers = [logging.getLogger(n) for n in ("fusegraph.engines", "fusegraph.iree")]
    for lg in loggers:
        lg.addHandler(said)
    try:
        yield said.messages
    finally:
        for lg in loggers:
            lg.removeHandler(said)


def one_line(text: str, limit: int = 400) -> str:
    flat = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


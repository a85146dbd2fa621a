"""The heuristic plugin interface: what a ``fusegraph.heuristics`` entry point implements.

It sits with the engine interface (engines/base.py) because the registry loads heuristic
plugins beside engine plugins; the built-in rules that use it live in
fusegraph/select/heuristics.py, which re-exports both names.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fusegraph.engines.base import Engine, EngineConfig

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph
    from fusegraph.runtime.handle import Handle


class HeurMode(enum.Enum):
    """Which heuristics rank the (engine, config) candidates of a graph.

    A: the built-in rule table (from our benchmark data), one config per engine, plus
       heuristic plugins; instant.
    B: every knob configuration of every engine, ordered by the same rules (the search
       space the autotuner walks); still no measurement.
    FALLBACK: every remaining available engine with its default knobs, the reference
       engine last and only on CPU handles; broad coverage, no speed promise.
    """

    A = "a"
    B = "b"
    FALLBACK = "fallback"


@runtime_checkable
class Heuristic(Protocol):
    """A heuristic plugin: ranks configs of the given engines, or returns None to abstain."""

    name: str

    def rank(
        self, graph: Graph, handle: Handle, mode: HeurMode, engines: Sequence[Engine]
    ) -> Sequence[EngineConfig] | None: ...

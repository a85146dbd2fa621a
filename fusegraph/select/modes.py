"""The selection vocabulary, after cuDNN's frontend: heuristic modes and build policies."""

from __future__ import annotations

import enum


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


class BuildPlanPolicy(enum.Enum):
    """HEURISTICS_CHOICE builds the first candidate that builds; ALL builds every one."""

    HEURISTICS_CHOICE = "heuristics_choice"
    ALL = "all"

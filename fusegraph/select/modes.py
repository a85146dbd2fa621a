"""The selection vocabulary, after cuDNN's frontend: heuristic modes and build policies.

``HeurMode`` is defined beside the heuristic plugin interface (engines/heuristic.py), which
the engine registry needs; it is re-exported here, where users look for it.
"""

from __future__ import annotations

import enum

from fusegraph.engines.heuristic import HeurMode

__all__ = ["BuildPlanPolicy", "HeurMode"]


class BuildPlanPolicy(enum.Enum):
    """HEURISTICS_CHOICE builds the first candidate that builds; ALL builds every one."""

    HEURISTICS_CHOICE = "heuristics_choice"
    ALL = "all"

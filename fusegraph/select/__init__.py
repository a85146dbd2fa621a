"""Engine selection: heuristics, the plan-list API, partial support and autotuning."""

from fusegraph.select.modes import BuildPlanPolicy, HeurMode

__all__ = ["BuildPlanPolicy", "HeurMode"]

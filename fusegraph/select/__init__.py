"""Engine selection: heuristics, the plan-list API, partial support and autotuning.

Importing this package registers the planner behind ``Graph``'s plan methods (the seam
in fusegraph/graph/seam.py); ``import fusegraph`` does it for users.
"""

from fusegraph.graph.seam import register_planner
from fusegraph.select.modes import BuildPlanPolicy, HeurMode
from fusegraph.select.planner import PLANNER

register_planner(PLANNER)

__all__ = ["BuildPlanPolicy", "HeurMode"]

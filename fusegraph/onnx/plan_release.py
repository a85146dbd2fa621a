"""The end of a session plan's life: the reference cycles inside what its units own, cut so
that weights and engine plans go when the last reference does, not at the garbage
collector's next full pass (a serving process that reloads models would otherwise hold
every old model's weights until one happens to run)."""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.graph.graph import Graph
from fusegraph.onnx.units import FusegraphUnit
from fusegraph.regions.choose import Chooser
from fusegraph.regions.plan import RegionPlan, Step

# What a plan's units own and may hold a cycle, walked by break_cycles. A graph and its engine
# plans refer to each other (Graph.plans and Graph._selection hold the plans, each plan holds
# its graph: the plan keeps the bound weights), and a region unit's chooser builds through a
# closure over the unit. Only these types are walked into, never shared objects (handles,
# engines, caches, verdict stores), so nothing another session uses is touched.
_OWNED = (FusegraphUnit, RegionPlan, Step, ExecutionPlan, Graph)


def break_cycles(roots: Sequence[Any]) -> int:
    """Clears the back references of the graphs, engine plans and choosers reachable from
    ``roots`` through the objects of _OWNED, lists, tuples, dicts, sets and closures;
    returns how many objects were cut. Whatever it reaches must be unused from then on."""
    seen: set[int] = set()
    stack: list[Any] = list(roots)
    cut = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
            stack.extend(k for k in obj if not isinstance(k, str | int | float | bytes))
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif isinstance(obj, types.FunctionType):  # a closure: what it captured
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, Chooser):  # the unit's own: its builders close over the unit
            obj.builder = obj.preferred = None
            obj.fallbacks = ()  # further candidates, built the same way
            cut += 1
        elif isinstance(obj, _OWNED):
            if isinstance(obj, Graph):
                obj.plans.clear()
                obj._selection = None
                cut += 1
            stack.extend(getattr(obj, "__dict__", {}).values())
    return cut


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


__all__ = ["break_cycles"]

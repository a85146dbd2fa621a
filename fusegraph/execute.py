"""Graph.execute: runs the plan built for the handle (and engine), building the default first.

Which plan is the default is the selection layer's business (fusegraph.select.api.build):
a pinned config or engine, ``preferred_engine`` / ``FUSEGRAPH_ENGINE``, the tuning
database, then the heuristics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fusegraph.runtime.handle import Handle, as_handle
from fusegraph.select.api import ENGINE_ENV, build

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

__all__ = ["ENGINE_ENV", "execute_graph"]


def execute_graph(
    graph: Graph,
    variant_pack: Mapping[Any, Any],
    *,
    handle: Handle | str | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    graph.ensure_valid()
    h = as_handle(handle)
    plan = graph.plans.get((engine or "*", h))
    if plan is None:
        plan = build(graph, h, engine=engine)
    return plan.execute(variant_pack)

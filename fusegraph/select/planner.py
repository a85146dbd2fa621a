"""The selection layer's side of the graph seam (fusegraph/graph/seam.py).

``Graph``'s plan methods forward here. ``fusegraph.select`` registers ``PLANNER`` when it
is imported, so the graph layer never imports the engine or selection layers. Running a
graph: the plan built for the handle (and engine) is used, else the default plan is built
first; which plan is the default is ``api.build``'s business (a pinned config or engine,
``preferred_engine`` / ``FUSEGRAPH_ENGINE``, the tuning database, then the heuristics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fusegraph.errors import ExecutionError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle, as_handle
from fusegraph.select import api


class SelectPlanner:
    """Implements ``fusegraph.graph.seam.Planner`` with fusegraph.select.api."""

    def execute(
        self, graph: Graph, variant_pack: Mapping[Any, Any], handle: Handle | str | None, engine: str | None
    ) -> dict[str, Any]:
        graph.ensure_valid()
        h = as_handle(handle)
        plan = graph.plans.get((engine or "*", h))
        if plan is None:
            plan = api.build(graph, h, engine=engine)
        try:
            result: dict[str, Any] = plan.execute(variant_pack)
        except ExecutionError as exc:  # the engine accepted the graph, then failed it
            nxt = api.fall_back(graph, h, plan, exc) if engine is None else None
            if nxt is None:
                raise
            result = nxt.execute(variant_pack)
        return result

    def build(self, graph: Graph, handle: Handle | str | None, engine: str | None, **options: Any) -> Any:
        return api.build(graph, handle, engine=engine, **options)

    def create_execution_plans(self, graph: Graph, modes: Sequence[Any] | None, handle: Handle | str | None) -> None:
        api.create_execution_plans(graph, modes, handle)

    def check_support(self, graph: Graph, handle: Handle | str | None) -> None:
        api.check_support(graph, handle)

    def build_plans(self, graph: Graph, policy: Any, handle: Handle | str | None) -> None:
        api.build_plans(graph, policy, handle)

    def get_execution_plan_count(self, graph: Graph) -> int:
        return api.get_execution_plan_count(graph)

    def execute_plan_at_index(self, graph: Graph, variant_pack: Mapping[Any, Any], index: int) -> dict[str, Any]:
        return api.execute_plan_at_index(graph, variant_pack, index)

    def autotune(
        self, graph: Graph, variant_pack: Mapping[Any, Any] | None, handle: Handle | str | None, **options: Any
    ) -> Any:
        return api.autotune(graph, variant_pack, handle, **options)

    def emit_mlir(self, graph: Graph) -> str:
        from fusegraph.engines.iree.emit import emit_mlir  # the IREE engine's code, on demand

        return emit_mlir(graph.ensure_valid()).text

    def compile_to_artifact(self, graph: Graph, target: str, **options: Any) -> bytes:
        from fusegraph.engines.iree.artifact import compile_to_artifact

        return compile_to_artifact(graph.ensure_valid(), target, **options)


PLANNER = SelectPlanner()

"""Graph.execute: picks the plan (built one, named engine, or default) and runs it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fusegraph.engines.registry import REGISTRY
from fusegraph.errors import UnsupportedError
from fusegraph.runtime.handle import Handle, as_handle

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph

ENGINE_ENV = "FUSEGRAPH_ENGINE"


def execute_graph(
    graph: Graph,
    variant_pack: Mapping[Any, Any],
    *,
    handle: Handle | str | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    graph.ensure_valid()
    h = as_handle(handle)
    name = engine or os.environ.get(ENGINE_ENV) or None
    plan = graph.plans.get((name, h)) if name else graph.plans.get(("*", h))
    if plan is None:
        if name is None:
            name = "reference"
        eng = REGISTRY.get(name)
        sup = eng.supports(graph, h)
        if not sup:
            raise UnsupportedError(f"engine '{name}' cannot run graph '{graph.name}' on {h.device}: {sup.reason}")
        plan = eng.build(graph, h)
        graph.plans[(name, h)] = plan
    return plan.execute(variant_pack)  # type: ignore[no-any-return]

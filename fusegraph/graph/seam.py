"""The one seam between the graph layer and the layers that run graphs.

Users call cuDNN-frontend-style methods on a graph (``g.build()``, ``g.execute(pack)``,
``g.create_execution_plans(...)``...). Selecting and running an engine is the business of
the layers above (engines, select), which import the graph layer; the graph layer never
imports them. Instead the selection layer registers a ``Planner`` here when it is imported
(``fusegraph/__init__.py`` imports it, so ``import fusegraph`` is enough), and the methods
below forward to it. Nothing else in graph/ reaches upward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from fusegraph.errors import FusegraphError, VariantPackError

if TYPE_CHECKING:
    from fusegraph.graph.graph import Graph
    from fusegraph.runtime.handle import Handle


class Planner(Protocol):
    """What the graph's plan methods need from the layers above (select registers one)."""

    def execute(
        self, graph: Graph, variant_pack: Mapping[Any, Any], handle: Handle | str | None, engine: str | None
    ) -> dict[str, Any]: ...

    def build(self, graph: Graph, handle: Handle | str | None, engine: str | None, **options: Any) -> Any: ...

    def create_execution_plans(self, graph: Graph, modes: Sequence[Any] | None, handle: Handle | str | None) -> None: ...

    def check_support(self, graph: Graph, handle: Handle | str | None) -> None: ...

    def build_plans(self, graph: Graph, policy: Any, handle: Handle | str | None) -> None: ...

    def get_execution_plan_count(self, graph: Graph) -> int: ...

    def execute_plan_at_index(self, graph: Graph, variant_pack: Mapping[Any, Any], index: int) -> dict[str, Any]: ...

    def autotune(
        self, graph: Graph, variant_pack: Mapping[Any, Any] | None, handle: Handle | str | None, **options: Any
    ) -> Any: ...

    def emit_mlir(self, graph: Graph) -> str: ...

    def compile_to_artifact(self, graph: Graph, target: str, **options: Any) -> bytes: ...


_PLANNER: list[Planner] = []  # the explicit registry of one; the last registration wins


def register_planner(planner: Planner) -> None:
    """Called by ``fusegraph.select`` at import time (and by tests that stub the layers above)."""
    _PLANNER[:] = [planner]


def planner() -> Planner:
    if not _PLANNER:
        raise FusegraphError(
            "no planner is registered: the plan methods of Graph need the selection layer "
            "(import fusegraph, or fusegraph.select, before calling build/execute)"
        )
    return _PLANNER[0]


def _check_workspace(workspace: Any, method: str) -> None:
    """cuDNN's execute takes a workspace second; a string there is an engine name written
    positionally (``g.execute(pack, "reference")``), which would otherwise be ignored."""
    if workspace is None:
        return
    if any(hasattr(workspace, a) for a in ("__array_interface__", "__dlpack__", "__cuda_array_interface__", "nbytes")):
        return
    hint = (
        f"; to pick an engine write {method}(variant_pack, engine={workspace!r})"
        if isinstance(workspace, str)
        else ""
    )
    raise VariantPackError(
        f"{method}(): the second positional argument is the workspace (a buffer or array), "
        f"got {type(workspace).__name__} {workspace!r}{hint} (engine and handle are keyword-only)"
    )


class PlanMethods:
    """The plan API on ``Graph`` (a mixin: each method forwards to the registered planner)."""

    def execute(
        self,
        variant_pack: Mapping[Any, Any],
        workspace: Any = None,
        *,
        handle: Handle | str | None = None,
        engine: str | None = None,
    ) -> dict[str, Any]:
        """Runs the graph; outputs in the pack are written in place, the rest returned by name.

        Values may be numpy arrays or fusegraph Buffers. Without a built plan, the default
        plan for ``handle`` is built first (see ``build``). ``workspace`` is accepted for
        cuDNN's signature; engines allocate their own.
        """
        _check_workspace(workspace, "execute")
        return planner().execute(self._graph(), variant_pack, handle, engine)

    def build(self, handle: Handle | str | None = None, engine: str | None = None, **options: Any) -> Any:
        """Builds (or loads from cache) the plan that ``execute`` will use on ``handle``."""
        return planner().build(self._graph(), handle, engine, **options)

    def create_execution_plans(self, modes: Sequence[Any] | None = None, handle: Handle | str | None = None) -> Graph:
        planner().create_execution_plans(self._graph(), modes, handle)
        return self._graph()

    def check_support(self, handle: Handle | str | None = None) -> Graph:
        planner().check_support(self._graph(), handle)
        return self._graph()

    def build_plans(self, policy: Any = None, handle: Handle | str | None = None) -> Graph:
        planner().build_plans(self._graph(), policy, handle)
        return self._graph()

    def get_execution_plan_count(self) -> int:
        return planner().get_execution_plan_count(self._graph())

    def execute_plan_at_index(self, variant_pack: Mapping[Any, Any], index: int, workspace: Any = None) -> dict[str, Any]:
        _check_workspace(workspace, "execute_plan_at_index")
        return planner().execute_plan_at_index(self._graph(), variant_pack, index)

    def autotune(self, variant_pack: Mapping[Any, Any] | None = None, handle: Handle | str | None = None, **options: Any) -> Any:
        """Times every applicable (engine, knobs) and remembers the fastest (tuning DB)."""
        return planner().autotune(self._graph(), variant_pack, handle, **options)

    def emit_mlir(self) -> str:
        """The torch-dialect MLIR the IREE engine compiles (for debugging)."""
        return planner().emit_mlir(self._graph())

    def compile_to_artifact(self, target: str = "cpu", **options: Any) -> bytes:
        """Ahead-of-time compile for a target ("cpu", "cuda", "hip:gfx942"...); load with
        ``fusegraph.engines.iree.load_artifact``, also on another machine."""
        return planner().compile_to_artifact(self._graph(), target, **options)

    def _graph(self) -> Graph:
        return cast("Graph", self)  # the mixin is only ever part of graph.Graph

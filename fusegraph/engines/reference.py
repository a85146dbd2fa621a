"""The reference engine: float64 NumPy, the ground truth every engine is tested against.

Its library is the reference layer (NumPy + SciPy's special functions, ~0.1 s to import):
imported when a plan runs, not when the registry lists the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusegraph import __version__
from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support, distribution_version
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle
from fusegraph.runtime.variant_pack import outputs_like, resolve_pack


def write_outputs(graph: Graph, values: Mapping[str, np.ndarray], given: Mapping[str, Any]) -> dict[str, Any]:
    """Casts results to output dtypes; writes into caller arrays, returns the others."""
    from fusegraph.reference.executor import cast_to

    out: dict[str, Any] = {}
    for t in graph.outputs():
        v = cast_to(np.asarray(values[t.name]), t.dtype)
        if t.name in given:
            given[t.name][...] = v
        else:
            arr = layout.empty_strided(t.shape, t.strides, t.dtype.numpy)
            arr[...] = v
            out[t.name] = arr
    return out


class ReferencePlan(ExecutionPlan):
    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        from fusegraph.reference.executor import run_reference

        pack = resolve_pack(self.graph, variant_pack)
        values = run_reference(self.graph, pack.inputs)
        return outputs_like(write_outputs(self.graph, values, pack.outputs), variant_pack.values())

    def serialize(self) -> bytes:
        """The graph itself: that is all a reference plan is."""
        return json.dumps({"engine": "reference", "graph": self.graph.to_json()}).encode()


class ReferenceEngine:
    name = "reference"
    version = __version__

    def available(self) -> Support:
        return Support.yes()

    def supports(self, graph: Graph, handle: Handle) -> Support:
        if handle.device.is_gpu:
            return Support.no("the reference engine runs on the host only (NumPy); not on a GPU handle")
        return Support.yes()

    def knobs(self, graph: Graph, handle: Handle) -> Sequence[Knob]:
        return []

    def build(self, graph: Graph, handle: Handle, config: EngineConfig | None = None) -> ExecutionPlan:
        return ReferencePlan(graph, handle, config or EngineConfig(self.name))

    def library_versions(self) -> dict[str, str]:
        # the distribution's version is scipy.__version__, without importing SciPy (0.1 s)
        return {"numpy": np.__version__, "scipy": distribution_version("scipy")}

    def load_plan(self, data: bytes, handle: Handle) -> ExecutionPlan:
        d = json.loads(data.decode())
        return self.build(Graph.from_json(d["graph"]).validate(), handle)

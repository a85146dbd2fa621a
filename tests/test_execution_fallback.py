"""An engine that accepted a graph and then fails it at execution: the failure is a typed
ExecutionError naming the graph and the engine, and, where the caller pinned no engine,
the selection falls back to the next candidate (the GPU fuzz run's 'raised on a valid graph'
findings: a bare RuntimeError from torch inside a plan used to reach the caller)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from engine_fakes import FakeEngine, FakePlan, chain_graph, registry_with

import fusegraph as fg
from fusegraph.engines.base import EngineConfig, ExecutionPlan
from fusegraph.engines.registry import using
from fusegraph.reference.executor import run_reference


class _Failing(FakePlan):
    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        self.fake.calls += 1
        raise fg.ExecutionError(f"{self.config.engine} plan for graph '{self.graph.name}' failed: RuntimeError: boom")


class FailingEngine(FakeEngine):
    def build(self, graph: fg.Graph, handle: fg.Handle, config: EngineConfig | None = None) -> ExecutionPlan:
        self.builds += 1
        return _Failing(graph, handle, config or EngineConfig(self.name), self)


def _inputs(g: fg.Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in g.inputs()}


def test_unpinned_execution_falls_back_to_the_next_engine(rng: np.random.Generator) -> None:
    bad, good = FailingEngine("iree"), FakeEngine("torch")
    g = chain_graph(6)
    pack = _inputs(g, rng)
    with using(registry_with(bad, good)):
        out = g.execute(pack)
        again = g.execute(pack)
    want = run_reference(g, pack)
    assert bad.calls == 1 and good.calls == 2  # the failed plan is not tried again
    np.testing.assert_allclose(out["y"], want["y"], rtol=1e-6)
    np.testing.assert_allclose(again["y"], want["y"], rtol=1e-6)
    failed = [c for c in g._selection.candidates if c.config.engine == "iree"]
    assert failed and "execution failed" in failed[0].error


def test_pinned_execution_raises_the_typed_error(rng: np.random.Generator) -> None:
    g = chain_graph(6)
    with using(registry_with(FailingEngine("iree"), FakeEngine("torch"))), pytest.raises(fg.ExecutionError, match="iree plan for graph 'chain'"):
        g.execute(_inputs(g, rng), engine="iree")

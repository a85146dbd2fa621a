"""A tiny fusegraph engine plugin: runs pointwise-only graphs with NumPy in float32.

It touches nothing inside fusegraph: the package metadata's entry points are all it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support
from fusegraph.graph.ops import OpKind

__version__ = "0.0.1"

_UNARY = {"relu_fwd": lambda a: np.maximum(a, 0), "neg": np.negative, "exp": np.exp, "abs": np.abs}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum}


class TinyPlan(ExecutionPlan):
    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        from fusegraph.runtime.variant_pack import resolve_pack

        pack = resolve_pack(self.graph, variant_pack)
        env = {k: np.asarray(v, dtype=np.float32) for k, v in pack.inputs.items()}
        for t in self.graph.tensors:
            if t.is_scalar:
                env[t.name] = np.float32(t.value)
        for node in self.graph.topological_order():
            mode = node.attrs.mode.value
            a = env[node.inputs["a"].name]
            y = _UNARY[mode](a) if mode in _UNARY else _BINARY[mode](a, env[node.inputs["b"].name])
            env[node.outputs["y"].name] = y
        out = {}
        for t in self.graph.outputs():
            arr = np.asarray(env[t.name]).astype(t.dtype.numpy)
            if t.name in pack.outputs:
                pack.outputs[t.name][...] = arr
            else:
                out[t.name] = np.broadcast_to(arr, t.shape).copy()
        return out


class TinyEngine:
    name = "tiny"
    version = __version__

    def available(self) -> Support:
        return Support.yes()

    def supports(self, graph: Any, handle: Any) -> Support:
        if handle.device.is_gpu:
            return Support.no("tiny runs on the CPU only")
        for n in graph.nodes:
            if n.kind != OpKind.POINTWISE or n.attrs.mode.value not in {**_UNARY, **_BINARY}:
                return Support.no(f"node '{n.name}': tiny runs only add/sub/mul/max/relu/neg/exp/abs")
        return Support.yes()

    def knobs(self, graph: Any, handle: Any) -> Sequence[Knob]:
        return [Knob("unroll", 1, (1, 2), description="does nothing; a knob to tune over")]

    def build(self, graph: Any, handle: Any, config: EngineConfig | None = None) -> ExecutionPlan:
        return TinyPlan(graph, handle, config or EngineConfig(self.name))


class TinyHeuristic:
    """Ranks the tiny engine first for graphs it supports."""

    name = "tiny-first"

    def rank(self, graph: Any, handle: Any, mode: Any, engines: Sequence[Any]) -> list[EngineConfig] | None:
        tiny = [e for e in engines if e.name == "tiny"]
        if tiny and tiny[0].supports(graph, handle):
            return [EngineConfig("tiny")]
        return None

"""A graph as one Python function over torch tensors: what an eager plan calls and what
``torch.compile`` traces."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from fusegraph.engines.torch import steps as torch_fusion
from fusegraph.engines.torch.context import _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch, torch_dtype
from fusegraph.engines.torch.lower import LOWER
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node


def _node_thunk(ctx: _Ctx, node: Node) -> Callable[[dict[str, Tensor]], None]:
    """One node as a closure over its lowering, port names and output casts."""
    lower = LOWER[node.kind]
    ports = [(p, t.name) for p, t in node.inputs.items()]
    outs = [(port, t.name, torch_dtype(t.dtype)) for port, t in node.outputs.items()]

    def step(env: dict[str, Tensor]) -> None:
        res = lower(ctx, node, {p: env[n] for p, n in ports})
        for port, name, target in outs:
            value = res[port]
            env[name] = value if value.dtype == target else value.to(target)

    return step


def _graph_function(
    graph: Graph, ctx: _Ctx, device: Any, fused: Mapping[str, torch_fusion.Step]
) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
    """One Python function running the graph's nodes in order (what torch.compile traces);
    the nodes of each multi-node step run as one where the last of them stood."""
    torch = _torch()
    swallowed = {id(n) for fc in fused.values() for n in fc.nodes[:-1]}
    order: list[Node | torch_fusion.Step] = [
        fused.get(n.name, n) for n in graph.topological_order() if id(n) not in swallowed
    ]
    outputs = graph.outputs()
    constants = {
        t.name: torch.full((1,), t.value, dtype=torch_dtype(t.dtype), device=device)
        for t in graph.tensors
        if t.is_scalar
    }

    out_names = [t.name for t in outputs]
    if not ctx.compiled:
        # Eager: each step a closure with everything that does not change between calls
        # settled now (names, casts, conv arguments); Python is the per-op cost left.
        thunks = [_node_thunk(ctx, n) if isinstance(n, Node) else n.thunk(ctx.memory_format) for n in order]

        def run_eager(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
            env: dict[str, Tensor] = {**constants, **inputs}
            for step in thunks:
                step(env)
            return {n: env[n] for n in out_names}

        return run_eager

    # Compiled: the plain nodes (Inductor does its own fusion), in code dynamo traces well.
    assert not fused, "multi-node steps are for eager plans"
    nodes = graph.topological_order()

    def run(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        env: dict[str, Tensor] = {**constants, **inputs}
        for node in nodes:
            ins = {p: env[t.name] for p, t in node.inputs.items()}
            outs = LOWER[node.kind](ctx, node, ins)
            for port, value in outs.items():
                t = node.outputs[port]
                target = torch_dtype(t.dtype)
                env[t.name] = value if value.dtype == target else value.to(target)
        return {t.name: env[t.name] for t in outputs}

    # A code object of its own per graph: torch.compile caches (and caps recompiles) per
    # code object, so plans sharing ``run``'s would evict each other and fall back to eager.
    tag = "fusegraph_" + "".join(ch if ch.isalnum() else "_" for ch in graph.name)[:40] + f"_{id(ctx):x}"
    code = run.__code__.replace(co_name=tag, co_qualname=tag)
    return types.FunctionType(code, run.__globals__, tag, run.__defaults__, run.__closure__)  # type: ignore[no-any-return]

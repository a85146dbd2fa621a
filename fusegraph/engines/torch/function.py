"""A graph as one Python function over torch tensors: what an eager plan calls and what
``torch.compile`` traces."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import Any

from fusegraph.engines.torch import steps as torch_fusion
from fusegraph.engines.torch.context import _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch, torch_dtype
from fusegraph.engines.torch.lower import LOWER
from fusegraph.engines.torch.lower_pointwise import _pw_fns
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import OpKind, PointwiseAttrs, PointwiseMode


def _pointwise_thunk(ctx: _Ctx, node: Node) -> Callable[[dict[str, Tensor]], None] | None:
    """A pointwise node with what _lower_pointwise works out on every call -- each operand's
    cast to the compute type, the mode's torch expression, the output cast -- settled once
    (types are static: every value in a plan's environment has its tensor's declared
    type). On a 64x64 relu that is most of the plan's host time above the kernel. None for
    modes whose lowering does more than that (select promotes its branches)."""
    attrs = node.attrs
    if not isinstance(attrs, PointwiseAttrs) or attrs.mode == PointwiseMode.BINARY_SELECT:
        return None
    fn = _pw_fns()[attrs.mode]
    if attrs.mode == PointwiseMode.RELU_FWD:
        plain = (attrs.param("relu_lower_clip"), attrs.param("relu_lower_clip_slope")) == (0.0, 0.0)
        if plain and math.isinf(attrs.param("relu_upper_clip")) and attrs.param("relu_upper_clip") > 0:
            relu = _torch().relu
            fn = lambda a, b, c, p: relu(a)  # noqa: E731
    cd = ctx.compute(node)

    def cast(port: str) -> tuple[str | None, Any]:
        t = node.inputs.get(port)
        if t is None:
            return None, None
        if port == "c" or id(node) in ctx.native or not (t.dtype.is_float and cd.is_float) or t.dtype == cd:
            return t.name, None
        return t.name, torch_dtype(cd)

    (an, ca), (bn, cb), (cn, _) = cast("a"), cast("b"), cast("c")
    assert an is not None
    out = node.outputs["y"]
    name, target = out.name, torch_dtype(out.dtype)

    # What the step settles is bound as defaults, not closed over: the plan keeps one tuple
    # per step instead of a cell per name (objects the collector walks, ~20 a region piece,
    # hundreds of pieces a session), and a default is a local, read faster than a cell.
    def step(env: dict[str, Tensor], an: str = an, ca: Any = ca, bn: str | None = bn, cb: Any = cb,
             cn: str | None = cn, fn: Any = fn, attrs: PointwiseAttrs = attrs, name: str = name,
             target: Any = target) -> None:
        a = env[an]
        if ca is not None:
            a = a.to(ca)
        b = env[bn] if bn is not None else None
        if cb is not None and b is not None:
            b = b.to(cb)
        y = fn(a, b, env[cn] if cn is not None else None, attrs)
        env[name] = y if y.dtype == target else y.to(target)

    return step


def _node_thunk(ctx: _Ctx, node: Node) -> Callable[[dict[str, Tensor]], None]:
    """One node as a step with its lowering, port names and output casts settled."""
    if node.kind == OpKind.POINTWISE and not ctx.functional:
        settled = _pointwise_thunk(ctx, node)
        if settled is not None:
            return settled
    lower = LOWER[node.kind]
    ports = tuple((p, t.name) for p, t in node.inputs.items())
    outs = tuple((port, t.name, torch_dtype(t.dtype)) for port, t in node.outputs.items())

    def step(env: dict[str, Tensor], lower: Any = lower, ctx: _Ctx = ctx, node: Node = node,
             ports: tuple[tuple[str, str], ...] = ports, outs: tuple[tuple[str, str, Any], ...] = outs) -> None:
        # (bound as defaults: see _pointwise_thunk)
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

        def run_eager(inputs: dict[str, Tensor], constants: dict[str, Tensor] = constants,
                      thunks: list[Any] = thunks, out_names: list[str] = out_names) -> dict[str, Tensor]:
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

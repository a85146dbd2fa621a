"""Partial support: split a graph no single engine runs into engine-supported pieces.

Policy (deterministic, cycle-free by construction):

1. Engines are tried in the caller's preference order (the heuristic ranking).
2. Nodes are scheduled like a list scheduler: among the nodes whose producers are all
   scheduled, the current piece takes the first (in topological order) that its engine
   still supports together with the piece (``supports()`` on the extracted subgraph).
3. When no ready node fits, the piece is closed and a new one starts with the first ready
   node and the first engine (in preference order) that supports that node alone.
4. The reference engine (CPU handles only) takes only nodes no other engine supports.
5. A node that no engine supports raises UnsupportedError listing every engine's reason.

Pieces are thus contiguous runs of one topological order: each reads only graph inputs
and outputs of earlier pieces, so there is never a cycle between pieces. Intermediates
that cross pieces are materialized with their declared dtype and (packed) strides and
pass through host memory (a cost the heuristics account for by ranking partitions below
whole-graph plans). The reference engine takes part only on CPU handles (its supports()
refuses GPU handles), so a GPU graph never silently runs on NumPy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.engines.base import Engine, EngineConfig, ExecutionPlan, Support
from fusegraph.errors import UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict
from fusegraph.runtime.handle import Handle
from fusegraph.runtime.variant_pack import resolve_pack

log = logging.getLogger("fusegraph.select")

PARTITION = "partition"  # the engine name partitioned plans carry in their EngineConfig


@dataclass
class Piece:
    engine: str
    nodes: list[str]  # node names, in execution order
    graph: Graph  # the extracted, validated subgraph

    @property
    def inputs(self) -> list[str]:
        return [t.name for t in self.graph.inputs()]

    @property
    def outputs(self) -> list[str]:
        return [t.name for t in self.graph.outputs()]


def extract(graph: Graph, node_names: Sequence[str], name: str | None = None) -> Graph:
    """The subgraph of ``node_names``: what it reads from outside becomes inputs, what the
    rest of the graph (or the caller) reads of it becomes outputs."""
    graph.ensure_valid()
    chosen = set(node_names)
    nodes = [n for n in graph.nodes if n.name in chosen]
    produced = {t.name for n in nodes for t in n.outputs.values()}
    read_inside = {t.name for n in nodes for t in n.inputs.values()}
    read_outside = {t.name for n in graph.nodes if n.name not in chosen for t in n.inputs.values()}
    graph_outputs = {t.name for t in graph.outputs()}
    d = graph_to_dict(graph)
    tensors = []
    for e in d["tensors"]:
        tname = e["name"]
        t = graph.tensor_by_name(tname)
        if tname in produced:
            entry = dict(e)
            if tname in graph_outputs or tname in read_outside:
                entry.update(is_virtual=False, is_output=True, dim=list(t.shape),
                             stride=list(t.strides), data_type=t.dtype.value,
                             set=["dim", "stride", "data_type"])
            tensors.append(entry)
        elif tname in read_inside:
            entry = dict(e)
            if not t.is_scalar:
                entry.update(is_virtual=False, is_output=False, dim=list(t.shape),
                             stride=list(t.strides), data_type=t.dtype.value,
                             set=["dim", "stride", "data_type"])
            tensors.append(entry)
    d["tensors"] = tensors
    d["nodes"] = [e for e in d["nodes"] if e["name"] in chosen]
    d["name"] = name or f"{graph.name}.sub"
    sub = graph_from_dict(d)
    return sub.validate()  # type: ignore[no-any-return]


def _supports(engine: Engine, graph: Graph, handle: Handle) -> Support:
    try:
        return engine.supports(graph, handle)
    except Exception as exc:  # a plugin's bug is a "no", with the reason
        return Support.no(f"supports() raised {type(exc).__name__}: {exc}")


def split(graph: Graph, handle: Handle, engines: Sequence[Engine]) -> list[Piece]:
    """Pieces covering the graph (see the module docstring for the policy)."""
    graph.ensure_valid()
    order = graph.topological_order()
    index = {n.name: i for i, n in enumerate(order)}
    producer = {t.name: n.name for n in order for t in n.outputs.values()}
    deps = {n.name: {producer[t.name] for t in n.inputs.values() if t.name in producer} for n in order}
    done: set[str] = set()
    pieces: list[tuple[str, list[str]]] = []
    alone: dict[tuple[str, str], Support] = {}

    def supports_alone(e: Engine, node: Node) -> Support:
        key = (e.name, node.name)
        if key not in alone:
            alone[key] = _supports(e, extract(graph, [node.name], f"{graph.name}.{node.name}"), handle)
        return alone[key]

    by_name = {e.name: e for e in engines}
    while len(done) < len(order):
        ready = [n for n in order if n.name not in done and deps[n.name] <= done]
        ready.sort(key=lambda n: index[n.name])
        placed = False
        if pieces:
            eng_name, members = pieces[-1]
            eng = by_name[eng_name]
            for n in ready:
                if not supports_alone(eng, n):
                    continue
                if eng_name == "reference" and any(
                    e.name != "reference" and supports_alone(e, n) for e in engines
                ):
                    continue  # the reference only takes what no other engine can
                if _supports(eng, extract(graph, [*members, n.name]), handle):
                    members.append(n.name)
                    done.add(n.name)
                    placed = True
                    break
        if placed:
            continue
        first = ready[0]
        reasons = []
        for e in engines:
            s = supports_alone(e, first)
            if s:
                pieces.append((e.name, [first.name]))
                done.add(first.name)
                break
            reasons.append(f"{e.name}: {s.reason}")
        else:
            raise UnsupportedError(
                f"no engine supports this node on {handle.device}, so the graph cannot be split "
                "into supported pieces:\n  " + "\n  ".join(reasons or ["no engine available"]),
                node=first.name,
            )
    return [
        Piece(eng, members, extract(graph, members, f"{graph.name}.part{i}.{eng}"))
        for i, (eng, members) in enumerate(pieces)
    ]


def partition_config(pieces: Sequence[Piece]) -> EngineConfig:
    return EngineConfig(PARTITION, (("pieces", tuple((p.engine, tuple(p.nodes)) for p in pieces)),))


def pieces_from_config(graph: Graph, config: EngineConfig) -> list[Piece]:
    spec = config.get("pieces")
    if not spec:
        raise UnsupportedError("a partition config needs its 'pieces' knob")
    return [
        Piece(str(eng), list(nodes), extract(graph, list(nodes), f"{graph.name}.part{i}.{eng}"))
        for i, (eng, nodes) in enumerate(spec)
    ]


def to_host(value: Any) -> Any:
    """A piece's result as something every engine takes: a numpy array where possible."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "to_numpy"):  # fusegraph Buffer
        return value.to_numpy()
    if type(value).__module__.startswith("torch"):
        import torch

        host = value.detach().cpu()
        if host.dtype == torch.bfloat16:
            import ml_dtypes

            return host.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return host.numpy()
    return np.asarray(value)


class PartitionPlan(ExecutionPlan):
    """Runs its pieces' plans in order, handing intermediates from piece to piece."""

    def __init__(self, graph: Graph, handle: Handle, config: EngineConfig, plans: Sequence[ExecutionPlan]) -> None:
        super().__init__(graph, handle, config)
        self.plans = list(plans)

    @property
    def workspace_size(self) -> int:
        return max((p.workspace_size for p in self.plans), default=0)

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        pack = resolve_pack(self.graph, variant_pack)
        env: dict[str, Any] = dict(pack.inputs)
        for plan in self.plans:
            sub_in = {t.name: env[t.name] for t in plan.graph.inputs()}
            for name, value in plan.execute(sub_in).items():
                env[name] = value
        out: dict[str, Any] = {}
        for t in self.graph.outputs():
            value = env[t.name]
            if t.name in pack.outputs:
                pack.outputs[t.name][...] = to_host(value)
            else:
                out[t.name] = value
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "engine": PARTITION,
            "pieces": [{"engine": p.engine, "config": str(p.config), "nodes": [n.name for n in p.graph.nodes]} for p in self.plans],
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{p.config}:{len(p.graph.nodes)}" for p in self.plans)
        return f"<PartitionPlan [{inner}] on {self.handle.device}>"

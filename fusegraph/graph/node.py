"""Node: one op of a graph, with named input and output ports."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusegraph.graph.ops import OPS, OpAttrs, OpKind, OpSpec
from fusegraph.graph.tensor import TensorAttr


@dataclass(eq=False)
class Node:
    name: str
    kind: OpKind
    attrs: OpAttrs
    inputs: dict[str, TensorAttr]
    outputs: dict[str, TensorAttr]
    # Scratch data of passes and engines (never serialized, never part of the key).
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def spec(self) -> OpSpec:
        return OPS[self.kind]

    def input_list(self, prefix: str = "x") -> list[TensorAttr]:
        """Inputs of a variadic port (``x0``, ``x1``...) in order."""
        return [t for p, t in self.inputs.items() if p.startswith(prefix) and p[len(prefix):].isdigit()]

    def __repr__(self) -> str:
        ins = ", ".join(f"{p}={t.name}" for p, t in self.inputs.items())
        outs = ", ".join(f"{p}={t.name}" for p, t in self.outputs.items())
        return f"Node({self.name!r}, {self.kind.value}, in: {ins}; out: {outs})"

"""What every ONNX-level pattern shares: the graph context the rewrites edit, the checks
of constants and readers they make, and how a matched subgraph becomes one fused node.

A fused node (domain :data:`FUSED_DOMAIN`, op type ``<Kind>_<k>``) stands for the nodes it
replaced; its attributes say what it computes (the attention's scale, a norm's epsilon).
The replaced nodes are kept as the body of a model-local ONNX function of the same name,
so wherever the fused node is not claimed (an engine refuses it, a unit falls back) ONNX
Runtime runs exactly the original nodes. Patterns are exact: every constant is checked
against the value the pattern's formula uses, rounded once to the tensor's type, and every
intermediate value must have no reader outside the match (and not be a graph output).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from onnx import helper

from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.ops.table import FUSED_DOMAIN, fused_kind

__all__ = ["FUSED_DOMAIN", "Ctx", "Refused", "fused_kind", "rounded"]


class Refused(Exception):
    """A pattern's anchor matched but the rest did not; ``reason`` names node and value."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class Ctx:
    """Producer/consumer maps of the graph, kept current as rewrites replace nodes; the
    refusals of patterns that started to match (for the partition report)."""

    def __init__(self, og: OnnxGraph, exclude: Iterable[str]) -> None:
        self.og = og
        self.exclude = frozenset(exclude)
        self.refused: dict[str, str] = {}  # anchor node -> "pattern: reason"
        self._fused = 0
        self.refresh()

    def refresh(self) -> None:
        self.producer = self.og.producers()
        self.consumers = self.og.consumers()

    def sole_reader(self, value: str) -> ONode | None:
        if value in self.og.outputs:
            return None
        readers = self.consumers.get(value, [])
        return readers[0] if len(readers) == 1 else None

    def readers(self, value: str) -> list[ONode]:
        return list(self.consumers.get(value, []))

    def consts(self, names: Iterable[str]) -> list[np.ndarray] | None:
        out = []
        for n in names:
            if not n or n not in self.og.constants:
                return None
            out.append(self.og.constants[n])
        return out

    def new_const(self, base: str, arr: np.ndarray) -> str:
        name, k = f"{base}", 0
        while name in self.og.constants or name in self.og.types:
            k += 1
            name = f"{base}_{k}"
        self.og.constants[name] = arr
        return name

    def replace(self, old: list[ONode], new: ONode) -> None:
        """Puts ``new`` where the first of ``old`` was and drops the rest (maps kept current)."""
        ids = {id(n) for n in old}
        pos = next(k for k, n in enumerate(self.og.nodes) if n is old[0])
        self.og.nodes[pos] = new
        self.og.nodes = [n for n in self.og.nodes if id(n) not in ids]
        for n in old:
            for o in n.outputs:
                if self.producer.get(o) is n:
                    del self.producer[o]
                if o and o not in new.outputs:
                    self.og.types.pop(o, None)
            for i in n.all_inputs():
                readers = self.consumers.get(i, [])
                readers[:] = [r for r in readers if id(r) not in ids]
        for o in new.outputs:
            if o:
                self.producer[o] = new
        for i in new.all_inputs():
            self.consumers.setdefault(i, []).append(new)
        for n in old:
            for i in n.inputs:
                if i in self.og.constants and not self.consumers.get(i) and i not in self.og.outputs:
                    del self.og.constants[i]

    def allowed(self, *nodes: ONode) -> bool:
        return not any(n.op_type in self.exclude for n in nodes)

    def excluded(self, nodes: Sequence[ONode]) -> str | None:
        ops = sorted({n.op_type for n in nodes if n.op_type in self.exclude})
        return f"op type(s) {', '.join(ops)} in op_types_to_exclude" if ops else None

    # ---- matching helpers ---------------------------------------------------------------------
    def elem(self, value: str) -> int:
        return self.og.elem(value)

    def scalar(self, value: str) -> float | None:
        """The value of a one-element floating-point constant, else None."""
        c = self.og.constants.get(value) if value else None
        if c is None or c.size != 1 or c.dtype.kind != "f":
            return None
        return float(c.reshape(-1)[0])

    def const_is(self, value: str, want: float) -> bool:
        """``value`` is a one-element float constant equal to ``want``, exactly or as
        ``want`` rounded once to the constant's type (an export of ``math.sqrt(2)`` writes
        float32(sqrt 2))."""
        c = self.og.constants.get(value) if value else None
        if c is None or c.size != 1 or c.dtype.kind != "f":
            return False
        got = float(c.reshape(-1)[0])
        return got == want or got == rounded(want, c.dtype)

    def made_by(self, value: str, *ops: str) -> ONode | None:
        p = self.producer.get(value)
        return p if p is not None and p.is_default_domain and p.op_type in ops else None

    def only_reader(self, value: str, what: str, inside: Sequence[ONode]) -> None:
        """Raises Refused unless every reader of ``value`` is one of ``inside``."""
        if value in self.og.outputs:
            raise Refused(f"{what} '{value}' is a graph output")
        ids = {id(n) for n in inside}
        others = [r.name for r in self.consumers.get(value, []) if id(r) not in ids]
        if others:
            raise Refused(f"{what} '{value}' is also read by {', '.join(others[:3])}")

    def next_node(self, value: str, what: str, *ops: str) -> ONode:
        """The one node reading ``value``, of one of ``ops``; else Refused saying why."""
        if value in self.og.outputs:
            raise Refused(f"{what} '{value}' is a graph output")
        readers = self.consumers.get(value, [])
        if len(readers) != 1:
            raise Refused(f"{what} '{value}' is read by {len(readers)} nodes ({', '.join(r.name for r in readers[:3])})")
        if readers[0].op_type not in ops or not readers[0].is_default_domain:
            raise Refused(f"{what} '{value}' is read by {readers[0].op_type} '{readers[0].name}', not {' or '.join(ops)}")
        return readers[0]

    def refuse(self, pattern: str, anchor: ONode, reason: str) -> None:
        self.refused[anchor.name] = f"{pattern} at '{anchor.name}': {reason}"

    def fuse(self, kind: str, nodes: Sequence[ONode], output: str, roles: dict[str, str],
             attrs: dict[str, Any]) -> ONode:
        """Replaces ``nodes`` (their values read only among them, but ``output``) by one fused
        node reading every outside value they read. ``roles`` names the inputs the lowering
        reads (an attribute each: the input's position); the others only feed the fallback."""
        at = {id(n): k for k, n in enumerate(self.og.nodes)}  # list.index compared whole nodes field by field
        order = sorted(nodes, key=lambda n: at[id(n)] if id(n) in at else self.og.nodes.index(n))
        made = {o for n in order for o in n.outputs if o}
        ext: list[str] = []
        for n in order:
            for i in n.inputs:
                if i and i not in made and i not in ext:
                    ext.append(i)
        for _role, value in roles.items():
            if value not in ext:
                ext.append(value)
        self._fused += 1
        op_type = f"{kind}_{self._fused}"
        while any(f.name == op_type and f.domain == FUSED_DOMAIN for f in self.og.functions):
            self._fused += 1
            op_type = f"{kind}_{self._fused}"
        full = {**{role: ext.index(v) for role, v in roles.items()}, **attrs}
        domains = {n.domain or "" for n in order}
        opsets = [helper.make_opsetid("", self.og.opset)] + [
            o for o in self.og.opset_imports if o.domain not in ("", "ai.onnx") and o.domain in domains
        ]
        body = [n.to_proto() for n in order]
        self.og.functions.append(
            helper.make_function(FUSED_DOMAIN, op_type, ext, [output], body, opsets, attributes=sorted(full))
        )
        if not any(o.domain == FUSED_DOMAIN for o in self.og.opset_imports):
            self.og.opset_imports.append(helper.make_opsetid(FUSED_DOMAIN, 1))
        self.og.ir_version = max(self.og.ir_version, 8)  # model-local functions
        names = {n.name for n in self.og.nodes}
        name = f"{order[-1].name}/{kind}"
        while name in names:
            name += "_"
        new = ONode(
            name, op_type, FUSED_DOMAIN, tuple(ext), (output,), full, None,
            sources=tuple(s for n in order for s in n.sources),
            source_ops=tuple(op for n in order for _, op in n.origin()),
        )
        self.replace([order[-1], *order[:-1]], new)  # where the last was: every input is made by then
        return new


def rounded(value: float, elem_dtype: np.dtype[Any]) -> float:
    """``value`` rounded once to the constant's type (what an exporter writes)."""
    return float(np.asarray(value, dtype=np.float64).astype(elem_dtype))

"""Which values cross a group's border: what a group of nodes reads from outside it and
what it produces that is read outside (a unit's inputs and outputs). The plan, its floor
and its content keys all cut groups the same way, so they share this one function."""

from __future__ import annotations

from collections.abc import Sequence

from fusegraph.onnx.model import OnnxGraph, ONode


def read_outside(og: OnnxGraph, members: Sequence[ONode]) -> tuple[list[str], list[str]]:
    """(values the group reads from outside, values it produces that are read outside)."""
    inside = {id(n) for n in members}
    produced = {o for n in members for o in n.outputs if o}
    ins: list[str] = []
    for n in members:
        for i in n.all_inputs():
            if i not in produced and i not in og.constants and i not in ins:
                ins.append(i)
    read_outside = {i for n in og.nodes if id(n) not in inside for i in n.all_inputs()}
    outs = [o for n in members for o in n.outputs if o and (o in read_outside or o in og.outputs)]
    return ins, list(dict.fromkeys(outs))


__all__ = ["read_outside"]

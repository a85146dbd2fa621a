"""A region's nodes cut out of their graph as a standalone, validated Graph, its tensors
and nodes renamed canonically (in0.., out0.., v0.., n0..) so that the same computation
on the same shapes has one content key wherever it occurs: twelve identical transformer
layers are measured once, and a verdict found for one model serves another."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fusegraph.graph.graph import Graph, ValidatedState
from fusegraph.graph.node import Node
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict


@dataclass(frozen=True)
class Cut:
    """A standalone graph and how its tensors map to the parent's."""

    graph: Graph
    inputs: tuple[str, ...]  # parent tensor names, in the order of in0, in1, ...
    outputs: tuple[str, ...]  # parent tensor names, in the order of out0, out1, ...


class Whole:
    """The parent's ``graph_to_dict`` with its tensors and nodes indexed by name, made once
    where a caller cuts many pieces of one graph: indexing it per cut was quadratic in the
    graph's size (a ViT's 160 pieces, issue 24 item 6)."""

    def __init__(self, parent: Graph) -> None:
        self.d = graph_to_dict(parent)
        self.by_name: dict[str, dict[str, Any]] = {e["name"]: e for e in self.d["tensors"]}
        self.node_at: dict[str, int] = {e["name"]: k for k, e in enumerate(self.d["nodes"])}
        # A cut's contents (its dict but the name) -> what validating it the first time left:
        # a model's repeated layers cut the same contents again and again (Swin-T: 177 cuts),
        # and validating a graph is a function of its contents (issue 24 item 6).
        self.seen: dict[str, ValidatedState] = {}


def _build(d: dict[str, Any], seen: dict[str, ValidatedState] | None) -> Graph:
    """``graph_from_dict(d)`` validated. Where ``seen`` holds the same contents validated
    before, their state is copied instead: ``validate`` infers from the contents alone, so it
    would infer (and check) the same again."""
    if seen is None:
        return graph_from_dict(d).validate()
    sig = repr((d["tensors"], d["nodes"]))
    done = seen.get(sig)
    g = graph_from_dict(d)
    if done is None:
        seen[sig] = g.validate().validated_state()  # taken now: a later change to ``g`` changes nothing here
        return g
    return g.adopt_validated(done)


def cut(parent: Graph, nodes: Sequence[Node], keep: frozenset[str] | set[str], name: str,
        whole: Whole | dict[str, Any] | None = None) -> Cut:
    """``nodes`` (in topological order) of the validated ``parent`` as a Graph of their
    own. A tensor they read but do not write becomes an input; one they write that
    ``keep`` names (read elsewhere, or an output of the parent) becomes an output.
    ``whole``: the parent's :class:`Whole` (or its ``graph_to_dict``), when the caller cuts
    many pieces of it."""
    parent.ensure_valid()
    if whole is None:
        whole = Whole(parent)
    if isinstance(whole, Whole):
        by_name, node_at, whole_d = whole.by_name, whole.node_at, whole.d
    else:
        by_name = {e["name"]: e for e in whole["tensors"]}
        node_at = {e["name"]: k for k, e in enumerate(whole["nodes"])}
        whole_d = whole
    written: dict[str, None] = {}
    read: dict[str, None] = {}
    for n in nodes:
        for t in n.inputs.values():
            read.setdefault(t.name)
        for t in n.outputs.values():
            written.setdefault(t.name)
    rename: dict[str, str] = {}
    tensors: list[dict[str, Any]] = []
    inputs: list[str] = []
    outputs: list[str] = []
    for tname in read:
        if tname in written or tname in rename:
            continue
        e = dict(by_name[tname])
        if "value" in e:  # a scalar constant stays a constant
            rename[tname] = f"c{len(rename)}"
        else:
            rename[tname] = f"in{len(inputs)}"
            inputs.append(tname)
            e.update(is_virtual=False, is_output=False, set=["dim", "stride", "data_type"])
        e["name"] = rename[tname]
        tensors.append(e)
    virtual = 0
    for tname in written:
        e = dict(by_name[tname])
        if tname in keep:
            rename[tname] = f"out{len(outputs)}"
            outputs.append(tname)
            e.update(is_virtual=False, is_output=True, set=["dim", "stride", "data_type"])
        else:
            rename[tname] = f"v{virtual}"
            virtual += 1
            e.update(is_virtual=True, is_output=False)
        e["name"] = rename[tname]
        tensors.append(e)
    node_entries = []
    all_nodes = whole_d["nodes"]
    for index, k in enumerate(sorted({node_at[n.name] for n in nodes})):  # in the parent's order
        e = all_nodes[k]
        node_entries.append({
            **e,
            "name": f"n{index}",
            "inputs": {p: rename[t] for p, t in e["inputs"].items()},
            "outputs": {p: rename[t] for p, t in e["outputs"].items()},
        })
    d = {**whole_d, "name": name, "tensors": tensors, "nodes": node_entries}
    g = _build(d, whole.seen if isinstance(whole, Whole) else None)
    return Cut(g, tuple(inputs), tuple(outputs))

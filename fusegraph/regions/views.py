"""A region's border reshapes taken out of its graph and done as views by whoever feeds it.

A front door's converter reshapes for the graph API's conventions: a layer norm's weight
[F] to [1, F] and its [B, S, F] input to [B*S, F] rows, a convolution's bias [C] to
[1, C, 1, 1], the statistics back to PyTorch's shapes. Inside the caller's own code such a
reshape of a packed tensor is a view and costs nothing, but cuDNN and the Triton row kernel
take no reshape node, so a region holding one would go to neither. Folding moves the
reshapes on the region's border out of the graph: a reshape of a graph input becomes an
input declared in the reshaped shape (the plan views what it is fed), and a reshape
producing a graph output becomes an output in its producer's shape (the plan views the
result). A reshape inside the region followed by pointwise ops that read nothing else
but scalars is first moved past them (a unary op commutes with a reshape), so the norm's
rows reshaped back to [B, S, F] and then cast reach the border too. ``FoldedPlan`` keeps
the region graph's interface, so nothing around it changes.
Only reshapes whose results are packed are folded: a packed tensor's reshape is a view,
and a non-packed one's is a packed copy, so the declared layout holds either way. A
transpose producing an output is folded only where asked (``transposes``): its permuted
view does not have the strides the output declares, which only a caller that takes any
strides may accept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError, UnsupportedError, ValidationError
from fusegraph.graph import layout
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import OpKind, TransposeAttrs
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict
from fusegraph.regions.subgraph import cut
from fusegraph.runtime.handle import Handle

View = tuple[str, str, tuple[int, ...] | None]  # (to, from, the shape to view it as; None: as it is)


@dataclass(frozen=True)
class Folded:
    """The graph without its border reshapes, and how to feed it and read it back:
    ``feeds`` (its input, the original graph's input, shape) and ``results`` (the original
    graph's output, its output, shape)."""

    graph: Graph
    feeds: tuple[View, ...]
    results: tuple[View, ...]
    # (the original graph's output, the permutation its view takes last): a transpose that
    # produced the output, folded where the caller takes outputs in any strides
    permuted: tuple[tuple[str, tuple[int, ...]], ...] = ()


def sink_reshapes(graph: Graph) -> Graph:
    """``graph`` with each inner reshape moved past the chain of pointwise ops after it that
    read only it and scalar constants (the same graph where there is none, or where the
    rewritten one does not validate)."""
    graph.ensure_valid()
    d = graph_to_dict(graph)
    tensors = {e["name"]: e for e in d["tensors"]}
    outputs = {e["name"] for e in d["tensors"] if e.get("is_output")}
    inputs = {e["name"] for e in d["tensors"] if not e.get("is_virtual") and not e.get("is_output") and "value" not in e}
    moved = False
    while True:
        nodes: list[dict[str, Any]] = d["nodes"]
        readers: dict[str, list[int]] = {}
        for i, e in enumerate(nodes):
            for t in e["inputs"].values():
                readers.setdefault(t, []).append(i)
        for i, r in enumerate(nodes):
            if r["op"] != "reshape":
                continue
            (x,) = r["inputs"].values()
            (y,) = r["outputs"].values()
            users = readers.get(y, [])
            if x in inputs or y in outputs or len(users) != 1:
                continue
            j = users[0]
            pw = nodes[j]
            others = [t for t in pw["inputs"].values() if t != y]
            if pw["op"] != "pointwise" or any("value" not in tensors[t] for t in others):
                continue
            (z,) = pw["outputs"].values()
            ty, tx, tz = tensors[y], tensors[x], tensors[z]
            # the op now computes in x's shape into y; the reshape takes y to z
            ty.update(dim=list(tx["dim"]), stride=list(layout.packed_strides(tx["dim"])), data_type=tz["data_type"])
            ty["set"] = [k for k in ty.get("set", []) if k != "dim"] + (
                ["data_type"] if "data_type" in tz.get("set", []) and "data_type" not in ty.get("set", []) else [])
            # (the op's result keeps the type it was given: a cast stays the op's, not the reshape's)
            tz["set"] = sorted(set(tz.get("set", [])) | {"dim"})  # the reshape's target
            pw["inputs"] = {p: (x if t == y else t) for p, t in pw["inputs"].items()}
            pw["outputs"] = {p: y for p in pw["outputs"]}
            r["inputs"] = {p: y for p in r["inputs"]}
            r["outputs"] = {p: z for p in r["outputs"]}
            r.setdefault("attrs", {})
            nodes.insert(j, nodes.pop(i))  # the reshape now follows the op
            moved = True
            break
        else:
            break
    if not moved:
        return graph
    try:
        g = graph_from_dict(d)
        g.validate()
    except Exception:  # a rewrite the graph API refuses changes nothing
        return graph
    return g


def fold_border_reshapes(graph: Graph, *, transposes: bool = False) -> Folded | None:
    """The folded graph, or None where ``graph`` has no border reshape to fold.
    ``transposes``: a transpose producing an output is folded too, its result handed back as
    a permuted view (strides other than the output declares: only for callers that take
    outputs in any layout, as the ONNX region path's steps do)."""
    graph = sink_reshapes(graph)
    nodes = list(graph.nodes)
    inputs = {t.name for t in graph.inputs()}
    declared = [t.name for t in graph.outputs()]
    readers: dict[str, int] = {}
    for n in nodes:
        for t in n.inputs.values():
            readers[t.name] = readers.get(t.name, 0) + 1
    dropped: set[str] = set()
    permuted: dict[str, tuple[str, tuple[int, ...]]] = {}  # graph output -> (the transpose's input, permutation)
    for n in nodes if transposes else ():
        if n.kind != OpKind.TRANSPOSE:
            continue
        (x,) = n.inputs.values()
        (y,) = n.outputs.values()
        attrs = n.attrs
        assert isinstance(attrs, TransposeAttrs)
        if (y.name in declared and not readers.get(y.name) and readers.get(x.name) == 1 and x.name not in inputs
                and x.name not in declared and x.data_type == y.data_type):
            permuted[y.name] = (x.name, tuple(attrs.permutation))
            readers[x.name] = 0
            dropped.add(n.name)
    outputs = [permuted[o][0] if o in permuted else o for o in declared]  # what the folded graph must give
    dropped_in: dict[str, tuple[str, tuple[int, ...]]] = {}  # reshape result -> (graph input, shape)
    dropped_out: dict[str, tuple[str, tuple[int, ...]]] = {}  # graph output -> (its producer's tensor, shape)
    for n in nodes:
        if n.kind != OpKind.RESHAPE:
            continue
        (x,) = n.inputs.values()
        (y,) = n.outputs.values()
        if not readers.get(y.name) and y.name not in outputs:  # dead: a statistic nobody reads
            dropped.add(n.name)
            continue
        packed = tuple(y.strides) == tuple(layout.packed_strides(y.shape))
        if not packed or x.data_type != y.data_type:  # a reshape that also casts is no view
            continue
        if x.name in inputs and y.name not in outputs:
            dropped_in[y.name] = (x.name, tuple(y.shape))
            dropped.add(n.name)
        elif y.name in outputs and not readers.get(y.name) and x.name not in inputs and x.name not in dropped_in:
            dropped_out[y.name] = (x.name, tuple(y.shape))
            dropped.add(n.name)
    kept = [n for n in nodes if n.name not in dropped]
    if not dropped or not kept:
        return None
    keep = set(outputs) | {src for src, _ in dropped_out.values()}
    try:
        piece = cut(graph, kept, frozenset(keep), f"{graph.name}.folded")
    except ValidationError:  # nothing of the graph's answer left to compute, or the graph API refuses the cut
        return None
    if any(name not in piece.outputs and name not in dropped_out for name in outputs):
        return None  # an output the folded graph cannot give back
    feeds: list[View] = []
    for i, parent in enumerate(piece.inputs):
        src, shape = dropped_in.get(parent, (parent, None))  # type: ignore[arg-type]
        feeds.append((f"in{i}", src, shape))
    out_of = {parent: f"out{j}" for j, parent in enumerate(piece.outputs)}
    results: list[View] = []
    for original, name in zip(declared, outputs, strict=True):
        if name in out_of:
            results.append((original, out_of[name], None))
        else:
            src, shape = dropped_out[name]
            results.append((original, out_of[src], shape))
    perms = tuple((o, permuted[o][1]) for o in declared if o in permuted)
    return Folded(piece.graph, tuple(feeds), tuple(results), perms)


class FoldedPlan(ExecutionPlan):
    """A plan for the folded graph behind the original graph's interface: it views what it
    is fed (``reshape``: a view where the layout allows, which the folding checked) and the
    results it hands back. Works on any array type with ``reshape`` (torch, NumPy)."""

    def __init__(self, original: Graph, folded: Folded, plan: ExecutionPlan) -> None:
        super().__init__(original, plan.handle, plan.config)
        self.inner = plan
        self.folded = folded

    @property
    def workspace_size(self) -> int:
        return self.inner.workspace_size

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        pack = {k if isinstance(k, str) else getattr(k, "name", k): v for k, v in variant_pack.items()}
        fed = {}
        for to, src, shape in self.folded.feeds:
            v = pack[src]
            fed[to] = v if shape is None else v.reshape(shape)
        got = self.inner.execute(fed)
        out = {name: got[src] if shape is None else got[src].reshape(shape) for name, src, shape in self.folded.results}
        for name, perm in self.folded.permuted:  # a view: torch's permute, NumPy's transpose
            v = out[name]
            out[name] = v.permute(perm) if hasattr(v, "permute") else v.transpose(perm)
        for name, value in out.items():  # output buffers the caller passed get the results
            dst = pack.get(name)
            if dst is not None and dst is not value:
                if hasattr(dst, "copy_"):
                    dst.copy_(value)
                else:
                    import numpy as np

                    np.copyto(dst, value)
                out[name] = dst
        return out

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "folded_reshapes": len(self.folded.feeds) + len(self.folded.results),
                "folded_transposes": len(self.folded.permuted)}


# Engines that run a region's kernels themselves (no ATen or Inductor code of the caller's
# behind them): the ones a GPU front door can set against its incumbent.
KERNEL_ENGINES = ("cudnn", "triton")


def kernel_plan(graph: Graph, handle: Handle, engines: Sequence[str] = KERNEL_ENGINES) -> ExecutionPlan:
    """``graph`` on the first of ``engines``, in the heuristics' order, that builds it; an
    UnsupportedError naming each engine's reason where none does."""
    from fusegraph.select.api import ranked_configs
    from fusegraph.select.modes import HeurMode

    ranked = [c.config.engine for c in ranked_configs(graph, handle, [HeurMode.A])]
    order = [e for e in dict.fromkeys(ranked) if e in engines] + [e for e in engines if e not in ranked]
    reasons = []
    for name in order:
        try:
            plan: ExecutionPlan = graph.build(handle=handle, engine=name)
            return plan
        except FusegraphError as exc:
            reasons.append(f"{name}: {exc}")
        except Exception as exc:  # an engine's own failure is this graph's refusal on it
            reasons.append(f"{name}: building failed: {type(exc).__name__}: {exc}")
    raise UnsupportedError(f"graph '{graph.name}': no kernel engine builds it on {handle.device}: " + "; ".join(reasons))


def folded_kernel_plan(graph: Graph, handle: Handle, engines: Sequence[str] = KERNEL_ENGINES, *,
                       transposes: bool = False) -> ExecutionPlan:
    """``graph`` with its border reshapes (and, with ``transposes``, its output transposes)
    folded into views, on a kernel engine (``kernel_plan``), behind the original graph's
    interface; UnsupportedError where there is nothing to fold or no engine builds the
    folded graph."""
    folded = fold_border_reshapes(graph, transposes=transposes)
    if folded is None:
        raise UnsupportedError(f"graph '{graph.name}': no border reshape to fold into a view")
    try:
        return FoldedPlan(graph, folded, kernel_plan(folded.graph, handle, engines))
    except UnsupportedError as exc:
        raise UnsupportedError(f"with its border reshapes folded into views: {exc}") from exc

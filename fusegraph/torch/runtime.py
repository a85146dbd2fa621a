"""Claimed regions at run time: the custom op ``fusegraph::region`` that a rewritten ATen
graph calls in place of a region's nodes, and the runner behind each key, which builds
fusegraph's plan for every input signature it meets (one plan per size seen under
``mark_dynamic``; PLANS builds each graph once) and hands back results laid out as
PyTorch's own ops would have laid them out (the compiled code around it was planned for
those strides).

The op's fake implementation runs the region's original ATen nodes on fake tensors, so
shapes, strides and symbolic sizes are PyTorch's. It is tagged cudagraph-unsafe: under
``mode="reduce-overhead"`` Inductor captures the code around it and runs the region
between captures (fusegraph's GPU plans capture and replay themselves).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import ExecutionError, FusegraphError
from fusegraph.torch import aten
from fusegraph.torch.plans import ANY_ENGINE, PLANS, run

log = logging.getLogger("fusegraph.torch")

Signature = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]


@dataclass
class _Bound:
    plan: ExecutionPlan | None  # None: the region runs its ATen nodes (why says why)
    feed: list[tuple[str, int]]  # graph input name, index of the runner's input
    outputs: list[tuple[str | aten.Zeros, tuple[int, ...]]]  # graph output (or zeros), PyTorch's strides
    why: str = ""
    aliases: bool = True  # whether a result may alias an input or another result (False once a call showed none)


class RegionRunner:
    """One claimed region: its ATen nodes as a GraphModule (placeholders: the region's
    inputs; output: its results) and its plans by input signature.

    The call is on every step's path, once per region (a tiny model's step is ~1 ms, so
    each microsecond here is a visible fraction of it): the signature is the inputs' shapes,
    strides, dtypes and devices and nothing else; the feed, the results' names and the
    strides they must have are settled when a signature is first seen; inputs that require
    gradients are detached (a plan runs inside AOTAutograd's graph, below autograd), which
    lets the torch engine take its lean call (no re-checking of the pack, no
    ``inference_mode``, so no copies of inference tensors)."""

    def __init__(self, key: str, sub: torch.fx.GraphModule, any_engine: bool = False) -> None:
        self.key = key
        self.sub = sub
        self.any_engine = any_engine  # claimed unmeasured: not only kernel engines (plans.py)
        self._bound: dict[Signature, _Bound] = {}
        self._lock = threading.Lock()
        self.fallbacks = 0  # calls that ran the region's ATen nodes instead of fusegraph's plan

    def __call__(self, inputs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        sig: Signature = tuple([(t.shape, t.stride(), t.dtype, t.device) for t in inputs])  # Size hashes as tuple
        b = self._bound.get(sig)
        if b is None:
            with self._lock:
                b = self._bound.get(sig) or self._prepare(sig, inputs, sizes)
                self._bound[sig] = b
        plan = b.plan
        if plan is None:
            self.fallbacks += 1
            return _unaliased(list(self.sub(*inputs, *sizes)), inputs)
        feed = {}
        for tname, i in b.feed:
            t = inputs[i]
            feed[tname] = t.detach() if t.requires_grad else t
        try:
            res = run(plan, feed)
        except FusegraphError as exc:  # from now on this signature runs its ATen nodes
            log.warning("region %s: fusegraph's plan failed, running its ATen nodes (%s)", self.key, exc)
            self._bound[sig] = _Bound(None, [], [], f"{type(exc).__name__}: {exc}")
            self.fallbacks += 1
            return _unaliased(list(self.sub(*inputs, *sizes)), inputs)
        outs = []
        for name, stride in b.outputs:
            if isinstance(name, aten.Zeros):
                outs.append(torch.zeros(name.shape, dtype=name.dtype, device=inputs[0].device))
                continue
            t = res[name]
            if t.stride() != stride and t.numel() > 1:
                t = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
            outs.append(t)
        if not b.aliases:
            return outs
        fixed = _unaliased(outs, inputs)
        # the same signature takes the same code path, views included: a first call whose
        # results alias nothing settles it (storage lookups cost ~1 us a tensor a call)
        b.aliases = any(f is not o for f, o in zip(fixed, outs, strict=True))
        return fixed

    def fallback(self, inputs: list[torch.Tensor]) -> str:
        """Why this signature runs the region's ATen nodes instead of fusegraph's plan."""
        sig: Signature = tuple([(t.shape, t.stride(), t.dtype, t.device) for t in inputs])
        b = self._bound.get(sig)
        return (b.why if b is not None else "") or "no plan"

    def fake(self, inputs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        return list(self.sub(*inputs, *sizes))

    def _prepare(self, sig: Signature, inputs: list[torch.Tensor], sizes: list[int]) -> _Bound:
        """Converts the region's ATen nodes for this signature and builds the plan."""
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode()
            fakes = [mode.from_tensor(t) for t in inputs]
            FakeTensorProp(self.sub, mode).propagate(*fakes, *sizes)
            conv = aten.convert(self.sub.graph, f"region.{self.key}")
            if conv.refused:
                name, why = next(iter(conv.refused.items()))
                raise aten.Refused(f"{name}: {why}")
            out_node = next(n for n in self.sub.graph.nodes if n.op == "output")
            results = list(out_node.args[0])
            names: list[tuple[str | aten.Zeros, tuple[int, ...]]] = []
            for r in results:
                key: aten.Key = (r.name, None)
                if r.op == "call_function" and r.target.__name__ == "getitem":
                    key = (r.args[0].name, int(r.args[1]))
                stride = tuple(int(s) for s in r.meta["val"].stride())
                if key in conv.constants:
                    names.append((conv.constants[key], stride))
                    continue
                tname = conv.values[key]
                conv.graph.tensor_by_name(tname).set_output(True)
                names.append((tname, stride))
            graph = conv.graph.validate()
            placeholders = {n.name: i for i, n in enumerate(n for n in self.sub.graph.nodes if n.op == "placeholder")}
            feed = [(t, placeholders[k[0]]) for t, k in conv.inputs.items()]
            plan = PLANS.get(("region", graph.key()) + ((ANY_ENGINE,) if self.any_engine else ()), inputs[0].device,
                             lambda: graph)
            return _Bound(plan, feed, names)
        except Exception as exc:  # the region runs its own ATen nodes: slower, never wrong
            why = f"{type(exc).__name__}: {exc}"
            log.warning("region %s: running its ATen nodes (%s)", self.key, why)
            return _Bound(None, [], [], why)


def _unaliased(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A custom op's results may alias neither its inputs nor each other: such a result is
    copied (a region returning a value and a view of it pays one copy)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    fixed = []
    for o in outs:
        ptr = o.untyped_storage().data_ptr()
        if ptr in seen:
            o = o.clone()
            ptr = o.untyped_storage().data_ptr()
        seen.add(ptr)
        fixed.append(o)
    return fixed


RUNNERS: dict[str, RegionRunner] = {}  # key -> runner: the explicit registry the op looks in


# The op is defined through torch.library's low-level Library, not ``custom_op``: the
# latter wraps every call in Python autograd and dispatch layers (~15 us a call on the CPU,
# measured against ~4.5 us for this kernel). The op has no autograd formula and needs none:
# it only appears in AOTAutograd's forward and backward graphs, which run below autograd.
_LIB = torch.library.Library("fusegraph", "DEF")  # type: ignore[no-untyped-call]  # the explicit registry of the op itself
_LIB.define("region(str key, Tensor[] inputs, SymInt[] sizes) -> Tensor[]", tags=(torch.Tag.cudagraph_unsafe,))  # type: ignore[no-untyped-call]


def region(key: str, inputs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return RUNNERS[key](inputs, sizes)


_LIB.impl("region", region, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


@torch.library.register_fake("fusegraph::region", lib=_LIB)  # type: ignore[untyped-decorator]
def _region_fake(key: str, inputs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return [o.clone() for o in RUNNERS[key].fake(inputs, sizes)]


class RegionCall(ExecutionPlan):
    """A region's plan as the rewritten graph will run it: its inputs (in0, in1, ... by
    name, as the region layer's measurer hands them) passed through the op
    ``fusegraph::region`` to the region's runner, host cost included -- what the floor
    must time, not the plan alone (on the CPU a region call costs tens of microseconds over
    its plan; timed alone, regions that won by microseconds lost in the graph). A call that
    ends up running the region's ATen nodes raises: that is no fusegraph plan to keep."""

    def __init__(self, plan: ExecutionPlan, key: str, arity: int, extra: list[torch.Tensor | int]) -> None:
        super().__init__(plan.graph, plan.handle, plan.config)
        self.plan = plan
        self.key = key
        self.arity = arity
        self.extra_tensors = [x for x in extra if isinstance(x, torch.Tensor)]
        self.sizes = [x for x in extra if not isinstance(x, torch.Tensor)]

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        inputs = [variant_pack[f"in{i}"] for i in range(self.arity)] + self.extra_tensors
        runner = RUNNERS[self.key]
        before = runner.fallbacks
        outs = torch.ops.fusegraph.region.default(self.key, inputs, self.sizes)
        if runner.fallbacks != before:
            raise ExecutionError(f"region {self.key} ran its ATen nodes, not fusegraph's plan: {runner.fallback(inputs)}")
        return {f"out{i}": o for i, o in enumerate(outs)}


def register(sub: torch.fx.GraphModule, content: str, any_engine: bool = False) -> str:
    """The region's key: its content key, its ATen code and its engine policy, nothing that
    depends on this process's history -- Inductor's on-disk cache may hand a later process
    compiled code holding the key, which must then name the same computation."""
    import hashlib

    key = f"{content[:16]}.{hashlib.sha256(sub.code.encode()).hexdigest()[:12]}" + (".any" if any_engine else "")
    RUNNERS.setdefault(key, RegionRunner(key, sub, any_engine))
    return key

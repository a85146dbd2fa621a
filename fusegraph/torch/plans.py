"""Built plans, once per signature: the autograd functions and the compiled regions look
their plan up by a key (the pattern, its graph signature, the device) and build it only
the first time -- after the first training step no graph is constructed or validated.

The engine: on a GPU, fusegraph's selection picks (cudnn / triton / torch by heuristics
and the tuning database); on the CPU the torch engine (IREE would compile each new shape
for seconds), unless ``PLANS.engine`` names one. A compiled region on a GPU takes a kernel
engine (cudnn, triton) only: its incumbent is Inductor's code for the same ATen nodes, and
the torch engine would run those ATen nodes, or Inductor's code for them, behind one more
call (measured on the H200: a layer norm region on torch[compile] cost 82 us a call more
than Inductor's kernel, the same kernel). With the floor off (claim all, unmeasured) a
region's key holds ANY_ENGINE and selection's choice stands, the torch engine included. Plans run with autocast off: their
dtypes are the graph's, and PyTorch's autocast would otherwise recast the ops of a
torch-engine plan under them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.engines.base import ExecutionPlan
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle
from fusegraph.torch.graphs import TSpec

_TYPES: dict[torch.dtype, DataType] = {}


def data_type(dtype: torch.dtype) -> DataType:
    """fusegraph's DataType of a torch dtype (memoized: it is on every call's path)."""
    dt = _TYPES.get(dtype)
    if dt is None:
        dt = _TYPES.setdefault(dtype, as_data_type(str(dtype).removeprefix("torch.")))
    return dt


def spec(t: torch.Tensor) -> TSpec:
    return TSpec(tuple(t.shape), tuple(t.stride()), data_type(t.dtype))


class PlanCache:
    """Plans by key (one explicit cache per process: ``PLANS``); ``builds`` counts graphs
    built, so a test can check that a second step builds none."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, ExecutionPlan] = {}
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self.builds = 0
        self.engine: str | None = None  # None: torch on the CPU, selection's choice on a GPU

    def handle(self, device: torch.device) -> Handle:
        name = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        h = self._handles.get(name)
        if h is None:
            h = self._handles.setdefault(name, Handle(name))
        return h

    def get(self, key: Hashable, device: torch.device, make: Callable[[], Graph]) -> ExecutionPlan:
        full = (key, device)
        plan = self._plans.get(full)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plans.get(full)
            if plan is None:
                graph = make()
                handle = self.handle(device)
                engine = self.engine or ("torch" if device.type == "cpu" else None)
                if engine is None and isinstance(key, tuple) and key and key[0] == "region" and ANY_ENGINE not in key:
                    plan = _kernel_build(graph, handle)
                else:
                    plan = graph.build(handle=handle, engine=engine, **_options(graph, handle, engine))
                self._plans[full] = plan
                self.builds += 1
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()


# The torch engine's CPU paths that pay off only once weights are bound: its compiled path
# waits for them, and its fused oneDNN steps reorder an unbound filter on every call (a 4x4
# 3x3 convolution: ~0.45 ms instead of ~0.02 ms). The front door never binds weights (they
# change every step), so both are off and plans take the lean call.
_CPU_KNOBS = {"cpu_compile": "off", "onednn": False}


def _options(graph: Graph, handle: Handle, engine: str | None) -> dict[str, Any]:
    if engine != "torch" or handle.device.is_gpu:
        return {}
    from fusegraph.engines.registry import REGISTRY

    knobs = {k.name for k in REGISTRY.get("torch").knobs(graph, handle)}
    chosen = {k: v for k, v in _CPU_KNOBS.items() if k in knobs}
    return {"config": {"engine": "torch", "knobs": chosen}} if chosen else {}


ANY_ENGINE = "any engine"  # in a region's key: claimed unmeasured (floor off), the torch engine may take it


def _kernel_build(graph: Graph, handle: Handle) -> ExecutionPlan:
    """``graph`` on a kernel engine, or where none takes it, with its border reshapes folded
    into views (a converter's reshape of a weight or of the rows, which neither engine
    takes); a typed refusal naming each engine's reason where neither works."""
    from fusegraph.errors import UnsupportedError
    from fusegraph.regions.views import folded_kernel_plan, kernel_plan

    try:
        return kernel_plan(graph, handle)
    except UnsupportedError as exc:
        first = exc
    try:
        return folded_kernel_plan(graph, handle)
    except UnsupportedError as exc:
        raise UnsupportedError(f"{first} (the torch engine would run the incumbent's own ATen code); {exc}") from exc


def run(plan: ExecutionPlan, feed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Executes with torch tensors in and out, autocast off around it."""
    pack = feed if type(feed) is dict else dict(feed)  # a plain dict: the torch engine's lean call
    device = next(iter(pack.values())).device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            out = plan.execute(pack)
    else:
        out = plan.execute(pack)
    # A plan that ran under torch.inference_mode (the torch engine's general path, its
    # CUDA-graph replays) returns inference tensors, which autograd may not save.
    for name, t in out.items():
        if t.is_inference():
            out[name] = t.clone()
    return out


@contextlib.contextmanager
def engine(name: str | None) -> Any:
    """Builds new plans on ``name`` inside the block (tests, benchmarks)."""
    before = PLANS.engine
    PLANS.engine = name
    try:
        yield
    finally:
        PLANS.engine = before

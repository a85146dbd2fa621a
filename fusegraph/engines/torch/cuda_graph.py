"""CUDA graphs for the torch plan: the whole eager plan captured once and replayed (one
launch instead of one per op), inputs copied into static buffers."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fusegraph.engines.cuda_capture import CENSUS, allowed, capturing, warm_up_stream
from fusegraph.engines.expanded_copy import copy_strided
from fusegraph.engines.torch.convert import (
    Tensor,
    _is_buffer,
    buffer_to_torch,
    from_numpy,
    torch_dtype,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.tensor import TensorAttr

log = logging.getLogger("fusegraph.engines.torch")

# "auto" captures a plan of at least this many nodes ...
CAPTURE_MIN_NODES = 3
# ... whose activations (inputs not bound as constants) are each at most this large.
CAPTURE_MAX_ACTIVATION_BYTES = 4 << 20


def worth_capturing(graph: Graph, activations: list[TensorAttr]) -> bool:
    """Whether replaying a captured CUDA graph should beat launching the plan's kernels.

    A replay saves a launch per kernel (5-10 us of host time each) but copies every
    activation into the captured buffers and every output out of them (a launch each, and
    memory traffic). On the H100 a one-op graph ran 64 us a call captured against ~10 us
    eager, and on 8192x4096 operands the copies cost more than the launches they save; a
    ResNet-50 of ~120 kernels at batch 1 went from 15.5 to 2.6 ms. So: several kernels over
    small activations.
    """
    if len(graph.nodes) < CAPTURE_MIN_NODES:
        return False
    return all(math.prod(t.shape) * t.dtype.itemsize <= CAPTURE_MAX_ACTIVATION_BYTES for t in activations)


class CudaGraphs:
    """TorchPlan's capture and replay (a mixin: the state is the plan's)."""

    graph: Graph
    device: Any
    _torch: Any
    _fn: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    _inputs: list[TensorAttr]
    _bound: dict[str, tuple[Any, Tensor]]
    _cuda_graph: bool
    _graph: tuple[Any, dict[str, Tensor], dict[str, Tensor]] | None
    _graph_bound: Any
    _graph_stream: int | None

    def _on_graph_stream(self) -> bool:
        """Whether the caller's current stream is the one replays run on. The captured
        buffers are written and read on that stream only: a call on another stream could
        overwrite them while a replay still reads them (such calls run eagerly)."""
        torch = self._torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        current = raw(self.device.index) if raw is not None else torch.cuda.current_stream(self.device).cuda_stream
        return int(current) == self._graph_stream

    def _to_device(self, t: TensorAttr, value: Any) -> Tensor:
        raise NotImplementedError  # TorchPlan's

    def _replay(self, pack: Any) -> dict[str, Tensor] | None:
        """The plan as one replayed CUDA graph; None when this call must run eagerly (a bound
        constant passed as another object) or capture failed (then never again)."""
        if pack.overridden:  # a captured or traced plan holds the bound values: run eagerly
            return None
        stale = self._graph is None or self._graph_bound is not self._bound
        if stale and (not allowed() or not self._capture(pack)):  # postponed: eager now, captured later
            return None
        if not self._on_graph_stream():
            return None
        values = []
        for t in self._inputs:
            if t.name in self._bound:
                continue
            value = pack.inputs[t.name]
            if isinstance(value, np.ndarray):
                value = from_numpy(value, t.dtype)
            elif _is_buffer(value):
                value = buffer_to_torch(value, t)
            values.append((t.name, value))
        return self._launch(values)

    def _launch(self, values: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """Copies each activation (by name) into its captured buffer and replays the graph;
        the captured outputs are overwritten by the next replay."""
        assert self._graph is not None
        graph, static_in, static_out = self._graph
        for name, value in values:
            copy_strided(static_in[name], value)
        graph.replay()
        return static_out

    def _capture(self, pack: Any) -> bool:
        torch = self._torch
        static_in: dict[str, Tensor] = {}
        for t in self._inputs:
            b = self._bound.get(t.name)
            if b is not None:
                static_in[t.name] = b[1]
                continue
            buf = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(t.dtype), device=self.device)
            copy_strided(buf, self._to_device(t, pack.inputs[t.name]))
            static_in[t.name] = buf
        try:
            side = warm_up_stream(torch, self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuDNN picks its algorithms and workspaces outside the capture
                    self._fn(static_in)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (another plan running eagerly) stay allowed
            with capturing(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = self._fn(static_in)
        except Exception as exc:  # an op that syncs with the host, or one CUDA graphs cannot hold
            log.info("graph '%s': CUDA graph capture failed (%s); running eagerly", self.graph.name, str(exc).splitlines()[0])
            self._cuda_graph = False
            self._graph = None
            return False
        self._graph = (graph, static_in, static_out)
        CENSUS.track(self)
        self._graph_bound = self._bound
        self._graph_stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        return True

"""A built row kernel: the Triton function, its launch grid and warps (the pack contract
is engines/cuda_plan.py's)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fusegraph.engines.base import EngineConfig
from fusegraph.engines.cuda_plan import CudaTensorPlan
from fusegraph.engines.launch_replay import DEFAULT_STREAM, LaunchReplay
from fusegraph.errors import ExecutionError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle


class TritonPlan(CudaTensorPlan):
    """One generated kernel, launched on ``ceil(rows / rows_per_program)`` programs on the
    caller's current stream (Triton asks torch for it)."""

    def __init__(
        self,
        graph: Graph,
        handle: Handle,
        config: EngineConfig,
        *,
        torch: Any,
        kernel: Any,
        programs: int,
        num_warps: int,
        source: Path,
    ) -> None:
        super().__init__(graph, handle, config, torch=torch)
        self.source = source  # the kernel's text: what a user reads, and a failure's reproducer
        self.programs, self.num_warps = programs, num_warps
        self._launch = kernel[(programs,)]
        self._in_names, self._out_names = list(self._in), list(self._out)
        # Triton's launch binds and specializes every argument per call (~tens of us of
        # Python, which a 40 us kernel cannot hide); the kernel it compiled for 16-byte
        # aligned pointers is launched directly while the pointers stay aligned.
        self._runner: Any = None
        # the current device, without torch.cuda.current_device()'s lazy-init wrapper
        self._get_device: Any = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        # repeated pointers on the default stream replay a captured launch (knob cuda_graph)
        self.replays = LaunchReplay(torch, self.device, str(config.get("cuda_graph", "auto")) == "auto")

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        args = [*(inputs[n] for n in self._in_names), *(results[n] for n in self._out_names)]
        torch = self._torch
        try:
            if self._get_device() != self._index:
                with torch.cuda.device(self._index):
                    self._launch(*args, num_warps=self.num_warps)
                return
            ptrs = [a.data_ptr() for a in args]
            aligned = True
            for ptr in ptrs:
                if ptr % 16:
                    aligned = False
                    break
            runner = self._runner
            if aligned and runner is not None:
                stream = self.current_stream()
                if stream != DEFAULT_STREAM:
                    runner(*args, stream=stream)
                    return
                key = tuple(ptrs)
                replays = self.replays
                if replays.graphs and replays.replay(key):
                    return
                runner(*args, stream=stream)
                if replays.on:
                    replays.launched(key, lambda s: runner(*args, stream=s))
                return
            compiled = self._launch(*args, num_warps=self.num_warps)
            if aligned and self._runner is None and hasattr(compiled, "__getitem__"):
                self._runner = compiled[(self.programs, 1, 1)]
        except Exception as exc:
            raise ExecutionError(f"Triton row kernel for graph '{self.graph.name}' failed ({self.source}): {type(exc).__name__}: {exc}") from exc

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"source": str(self.source), "programs": self.programs, "num_warps": self.num_warps})
        d.update(self.replays.describe())
        return d


class NormBackwardPlan(CudaTensorPlan):
    """Norm backward's two kernels (norm_backward.py): the row pass on ``programs``
    programs, then the column sums, with a float32 workspace taken from torch's caching
    allocator on the caller's stream per call (so two streams never share one)."""

    def __init__(
        self,
        graph: Graph,
        handle: Handle,
        config: EngineConfig,
        *,
        torch: Any,
        rows_kernel: Any,
        sums_kernel: Any | None,
        programs: int,
        sum_programs: int,
        num_warps: int,
        workspace: int,
        source: Path,
    ) -> None:
        super().__init__(graph, handle, config, torch=torch)
        self.source = source
        self.programs, self.sum_programs, self.num_warps = programs, sum_programs, num_warps
        self._rows = rows_kernel[(programs,)]
        self._sums = sums_kernel[(sum_programs,)] if sums_kernel is not None and sum_programs else None
        self._workspace = workspace
        self._in_names, self._out_names = list(self._in), list(self._out)
        self._get_device: Any = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self._runners: tuple[Any, ...] | None = None

    def _launch(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        ws = self._torch.empty(self._workspace, dtype=self._torch.float32, device=self.device)
        args = [*(inputs[n] for n in self._in_names), *(results[n] for n in self._out_names), ws]
        aligned = True
        for a in args:
            if a.data_ptr() % 16:
                aligned = False
                break
        runners = self._runners
        if aligned and runners is not None:  # the compiled kernels launched directly (TritonPlan's reason)
            stream = self.current_stream()
            for run in runners:
                run(*args, stream=stream)
            return
        first = self._rows(*args, num_warps=self.num_warps)
        second = self._sums(*args, num_warps=4) if self._sums is not None else None
        if aligned and hasattr(first, "__getitem__") and (second is None or hasattr(second, "__getitem__")):
            self._runners = (first[(self.programs, 1, 1)], *(() if second is None else (second[(self.sum_programs, 1, 1)],)))

    def _run(self, inputs: Mapping[str, Any], results: Mapping[str, Any]) -> None:
        torch = self._torch
        try:
            if self._get_device() != self._index:
                with torch.cuda.device(self._index):
                    self._launch(inputs, results)
            else:
                self._launch(inputs, results)
        except Exception as exc:
            raise ExecutionError(f"Triton norm-backward kernels for graph '{self.graph.name}' failed ({self.source}): {type(exc).__name__}: {exc}") from exc

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"source": str(self.source), "programs": self.programs, "sum_programs": self.sum_programs,
                  "num_warps": self.num_warps, "workspace_bytes": 4 * self._workspace})
        return d

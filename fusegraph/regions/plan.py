"""An executable region plan: the steps of a model in order -- fusegraph's plans for the
regions it won, the incumbent's runnables for the rest -- passing torch tensors from
step to step, so intermediates never leave the device; and, on a GPU with static shapes,
the whole sequence captured once as one CUDA graph and replayed (captured under
engines/cuda_capture.py's rules: cycle collector paused, dropped plans' graphs counted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import ExecutionError


@dataclass(frozen=True)
class Step:
    """One step: reads ``inputs`` (names in the plan's environment), writes ``outputs``.
    ``run`` takes and returns values in those orders. ``where`` names what runs it (an
    engine's config, or the incumbent) for the report."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run: Callable[[Sequence[Any]], Sequence[Any]]
    where: str


def fusegraph_step(name: str, plan: ExecutionPlan, inputs: Sequence[str], outputs: Sequence[str]) -> Step:
    """A region run by fusegraph's plan: its subgraph's in0.. / out0.. bound to the
    environment names the region stands for."""
    ins = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(len(outputs))]

    def run(values: Sequence[Any]) -> Sequence[Any]:
        res = plan.execute(dict(zip(ins, values, strict=True)))
        return [res[o] for o in outs]

    return Step(name, tuple(inputs), tuple(outputs), run, str(plan.config))


def assemble(choices: Sequence[Any], outputs: Sequence[str], incumbent: Callable[[Any], Step]) -> RegionPlan:
    """The plan of a chosen split: each claimed region's fusegraph plan as a step, every
    other region the step ``incumbent(region)`` gives (the front door's own runner for
    those nodes), producers first. ``choices``: regions/choose.py's Choice list, in the
    split's order -- which lists anchor regions before the chains they read (x -> exp ->
    matmul splits as [matmul, exp]), so the steps are ordered here by what they read."""
    steps = []
    for c in choices:
        r = c.region
        if c.claimed:
            steps.append(fusegraph_step(f"r{r.index}", c.plan, r.inputs, r.outputs))
        else:
            steps.append(incumbent(r))
    return RegionPlan(producers_first(steps), outputs)


def producers_first(steps: Sequence[Step]) -> list[Step]:
    """``steps`` ordered so that each runs after the steps whose outputs it reads (stable:
    the given order among steps that are ready together)."""
    made_by = {name: i for i, s in enumerate(steps) for name in s.outputs}
    done: set[int] = set()
    order: list[Step] = []
    while len(order) < len(steps):
        ready = [i for i, s in enumerate(steps) if i not in done
                 and all(made_by.get(n, i) in done or made_by.get(n, i) == i for n in s.inputs)]
        if not ready:
            stuck = [steps[i].name for i in range(len(steps)) if i not in done]
            raise ExecutionError(f"region steps {stuck} read each other's results: no order runs them")
        done.add(ready[0])
        order.append(steps[ready[0]])
    return order


class RegionPlan:
    """The steps in order; ``execute`` runs them over a dict of named values."""

    def __init__(self, steps: Sequence[Step], outputs: Sequence[str]) -> None:
        self.steps = list(steps)
        self.outputs = tuple(outputs)
        self._graph: Any = None  # (CUDAGraph, static inputs, static outputs) once captured
        self._lock: Any = None

    def execute(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if self._graph is not None:
            return self._replay(values)
        return self._run(values)

    def _run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        env = dict(values)
        for step in self.steps:
            try:
                args = [env[n] for n in step.inputs]
            except KeyError as exc:
                raise ExecutionError(f"region step '{step.name}' reads {exc.args[0]!r}, which no step wrote") from None
            for name, value in zip(step.outputs, step.run(args), strict=True):
                env[name] = value
        return {n: env[n] for n in self.outputs}

    # ---- one CUDA graph for the whole sequence -------------------------------------------------
    def capture(self, example: Mapping[str, Any]) -> str:
        """Captures the steps as one CUDA graph over static copies of ``example`` (torch
        CUDA tensors of the shapes every later call will have). '' on success, else why
        not (then the plan keeps running step by step)."""
        import importlib
        import threading

        torch: Any = importlib.import_module("torch")

        if not all(isinstance(v, torch.Tensor) and v.is_cuda for v in example.values()):
            return "not every input is a CUDA tensor"
        from fusegraph.engines.cuda_capture import CENSUS, capturing, warm_up_stream

        static_in = {k: v.clone() for k, v in example.items()}
        side = warm_up_stream(torch, next((v.device for v in example.values()), "cuda"))
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up off the capture: lazy init, allocator pools
                    self._run(static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = self._run(static_in)
        except Exception as exc:  # a step that cannot be captured: run step by step
            return f"{type(exc).__name__}: {exc}"
        CENSUS.track(self)
        self._graph = (graph, static_in, static_out)
        self._lock = threading.Lock()
        return ""

    def _replay(self, values: Mapping[str, Any]) -> dict[str, Any]:
        graph, static_in, static_out = self._graph
        with self._lock:
            for k, buf in static_in.items():
                src = values[k]
                if src.shape != buf.shape or src.dtype != buf.dtype:
                    raise ExecutionError(
                        f"input '{k}' has shape {list(src.shape)} {src.dtype}; the captured plan takes "
                        f"{list(buf.shape)} {buf.dtype}"
                    )
                buf.copy_(src)
            graph.replay()
            return {k: v.clone() for k, v in static_out.items()}

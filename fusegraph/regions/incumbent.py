"""The incumbent: what a front door would run for a region if fusegraph did not claim
it, as something the measurer can time next to fusegraph's plan. Each front door brings
its own: on the GPU the ONNX provider's is the same nodes op by op on PyTorch (here:
``TorchOpByOp``, the region's subgraph on the torch engine, eager, uncaptured), on the
CPU ONNX Runtime (in onnx/, which owns ONNX Runtime); ``torch.compile``'s is Inductor's
code for the same ATen region (in fusegraph/torch/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fusegraph.regions.split import Region
from fusegraph.runtime.handle import Handle


@runtime_checkable
class Incumbent(Protocol):
    """``name`` keys the verdict (a verdict against ONNX Runtime is no verdict against
    Inductor); ``runnable`` gives a no-argument call running the region on ``inputs``
    (its subgraph's inputs by name: in0, in1, ...), ready to be timed."""

    @property
    def name(self) -> str: ...

    def runnable(self, region: Region, inputs: Mapping[str, Any]) -> Callable[[], object]: ...


@dataclass(frozen=True)
class CallableIncumbent:
    """An incumbent from a function ``make(region, inputs) -> call`` (tests, and front
    doors whose incumbent is a plain callable)."""

    name: str
    make: Callable[[Region, Mapping[str, Any]], Callable[[], object]]

    def runnable(self, region: Region, inputs: Mapping[str, Any]) -> Callable[[], object]:
        return self.make(region, inputs)


def op_by_op_config(graph: Any, handle: Handle, *, tf32: bool = False, benchmark: bool = True) -> Any:
    """The torch engine's configuration for running ``graph`` op by op: eager, uncaptured,
    TF32 as asked, cuDNN's algorithms timed at first use unless ``benchmark`` is off (then
    depthwise convolutions on PyTorch's own kernel, which cuDNN would build per shape too);
    knobs the engine does not offer for this graph left out."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY

    known = {k.name for k in REGISTRY.get("torch").knobs(graph, handle)}
    wanted: tuple[tuple[str, bool], ...] = (("compile", False), ("cuda_graph", False), ("tf32", tf32))
    if not benchmark:  # nothing timed or built per shape at first use
        wanted += (("cudnn_benchmark", False), ("cudnn_depthwise", False))
    return EngineConfig("torch", tuple(kv for kv in wanted if kv[0] in known))


class TorchOpByOp:
    """The region's nodes run one by one on PyTorch, as the torch engine runs a graph
    eagerly (no compile, no CUDA graph, no oneDNN fused steps' weight packing): what the
    ONNX provider did on the GPU before regions, so the bar fusegraph's engines must clear.
    ``tf32``: float32 convolutions and matmuls with TF32 allowed (a session asking for tf32
    measures against PyTorch at tf32, not at strict float32)."""

    def __init__(self, handle: Handle, *, tf32: bool = False) -> None:
        self.handle = handle
        self.tf32 = tf32
        self.name = "torch.eager[tf32]" if tf32 else "torch.eager"

    def runnable(self, region: Region, inputs: Mapping[str, Any]) -> Callable[[], object]:
        from fusegraph.engines.registry import REGISTRY

        plan = REGISTRY.get("torch").build(region.graph, self.handle,
                                           op_by_op_config(region.graph, self.handle, tf32=self.tf32))
        pack = dict(inputs)
        return lambda: plan.execute(pack)

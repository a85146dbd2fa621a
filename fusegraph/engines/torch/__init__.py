"""The vendor-library engine: runs a graph on PyTorch (cuDNN / cuBLAS on NVIDIA, oneDNN /
MKL on CPU), eagerly op by op or through ``torch.compile``.

Numerics: each node computes in its compute type (the node's, else the graph's, else f32
for narrower floats), its result is rounded to the node's output type. On a GPU,
f16/bf16 convolutions, matmuls and attention run on the native low-precision kernels,
which accumulate in f32 (fp16 reduced-precision reductions and TF32 are switched off
while a plan runs); on the CPU they are computed in f32.

The package, one idea a module (importing it imports no torch: the registry lists the
engine without loading its library, issue 10):

- ``engine``: TorchEngine -- availability, support, knobs; builds plans
- ``convert``: dtypes, NumPy arrays and Buffers (DLPack) to and from torch tensors
- ``context``, ``lower``, ``lower_pointwise``, ``lower_nn``: the op table ``LOWER``, one
  lowering per OpKind (and one torch expression per PointwiseMode)
- ``function``: the graph as one Python function (eager, or what torch.compile traces)
- ``plan``: TorchPlan -- variant packs, execute, the hot path, oneDNN Graph use
- ``cuda_graph``: capture and replay of an eager plan on NVIDIA
- ``steps``, ``fusion``: multi-node steps (oneDNN fused conv / linear, scale-shift,
  channel shuffle) and finding them in a graph
- ``onednn_graph``: the CPU plan traced into TorchScript for oneDNN Graph, probed in a
  child process (``python -m fusegraph.engines.torch.onednn_graph``)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusegraph.engines.torch.convert import (
        buffer_to_torch,
        from_numpy,
        to_numpy_into,
        torch_build_info,
        torch_dtype,
        torch_installed,
        torch_to_buffer,
    )
    from fusegraph.engines.torch.engine import TorchEngine
    from fusegraph.engines.torch.lower import LOWER
    from fusegraph.engines.torch.onednn_graph import ONEDNN_GRAPH_DEFAULT
    from fusegraph.engines.torch.plan import TorchPlan

# Each public name and the module that defines it, imported on first access (PEP 562): the
# registry lists the engine through ``engine`` alone, without the lowerings and the plan.
_HOME = {
    "LOWER": "lower",
    "ONEDNN_GRAPH_DEFAULT": "onednn_graph",
    "TorchEngine": "engine",
    "TorchPlan": "plan",
    "buffer_to_torch": "convert",
    "from_numpy": "convert",
    "to_numpy_into": "convert",
    "torch_build_info": "convert",
    "torch_dtype": "convert",
    "torch_installed": "convert",
    "torch_to_buffer": "convert",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "LOWER",
    "ONEDNN_GRAPH_DEFAULT",
    "TorchEngine",
    "TorchPlan",
    "buffer_to_torch",
    "from_numpy",
    "to_numpy_into",
    "torch_build_info",
    "torch_dtype",
    "torch_installed",
    "torch_to_buffer",
]

"""The Triton engine: generated row kernels for memory-bound graphs on NVIDIA GPUs."""

from fusegraph.engines.triton.engine import TritonEngine

__all__ = ["TritonEngine"]

"""The cuDNN graph engine (NVIDIA GPUs; extra ``fusegraph[cuda]``): see docs/gpu.md.

Importing this package imports neither cudnn nor torch; the engine loads them the first
time it is asked whether it can run something.
"""

from __future__ import annotations

from fusegraph.engines.cudnn.engine import CudnnEngine

__all__ = ["CudnnEngine"]

"""fusegraph: a graph API for fused deep-learning ops, with JIT-compiling engines."""

from __future__ import annotations

__version__ = "0.2.0"  # part of the tuning-database and autotune-choice keys: bump when speed-relevant code changes

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.errors import (
    CompileError,
    ExecutionError,
    FusegraphError,
    OptionError,
    UnsupportedError,
    ValidationError,
    VariantPackError,
)
from fusegraph.graph.graph import Graph
from fusegraph.graph.layout import strides_for
from fusegraph.graph.ops import (
    NormFwdPhase,
    OpKind,
    PointwiseMode,
    PoolingMode,
    ReductionMode,
)
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.buffer import Buffer
from fusegraph.runtime.handle import Handle

# Importing the selection layer registers the planner behind Graph's plan methods
# (build, execute, ...: the seam in graph/seam.py); users always have it.
from fusegraph.select import BuildPlanPolicy, HeurMode

__all__ = [
    "Buffer",
    "BuildPlanPolicy",
    "CompileError",
    "DataType",
    "ExecutionError",
    "FusegraphError",
    "Graph",
    "Handle",
    "HeurMode",
    "NormFwdPhase",
    "OpKind",
    "OptionError",
    "PointwiseMode",
    "PoolingMode",
    "ReductionMode",
    "TensorAttr",
    "UnsupportedError",
    "ValidationError",
    "VariantPackError",
    "__version__",
    "as_data_type",
    "strides_for",
]

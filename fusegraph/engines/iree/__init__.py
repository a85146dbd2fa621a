"""The IREE JIT engine: graphs -> torch-dialect MLIR -> IREE (in-process) -> cached -> run.

Importing this package is cheap: IREE's compiler is only loaded when something compiles.
See docs/iree_engine.md.
"""

from __future__ import annotations

from fusegraph.engines.iree.artifact import compile_to_artifact, load_artifact, read_artifact
from fusegraph.engines.iree.engine import IreeEngine
from fusegraph.engines.iree.plan import IreePlan

__all__ = ["IreeEngine", "IreePlan", "compile_to_artifact", "load_artifact", "read_artifact"]

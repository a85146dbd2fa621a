"""The IREE engine's view of the HAL runtime, which lives in the runtime layer
(fusegraph/runtime/iree_hal.py) because Buffers are HAL memory. Kept so that existing
imports of ``fusegraph.engines.iree.runtime`` keep working."""

from fusegraph.runtime.iree_hal import (
    HAL_DRIVERS,
    IMPORT_ALIGNMENT,
    STATE_KEY,
    IreeRuntime,
    LoadedModule,
    available_drivers,
    bindings,
    element_type,
    runtime_for,
    track,
)

__all__ = [
    "HAL_DRIVERS",
    "IMPORT_ALIGNMENT",
    "STATE_KEY",
    "IreeRuntime",
    "LoadedModule",
    "available_drivers",
    "bindings",
    "element_type",
    "runtime_for",
    "track",
]

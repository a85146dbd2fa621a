"""The ONNX op table and its lowerings, one module per op family.

Importing this package fills :data:`TABLE` (each family module registers its lowerings);
``fusegraph.onnx.importer`` drives them. See docs/onnx.md, "Adding an ONNX op".
"""

from __future__ import annotations

from fusegraph.onnx.ops import conv, elementwise, gemm, gqa, norm, rotary, shape  # noqa: F401  (they register)
from fusegraph.onnx.ops.common import data_type_of
from fusegraph.onnx.ops.table import (
    TABLE,
    Lowering,
    OpEntry,
    Unmappable,
    lowering_for,
    lowers,
    register,
)

#: ONNX op types whose partitions keep activations channels-last (convolutions, pooling, LRN).
SPATIAL_OPS = frozenset(op for op, e in TABLE.items() if e.spatial)

__all__ = [
    "SPATIAL_OPS", "TABLE", "Lowering", "OpEntry", "Unmappable", "data_type_of", "lowering_for",
    "lowers", "register",
]

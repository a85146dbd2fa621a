"""The ONNX op table (fusegraph/onnx/ops): structure of the registry, and each family's
lowerings against ONNX Runtime on random data."""

from __future__ import annotations

import pytest

from fusegraph.onnx import importer
from fusegraph.onnx.ops import SPATIAL_OPS, TABLE, lowers, register
from fusegraph.onnx.ops.table import OpEntry


def test_every_op_type_has_one_entry_in_its_family_module() -> None:
    families = {e.family for e in TABLE.values()}
    assert families == {"conv", "gemm", "elementwise", "norm", "shape"}
    for op, entry in TABLE.items():
        assert isinstance(entry, OpEntry) and entry.op_type == op
        assert entry.lower.__module__ == f"fusegraph.onnx.ops.{entry.family}"
    assert {"Conv", "MatMul", "Add", "LayerNormalization", "Reshape", "Where", "Cast"} <= set(TABLE)


def test_spatial_ops_come_from_the_table() -> None:
    assert {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LRN"} == SPATIAL_OPS
    assert importer.SPATIAL_OPS is SPATIAL_OPS


def test_a_second_lowering_for_one_op_type_is_refused() -> None:
    with pytest.raises(ValueError, match="already lowered"):
        register("Conv", TABLE["Relu"].lower)
    with pytest.raises(ValueError, match="already lowered"):
        lowers("MatMul")(TABLE["Relu"].lower)

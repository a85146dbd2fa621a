"""The torch front door's plan cache (fusegraph/torch/plans.py): a compiled region on a GPU
takes a kernel engine only, and where none builds the graph the refusal is typed and names
each engine's reason (checked on the CPU, where no kernel engine runs)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch front door needs torch")

from fusegraph.dtypes import DataType
from fusegraph.errors import UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.runtime.handle import Handle
from fusegraph.torch import plans


def test_no_kernel_engine_is_a_typed_refusal_naming_each_engine() -> None:
    g = Graph("ln_region", io_data_type=DataType.FLOAT)
    g.relu(g.tensor("x", [64, 32])).set_output(True).set_name("y")
    with pytest.raises(UnsupportedError) as info:
        plans._kernel_build(g.validate(), Handle("cpu"))
    msg = str(info.value)
    assert "ln_region" in msg and "no kernel engine" in msg
    for name in plans.KERNEL_ENGINES:
        assert f"{name}:" in msg, msg

"""The torch front door's plan cache (fusegraph/torch/plans.py): a compiled region on a GPU
takes a kernel engine only, and where none builds the graph the refusal is typed and names
each engine's reason (checked on the CPU, where no kernel engine runs)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch front door needs torch")

from fusegraph.dtypes import DataType
from fusegraph.errors import UnsupportedError
from fusegraph.graph.graph import Graph
from fusegraph.regions import views
from fusegraph.regions.views import KERNEL_ENGINES
from fusegraph.runtime.handle import Handle
from fusegraph.torch import plans


def test_no_kernel_engine_is_a_typed_refusal_naming_each_engine() -> None:
    g = Graph("ln_region", io_data_type=DataType.FLOAT)
    g.relu(g.tensor("x", [64, 32])).set_output(True).set_name("y")
    with pytest.raises(UnsupportedError) as info:
        plans._kernel_build(g.validate(), Handle("cpu"))
    msg = str(info.value)
    assert "ln_region" in msg and "no kernel engine" in msg
    for name in KERNEL_ENGINES:
        assert f"{name}:" in msg, msg


def test_a_region_no_kernel_engine_takes_is_built_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel engines refuse a region for its reshapes, the build retries the
    graph with its border reshapes folded into views and returns a plan with the original
    interface. Checked on the CPU with a stand-in for the kernel engines (the torch engine,
    refusing any reshape node, as cuDNN and the Triton row kernel do) and torch tensors:
    the answer is PyTorch's layer norm."""
    import torch
    import torch.nn.functional as F

    from fusegraph.graph.ops import OpKind
    from fusegraph.regions.views import FoldedPlan

    def stand_in(graph: Graph, handle: Handle, engines: object = None) -> object:
        if any(n.kind == OpKind.RESHAPE for n in graph.nodes):
            raise UnsupportedError(f"graph '{graph.name}': takes no reshape")
        return graph.build(handle=handle, engine="torch")

    monkeypatch.setattr(views, "kernel_plan", stand_in)
    b, s, f = 2, 5, 16
    g = Graph("ln_rows", io_data_type=DataType.FLOAT)
    x, w, bias = g.tensor("x", [b, s, f]), g.tensor("w", [f]), g.tensor("b", [f])
    y, _, _ = g.layernorm(g.reshape(x, [b * s, f]), g.reshape(w, [1, f]), g.reshape(bias, [1, f]), 1e-5)
    g.reshape(y, [b, s, f]).set_output(True).set_name("out")
    plan = plans._kernel_build(g.validate(), Handle("cpu"))
    assert isinstance(plan, FoldedPlan)
    tx, tw, tb = torch.randn(b, s, f), torch.randn(f), torch.randn(f)
    got = plans.run(plan, {"x": tx, "w": tw, "b": tb})["out"]
    want = F.layer_norm(tx, (f,), tw, tb, 1e-5)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) <= 1e-5

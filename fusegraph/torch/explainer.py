"""``fusegraph.torch.explain(model, *example_inputs)``: compiles the model with the
fusegraph backend, runs it once (and, where it has parameters that want gradients, its
backward), and returns the region layer's report over every ATen node of the forward and
backward graphs: where each ran (a fusegraph engine, or Inductor) and why, and the
``coverage`` fraction of compute nodes fusegraph ran."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusegraph.regions.report import Report
from fusegraph.torch.compile_backend import collecting, fusegraph_backend


def explain(model: Any, *example_inputs: Any, options: Mapping[str, Any] | None = None,
            backward: bool | None = None) -> Report:
    """``options`` as the backend takes them (default: the floor off, so the report says what
    fusegraph can claim; pass ``{"floor": True}`` for what it would keep). ``backward``: run
    the backward too (default: where gradients are enabled and something requires them)."""
    opts = {"floor": False, **dict(options or {})}

    def compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return fusegraph_backend(gm, inputs, options=opts)

    # a backend of its own: Dynamo compiles afresh for it and leaves the caller's compiled
    # functions (and their caches) alone
    compiled: Any = torch.compile(model, backend=compiler)
    with collecting() as rows:
        out = compiled(*example_inputs)
        tensors = [t for t in (out if isinstance(out, tuple | list) else [out]) if isinstance(t, torch.Tensor)]
        wants = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if backward if backward is not None else wants:
            params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
            kept = [p.grad for p in params]  # the caller's gradients come back untouched
            sum(t.float().sum() for t in tensors if t.requires_grad).backward()  # type: ignore[union-attr]
            for p, g in zip(params, kept, strict=True):
                p.grad = g
    return Report(tuple(rows))

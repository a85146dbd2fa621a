"""Which decompositions Inductor gets under the backend: the ops fusegraph converts are kept
whole through AOTAutograd's trace so that they can be claimed, and those left unclaimed are
decomposed afterwards as Inductor would have, so that Inductor fuses them and its FX graph
cache can key the compile."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.torch import aten

log = logging.getLogger("fusegraph.torch")


def keep_whole() -> dict[Any, Any]:
    """Inductor's decompositions without the ops fusegraph converts."""
    from torch._inductor.decomposition import select_decomp_table

    return {op: fn for op, fn in select_decomp_table().items() if op not in aten.CONVERTERS}


def decompose_rest(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> tuple[torch.fx.GraphModule, bool]:
    """The ops kept whole for fusegraph that it did not claim, decomposed as Inductor would
    have (so Inductor fuses them instead of calling them as fallbacks, which it refuses for an
    op with a decomposition: ``aten.t`` under a dynamic batch on the H100). Re-traced on the
    graph's fake inputs, symbolic sizes included. Also says whether the graph is now as
    Inductor's own table leaves it (False: ops kept whole remain)."""
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    left = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in aten.CONVERTERS}
    # Re-traced with Inductor's whole table, not only the kept ops' entries: a decomposition
    # can itself produce a kept op (native_layer_norm_backward -> aten.transpose.int), which
    # Inductor would then make a fallback -- an error where the CI variable is set
    needed = table if any(op in table for op in left) else {}
    if not needed:
        return gm, True
    if any(not isinstance(x, torch.Tensor | torch.SymInt) for x in inputs):
        return gm, False
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(inputs)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            traced: torch.fx.GraphModule = make_fx(torch.fx.Interpreter(gm).run, decomposition_table=needed)(*inputs)
    except Exception as exc:  # keep them whole
        log.info("unclaimed ops kept whole for Inductor (%s: %s)", type(exc).__name__, exc)
        return gm, False
    traced.meta.update(gm.meta)
    return traced, True


def cacheable(settled: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Inductor's compile kwargs with its own decomposition table where the graph is as that
    table leaves it (``settled``: decompose_rest re-traced it, or kept nothing whole): the
    table fusegraph passes to keep ops whole holds functions Inductor cannot pickle into its
    FX graph cache's key, so every graph was compiled afresh in every process (measured on
    the CPU: a tiny GPT-2's first step 13.5 s with a warm fusegraph cache, against 2.7 s for
    Inductor alone)."""
    if not settled:
        return kwargs
    from torch._inductor.decomposition import select_decomp_table

    return {**kwargs, "get_decomp_fn": select_decomp_table}

"""The torch lowerings of the indexing ops: gather (ONNX Gather, an embedding lookup) and
its backward (an embedding's weight gradient).

The forward is advanced indexing along the axis (``data[:, ..., indices]``): one kernel
that wraps negative indices as ONNX does and checks the range (an IndexError on the CPU, a
device-side assert on CUDA), where ``index_select`` / ``F.embedding`` would refuse the
negative ones. The backward is ``index_add_`` into zeros in the node's compute type (f32
for f16/bf16 gradients: repeated indices sum many rows, as PyTorch's own embedding
backward accumulates).
"""

from __future__ import annotations

from fusegraph.engines.torch.context import _Ctx
from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.graph.node import Node
from fusegraph.graph.ops import GatherAttrs, GatherBackwardAttrs


def _lower_gather(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    attrs = node.attrs
    assert isinstance(attrs, GatherAttrs)
    data, idx = ins["data"], ins["indices"]
    axis = attrs.axis % data.dim()
    return {"y": data[(slice(None),) * axis + (idx,)]}


def _lower_gather_backward(ctx: _Ctx, node: Node, ins: dict[str, Tensor]) -> dict[str, Tensor]:
    torch = _torch()
    attrs = node.attrs
    assert isinstance(attrs, GatherBackwardAttrs)
    dy = ctx.cast_in(node, ins["dy"])
    idx = ins["indices"]
    n = attrs.num_rows
    rest = tuple(dy.shape[idx.dim():])
    flat = idx.reshape(-1).long()
    flat = torch.where(flat < 0, flat + n, flat)
    out = torch.zeros((n, *rest), dtype=dy.dtype, device=dy.device)
    out.index_add_(0, flat, dy.reshape(-1, *rest))
    if attrs.padding_idx is not None:
        out[attrs.padding_idx % n] = 0
    return {"d_data": out}

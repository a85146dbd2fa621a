"""Converters of the ATen lookups (registered in aten.CONVERTERS): ``aten.embedding`` (what
``nn.Embedding`` becomes in an AOTAutograd forward, GPT-2's and Llama's token embeddings),
its backward ``aten.embedding_dense_backward``, and ``aten.index_select`` -- each onto the
graph API's gather op or its backward.

The index tensor is an integer graph input (``Ctx.value`` takes floating-point operands
only): the ids come from a placeholder or from ATen code fusegraph does not convert, never
from a converted node (those compute floats). PyTorch refuses negative ids where the graph
op wraps them (ONNX's rule); on the ids PyTorch accepts the two agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import Ctx, Refused, _args, _int, _shape, converts, meta

aten = torch.ops.aten
_INDEX_TYPES = (torch.int32, torch.int64)


def _arg(n: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    args = _args(n)
    return args[i] if len(args) > i else n.kwargs.get(name, default)


def index(c: Ctx, arg: Any) -> TensorAttr:
    """An integer index operand: computed in the graph, or a graph input of its own."""
    return c.value(arg, _INDEX_TYPES, "an int32 or int64")


@converts(aten.embedding.default)
def _embedding(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False): the rows of
    ``weight`` the ids name. ``padding_idx`` only shapes the backward (embedding_dense_backward
    takes it again); ``sparse`` and ``scale_grad_by_freq`` change the backward into what the
    graph API has no op for, so they are refused here, where the forward would claim them."""
    weight, ids = _args(n)[:2]
    if _arg(n, 4, "sparse", False):
        raise Refused("embedding with sparse=True (its gradient is a sparse tensor; the graph API has no sparse op)")
    if _arg(n, 3, "scale_grad_by_freq", False):
        raise Refused("embedding with scale_grad_by_freq=True (the backward divides by id counts: no graph op for it)")
    return c.g.gather(c.value(weight), index(c, ids), axis=0)


@converts(aten.embedding_dense_backward.default)
def _embedding_backward(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq) -> the weight's
    gradient: grad_output's rows summed into the rows the ids name; padding_idx -1 is none."""
    dy, ids, num_weights, padding_idx, scale = _args(n)[:5]
    if scale:
        raise Refused("embedding backward with scale_grad_by_freq=True (divides by id counts: no graph op for it)")
    pad = _int(padding_idx)
    return c.g.gather_backward(c.value(dy), index(c, ids), _int(num_weights), None if pad < 0 else pad)


@converts(aten.index_select.default)
def _index_select(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(self, dim, index): a gather along ``dim`` by a 1-D index."""
    x, dim, ids = _args(n)[:3]
    rank = len(_shape(meta(x)))
    if rank == 0:
        raise Refused("index_select of a 0-dim tensor")
    return c.g.gather(c.value(x), index(c, ids), axis=int(dim) % rank)

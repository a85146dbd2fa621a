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

import operator
from typing import Any

import torch
import torch.fx

from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import Ctx, Key, Refused, _args, _int, _shape, _stride, converts, meta
from fusegraph.torch.plans import data_type

aten = torch.ops.aten
_INDEX_TYPES = (torch.int32, torch.int64)


def _arg(n: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    args = _args(n)
    return args[i] if len(args) > i else n.kwargs.get(name, default)


def index(c: Ctx, arg: Any) -> TensorAttr:
    """An integer index operand as a graph input (one per FX value, shared by its readers)."""
    if not isinstance(arg, torch.fx.Node):
        raise Refused(f"expected an index tensor, got {arg!r}")
    key: Key = (arg.name, None)
    if arg.op == "call_function" and arg.target is operator.getitem:
        src, idx = _args(arg)
        key = (src.name, int(idx))
    t = c._tensors.get(key)
    if t is None:
        t = c._inputs.get(key)
    if t is not None:
        return t
    v = meta(arg)
    if not isinstance(v, torch.Tensor) or v.dtype not in _INDEX_TYPES:
        raise Refused(f"indices '{arg.name}' are not an int32 or int64 tensor")
    if v.dim() == 0:
        raise Refused(f"indices '{arg.name}' are a 0-dim tensor (a graph tensor has at least one dim)")
    name = f"{key[0]}" if key[1] is None else f"{key[0]}.{key[1]}"
    t = c.g.tensor(f"in:{name}", _shape(v), _stride(v), data_type(v.dtype))
    c._inputs[key] = t
    c.out.inputs[t.name] = key
    return t


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

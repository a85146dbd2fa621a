"""Converters of the ATen norms, pooling and concatenation (registered in aten.CONVERTERS):
batch norm in training (AOTAutograd's functional form, running statistics updated) and
inference, its backward; RMSNorm as PyTorch's fused op (CUDA) and its backward, and as the
pattern PyTorch decomposes it into on the CPU (pow -> mean -> add eps -> rsqrt -> mul ->
mul weight); max pooling (where its indices are not read: the graph's pooling computes
none, so a training forward, which saves them for the backward, leaves it to Inductor --
the backward itself is converted without them, in aten_pool.py); ``aten.cat``.

Each reads its ATen signature whole (defaults, dims, eps, momentum, the training flag,
which results are read) and refuses, with the reason, what the graph API cannot express.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusegraph.dtypes import DataType
from fusegraph.errors import FusegraphError
from fusegraph.graph.ops import NormFwdPhase, PoolingMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.torch.aten import (
    CONVERTERS,
    MIXED_RESULTS,
    Ctx,
    Refused,
    Result,
    Zeros,
    _args,
    _int,
    _reshape,
    _shape,
    converts,
    meta,
)

aten = torch.ops.aten


def _arg(n: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    args = _args(n)
    return args[i] if len(args) > i else n.kwargs.get(name, default)


def _read(n: torch.fx.Node) -> set[int]:
    """Which items of a tuple-valued node are read (an item taken by a getitem nothing reads
    is not)."""
    out = set()
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem:
            if u.users:
                out.add(int(u.args[1]))  # type: ignore[arg-type]
        else:
            out.update(range(len(meta(n))))
    return out


# ---- batch norm -----------------------------------------------------------------------------------
def _affine(w: Any, b: Any) -> None:
    if w is None or b is None:
        raise Refused("batch norm without weight or bias (affine=False): the graph API's batchnorm takes both")


def _const(c: Ctx, v: Any, like: TensorAttr) -> TensorAttr:
    """eps / momentum as a constant of the computation's precision (a float32 momentum of
    0.1 moves a float64 running mean by ~1e-9 relative)."""
    return c.g.scalar(float(v), DataType.DOUBLE if like.data_type == DataType.DOUBLE else DataType.FLOAT)


def _channels(c: Ctx, stat: TensorAttr, like: Any) -> TensorAttr:
    """A [1, C, 1, ...] statistic as PyTorch's [C]."""
    return _reshape(c, stat, _shape(like))


@converts(aten._native_batch_norm_legit_functional.default)
def _bn_functional(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, running_mean, running_var, training, momentum, eps) ->
    (y, save_mean [C], save_invstd [C], running_mean_out, running_var_out): AOTAutograd's
    training-mode batch norm; the running statistics are updated as PyTorch does
    (unbiased batch variance)."""
    x, w, b, rm, rv, training, momentum, eps = _args(n)
    _affine(w, b)
    if not training:
        raise Refused("functional batch norm with training=False (eval mode comes as "
                      "_native_batch_norm_legit_no_training)")
    v = meta(n)
    tx = c.value(x)
    y, mean, inv, nrm, nrv = c.g.batchnorm(tx, c.value(w), c.value(b), _const(c, eps, tx),
                                           in_running_mean=c.value(rm), in_running_var=c.value(rv),
                                           momentum=_const(c, momentum, tx))
    return [y, _channels(c, mean, v[1]), _channels(c, inv, v[2]), nrm, nrv]


@converts(aten._batch_norm_with_update_functional.default)
def _bn_with_update(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, running_mean, running_var, momentum, eps) -> (y, save_mean,
    save_invstd, reserve, running_mean_out, running_var_out): what a training batch norm
    becomes where PyTorch would call cuDNN's (CUDA). The reserve (cuDNN's workspace, uint8)
    is handed back as zeros, and only to ``batch_norm_backward``, whose training formula
    does not read it (PyTorch's own decomposition of it ignores it too)."""
    x, w, b, rm, rv, momentum, eps = _args(n)
    _affine(w, b)
    v = meta(n)
    reserve = v[3]
    readers = [r for u in n.users if u.target is operator.getitem and u.args[1] == 3 for r in u.users]
    if any(r.target is not aten.batch_norm_backward.default for r in readers):
        raise Refused("batch norm's cuDNN reserve is read by something other than batch_norm_backward")
    tx = c.value(x)
    y, mean, inv, nrm, nrv = c.g.batchnorm(tx, c.value(w), c.value(b), _const(c, eps, tx),
                                           in_running_mean=c.value(rm), in_running_var=c.value(rv),
                                           momentum=_const(c, momentum, tx))
    return [y, _channels(c, mean, v[1]), _channels(c, inv, v[2]), Zeros(tuple(_shape(reserve)), reserve.dtype),
            nrm, nrv]


MIXED_RESULTS.add(aten._batch_norm_with_update_functional.default)


@converts(aten._native_batch_norm_legit.no_stats)
def _bn_no_stats(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, training, momentum, eps) -> (y, save_mean, save_invstd):
    ``track_running_stats=False``, batch statistics only."""
    x, w, b, training, _momentum, eps = _args(n)
    _affine(w, b)
    if not training:
        raise Refused("batch norm without running statistics and training=False")
    v = meta(n)
    tx = c.value(x)
    y, mean, inv = c.g.batchnorm(tx, c.value(w), c.value(b), _const(c, eps, tx))
    return [y, _channels(c, mean, v[1]), _channels(c, inv, v[2])]


@converts(aten.native_batch_norm.default)
def _bn_native(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, running_mean, running_var, training, momentum, eps) ->
    (y, save_mean, save_invstd). Its running statistics are updated in place, which a
    functional graph does not express: converted only where there are none to update."""
    x, w, b, rm, rv, training, _momentum, eps = _args(n)
    _affine(w, b)
    v = meta(n)
    if training:
        if rm is not None or rv is not None:
            raise Refused("native_batch_norm updates the running statistics in place "
                          "(AOTAutograd gives the functional form, which converts)")
        tx = c.value(x)
        y, mean, inv = c.g.batchnorm(tx, c.value(w), c.value(b), _const(c, eps, tx))
        return [y, _channels(c, mean, v[1]), _channels(c, inv, v[2])]
    if rm is None or rv is None:
        raise Refused("eval-mode batch norm without running statistics")
    return _inference(c, n, x, w, b, rm, rv, eps)


def _inference(c: Ctx, n: torch.fx.Node, x: Any, w: Any, b: Any, rm: Any, rv: Any, eps: Any) -> list[Result]:
    v = meta(n)
    tx = c.value(x)
    y = c.g.batchnorm_inference(tx, c.value(w), c.value(b), c.value(rm), c.value(rv), _const(c, eps, tx))
    out: list[Result] = [y]
    for i in range(1, len(v)):  # empty save_mean / save_invstd (/ reserve) in eval mode
        if i in _read(n):
            if v[i].numel() != 0:
                raise Refused(f"eval-mode batch norm result {i} is read")
            out.append(Zeros(tuple(_shape(v[i])), v[i].dtype))
        else:
            out.append(None)
    return out


@converts(aten._native_batch_norm_legit_no_training.default)
def _bn_no_training(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, running_mean, running_var, momentum, eps) -> (y, empty, empty):
    eval mode, normalized by the running statistics."""
    x, w, b, rm, rv, _momentum, eps = _args(n)
    _affine(w, b)
    return _inference(c, n, x, w, b, rm, rv, eps)


@converts(aten._batch_norm_no_update.default)
def _bn_no_update(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight, bias, running_mean, running_var, momentum, eps) -> (y, empty, empty,
    empty reserve): eval mode where PyTorch would call cuDNN's."""
    x, w, b, rm, rv, _momentum, eps = _args(n)
    _affine(w, b)
    if rm is None or rv is None:
        raise Refused("eval-mode batch norm without running statistics")
    return _inference(c, n, x, w, b, rm, rv, eps)


MIXED_RESULTS.add(aten._batch_norm_no_update.default)


@converts(aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
def _bn_backward(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
    eps, output_mask[, reserve]) -> (dx, dweight, dbias), from the batch statistics the
    forward saved (``batch_norm_backward``'s "save_var" is the inverse standard deviation,
    its ``update`` the training flag; its cuDNN reserve is not read)."""
    dy, x, w, _rm, _rv, mean, invstd, train, _eps, mask = _args(n)[:10]
    if not train:
        raise Refused("eval-mode batch norm backward (normalized by the running statistics): "
                      "the graph API's batchnorm_backward is the training one")
    if w is None:
        raise Refused("batch norm backward without weight (affine=False)")
    if mean is None or invstd is None:
        raise Refused("batch norm backward without the saved statistics")
    dx, dw, db = c.g.batchnorm_backward(c.value(dy), c.value(x), c.value(w), c.value(mean), c.value(invstd))
    return [dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None]


# ---- group norm -------------------------------------------------------------------------------------
def _groups(c: Ctx, x: Any, n_: Any, ch: Any, hw: Any, group: Any) -> tuple[list[int], int, int, int, int]:
    shape = _shape(meta(x))
    nb, channels, spatial, g = _int(n_), _int(ch), _int(hw), _int(group)
    if len(shape) < 2 or shape[0] != nb or shape[1] != channels or g < 1 or channels % g or \
            math.prod(shape[2:]) != spatial:
        raise Refused(f"group norm sizes N={nb}, C={channels}, HxW={spatial}, group={g} do not match {shape}")
    return shape, nb, channels, spatial, g


def _unit(c: Ctx, like: TensorAttr) -> tuple[TensorAttr, TensorAttr]:
    return _const(c, 1.0, like), _const(c, 0.0, like)


@converts(aten.native_group_norm.default)
def _group_norm(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, weight?, bias?, N, C, HxW, group, eps) -> (y, mean [N, group], rstd [N, group]):
    a layer norm over each group's rows ([N * group, C / group * HxW], unit scale), then the
    per-channel weight and bias."""
    x, w, b, n_, ch, hw, group, eps = _args(n)
    shape, nb, channels, spatial, g = _groups(c, x, n_, ch, hw, group)
    tx = c.value(x)
    one, zero = _unit(c, tx)
    stats = bool({1, 2} & _read(n))
    yn, mean, inv = c.g.layernorm(_reshape(c, tx, [nb * g, channels // g * spatial]), one, zero, _const(c, eps, tx),
                                  NormFwdPhase.TRAINING if stats else NormFwdPhase.INFERENCE)
    y = _reshape(c, yn, [nb, channels, spatial])
    if w is not None:
        y = c.g.mul(y, _reshape(c, c.value(w), [1, channels, 1]))
    if b is not None:
        y = c.g.add(y, _reshape(c, c.value(b), [1, channels, 1]))
    v = meta(n)
    return [_reshape(c, y, shape), _reshape(c, mean, _shape(v[1])) if mean is not None else None,
            _reshape(c, inv, _shape(v[2])) if inv is not None else None]


@converts(aten.native_group_norm_backward.default)
def _group_norm_bwd(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask) -> (dx, dweight,
    dbias): dx is the layer norm backward of each group's rows fed dy * weight; dweight and
    dbias are sums over batch and space of dy * x_hat and dy."""
    dy, x, mean, rstd, w, n_, ch, hw, group, mask = _args(n)
    shape, nb, channels, spatial, g = _groups(c, x, n_, ch, hw, group)
    rows, f = nb * g, channels // g * spatial
    gr = c.g
    tdy, tx = c.value(dy), c.value(x)
    dy3 = _reshape(c, tdy, [nb, channels, spatial])
    m, r = _reshape(c, c.value(mean), [rows, 1]), _reshape(c, c.value(rstd), [rows, 1])
    out: list[Result] = [None, None, None]
    if mask[0]:
        ghat = gr.mul(dy3, _reshape(c, c.value(w), [1, channels, 1])) if w is not None else dy3
        one, _ = _unit(c, tx)
        dx, _, _ = gr.layernorm_backward(_reshape(c, ghat, [rows, f]), _reshape(c, tx, [rows, f]), one, m, r)
        out[0] = _reshape(c, dx, shape)
    if mask[1]:
        xhat = _reshape(c, gr.mul(gr.sub(_reshape(c, tx, [rows, f]), m), r), [nb, channels, spatial])
        out[1] = _reshape(c, gr.reduction(gr.mul(dy3, xhat), ReductionMode.SUM, [1, channels, 1]), [channels])
    if mask[2]:
        out[2] = _reshape(c, gr.reduction(dy3, ReductionMode.SUM, [1, channels, 1]), [channels])
    return out


# ---- RMSNorm ----------------------------------------------------------------------------------------
def _rms_rows(x: Any, normalized: Sequence[Any]) -> tuple[list[int], int, int]:
    shape = _shape(x)
    k = len(normalized)
    if k == 0 or [_int(s) for s in normalized] != shape[len(shape) - k:]:
        raise Refused(f"normalized shape {list(normalized)} is not the trailing dims of {shape}")
    f = math.prod(shape[len(shape) - k:])
    return shape, math.prod(shape) // f if f else 0, f


def _default_eps(x: Any) -> float:
    """PyTorch's eps=None: the machine epsilon of the computation type."""
    return float(torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps)


@converts(aten._fused_rms_norm.default)
def _rmsnorm_fused(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(input, normalized_shape, weight, eps) -> (y, rstd [..., 1, ...]): what
    F.rms_norm becomes on CUDA."""
    x, normalized, w, eps = _args(n)
    if w is None:
        raise Refused("RMSNorm without weight")
    shape, rows, f = _rms_rows(meta(x), normalized)
    e = _default_eps(meta(x)) if eps is None else float(eps)
    train = 1 in _read(n)
    tx = c.value(x)
    y, inv = c.g.rmsnorm(_reshape(c, tx, [rows, f]), _reshape(c, c.value(w), [1, f]), _const(c, e, tx),
                         NormFwdPhase.TRAINING if train else NormFwdPhase.INFERENCE)
    return [_reshape(c, y, shape), _reshape(c, inv, _shape(meta(n)[1])) if inv is not None else None]


@converts(aten._fused_rms_norm_backward.default)
def _rmsnorm_fused_bwd(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(grad_out, input, normalized_shape, rstd, weight, output_mask) -> (dx, dweight)."""
    dy, x, normalized, rstd, w, mask = _args(n)
    if w is None:
        raise Refused("RMSNorm backward without weight")
    shape, rows, f = _rms_rows(meta(x), normalized)
    dx, dw, _ = c.g.rmsnorm_backward(_reshape(c, c.value(dy), [rows, f]), _reshape(c, c.value(x), [rows, f]),
                                     _reshape(c, c.value(w), [1, f]), _reshape(c, c.value(rstd), [rows, 1]))
    return [_reshape(c, dx, shape) if mask[0] else None, _reshape(c, dw, _shape(meta(w))) if mask[1] else None]


def _only_user(n: torch.fx.Node) -> torch.fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _is_node(a: Any) -> bool:
    return isinstance(a, torch.fx.Node)


def _rms_pattern(n: torch.fx.Node) -> tuple[Any, Any, float, int, list[torch.fx.Node]] | str:
    """The decomposed RMSNorm starting at ``n`` (``pow(x, 2)``): (x, weight, eps, how many
    trailing dims it normalizes, the pattern's nodes pow, mean, add, rsqrt, mul,
    mul_weight), or why it is not one."""
    x, exponent = _args(n)[:2]
    if exponent != 2 or not _is_node(x):
        return "not a square"
    mean = _only_user(n)
    if mean is None or mean.target is not aten.mean.dim:
        return "the square is not read by one mean"
    rank = len(_shape(meta(x)))
    margs = _args(mean)
    dims = margs[1] if len(margs) > 1 else None
    keep = margs[2] if len(margs) > 2 else mean.kwargs.get("keepdim", False)
    if not dims or not keep or mean.kwargs.get("dtype") is not None:
        return "the mean is not over trailing dims with keepdim"
    axes = sorted(int(d) % rank for d in dims)
    if axes != list(range(rank - len(axes), rank)) or len(axes) >= rank:
        return "the mean is not over trailing dims with keepdim"
    add = _only_user(mean)
    if add is None or add.target not in (aten.add.Scalar, aten.add.Tensor) or _args(add)[0] is not mean:
        return "the mean is not read by one add of eps"
    eps = _args(add)[1]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or add.kwargs.get("alpha", 1) != 1:
        return "the mean is not read by one add of eps"
    rsqrt = _only_user(add)
    if rsqrt is None or rsqrt.target is not aten.rsqrt.default:
        return "no rsqrt of mean + eps"
    norm = next((u for u in rsqrt.users if u.target is aten.mul.Tensor and set(_args(u)[:2]) == {x, rsqrt}), None)
    if norm is None:
        return "x is not multiplied by the rsqrt"
    tail = next((u for u in norm.users if u.target is aten.mul.Tensor), None)
    if tail is None:
        return "the normalized x is not multiplied by a weight"
    a, b = _args(tail)[:2]
    w = b if a is norm else a
    if not _is_node(w) or w is norm:
        return "the normalized x is not multiplied by a weight"
    want = _shape(meta(x))[rank - len(axes):]
    wshape = _shape(meta(w))
    if wshape[len(wshape) - len(want):] != want or any(s != 1 for s in wshape[:len(wshape) - len(want)]):
        return f"the weight's dims {wshape} are not the normalized dims {want}"
    if w.op != "placeholder" and not _before(w, n):
        return "the weight is computed after the pattern starts"
    return x, w, float(eps), len(axes), [n, mean, add, rsqrt, norm, tail]


def _before(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    node = a.next
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


def _read_outside(node: torch.fx.Node, inside: Sequence[torch.fx.Node]) -> bool:
    return any(u not in inside for u in node.users)


def _pow_or_rmsnorm(c: Ctx, n: torch.fx.Node) -> Sequence[Result] | TensorAttr:
    """``pow(x, 2)`` heading PyTorch's decomposed RMSNorm becomes one rmsnorm (its later
    nodes absorbed: the rsqrt is the norm's saved inverse RMS, x * rsqrt computed where the
    backward reads it); any other pow converts as a pointwise power."""
    found = _rms_pattern(n)
    if isinstance(found, tuple):
        x, w, eps, k, nodes = found
        _, mean, add, rsqrt, norm, tail = nodes
        before = len(c.g.nodes)
        try:
            shape = _shape(meta(x))
            f = math.prod(shape[len(shape) - k:])
            rows = math.prod(shape) // f
            tx = c.value(x)
            y, inv = c.g.rmsnorm(_reshape(c, tx, [rows, f]), _reshape(c, c.value(w), [1, f]), _const(c, eps, tx),
                                 NormFwdPhase.TRAINING)
            assert inv is not None
            for node in (mean, add):
                c.absorb(node, None)
            outside = [_read_outside(node, nodes) for node in (rsqrt, norm)]
            r = _reshape(c, inv, _shape(meta(rsqrt))) if any(outside) else None
            c.absorb(rsqrt, r if outside[0] else None)
            c.absorb(norm, c.g.mul(c.value(x), r) if outside[1] and r is not None else None)
            c.absorb(tail, _reshape(c, y, _shape(meta(tail))))
            if _shape(meta(tail)) != shape:
                raise Refused(f"the weight broadcasts the result to {_shape(meta(tail))}")
            return []
        except (Refused, FusegraphError):  # converted as the ops it is made of
            del c.g.nodes[before:]
            for name in c.absorbed:
                c.forget(name)
            c.absorbed = []
    return _POW(c, n)


_POW = CONVERTERS[aten.pow.Tensor_Scalar]
CONVERTERS[aten.pow.Tensor_Scalar] = _pow_or_rmsnorm


# ---- pooling, concatenation ---------------------------------------------------------------------------
def _pair(v: Any, n: int, default: Sequence[int]) -> list[int]:
    vals = [_int(x) for x in (v if isinstance(v, list | tuple) else [v])] if v not in (None, []) else list(default)
    return vals * n if len(vals) == 1 else vals


@converts(aten.max_pool2d_with_indices.default)
def _max_pool(c: Ctx, n: torch.fx.Node) -> list[Result]:
    """(self, kernel_size, stride=[] (= kernel), padding=0, dilation=1, ceil_mode=False) ->
    (y, indices). The graph's pooling computes no indices, so a node whose indices are
    read stays with Inductor: in training AOTAutograd saves them for a backward compiled
    apart, which fusegraph may leave to Inductor (the floor), and Inductor's reads them.
    (fusegraph's own backward, aten_pool.py, recomputes them from x.)"""
    x = _args(n)[0]
    kernel = _pair(_arg(n, 1, "kernel_size", None), 2, ())
    stride = _pair(_arg(n, 2, "stride", []), 2, kernel)
    padding = _pair(_arg(n, 3, "padding", 0), 2, (0, 0))
    dilation = _pair(_arg(n, 4, "dilation", 1), 2, (1, 1))
    if 1 in _read(n):
        raise Refused("max pooling's indices are read (saved for its backward, which may run on Inductor): "
                      "the graph's pooling computes no indices")
    if any(d != 1 for d in dilation):
        raise Refused(f"max pooling with dilation {dilation}")
    xs = _shape(meta(x))
    if len(xs) != 4:
        raise Refused(f"max pooling of a rank-{len(xs)} input (unbatched)")
    # ceil_mode's extra window: padded after with -inf, as the reference pads max pooling
    post = _ceil_padding(_shape(meta(n)[0])[2:], stride, kernel, xs[2:], padding)
    y = c.g.pooling(c.value(x), PoolingMode.MAX, kernel, stride, pre_padding=padding, post_padding=post)
    return [y, None]


MIXED_RESULTS.add(aten.max_pool2d_with_indices.default)


@converts(aten.avg_pool2d.default)
def _avg_pool(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(self, kernel_size, stride=[] (= kernel), padding=0, ceil_mode=False,
    count_include_pad=True, divisor_override=None) -> y. Its backward reads no forward
    result, so the forward is claimed in training too (the backward stays with Inductor)."""
    x = _args(n)[0]
    kernel = _pair(_arg(n, 1, "kernel_size", None), 2, ())
    stride = _pair(_arg(n, 2, "stride", []), 2, kernel)
    padding = _pair(_arg(n, 3, "padding", 0), 2, (0, 0))
    include_pad = bool(_arg(n, 5, "count_include_pad", True))
    if _arg(n, 6, "divisor_override", None) is not None:
        raise Refused("average pooling with divisor_override")
    xs = _shape(meta(x))
    if len(xs) != 4:
        raise Refused(f"average pooling of a rank-{len(xs)} input (unbatched)")
    post = _ceil_padding(_shape(meta(n))[2:], stride, kernel, xs[2:], padding)
    if include_pad and any(q > p for q, p in zip(post, padding, strict=True)):
        raise Refused("ceil_mode's last window counting padding: PyTorch divides it by the part inside the padding")
    mode = PoolingMode.AVG_INCLUDE_PAD if include_pad else PoolingMode.AVG_EXCLUDE_PAD
    return c.g.pooling(c.value(x), mode, kernel, stride, pre_padding=padding, post_padding=post)


def _ceil_padding(want: Sequence[int], stride: Sequence[int], kernel: Sequence[int], size: Sequence[int],
                  padding: Sequence[int]) -> list[int]:
    """The padding after each spatial axis that gives PyTorch's output size (ceil_mode's
    extra window included)."""
    post = [max(p, (o - 1) * s + k - (i + p)) for o, s, k, i, p in zip(want, stride, kernel, size, padding,
                                                                      strict=True)]
    if any(q >= k for q, k in zip(post, kernel, strict=True)):
        raise Refused("ceil_mode's last window lies in the padding")
    return post


@converts(aten.cat.default)
def _cat(c: Ctx, n: torch.fx.Node) -> TensorAttr:
    """(tensors, dim=0) -> y."""
    tensors = _args(n)[0]
    dim = _arg(n, 1, "dim", 0)
    shapes = [_shape(meta(t)) for t in tensors]
    rank = len(_shape(meta(n)))
    if any(len(s) != rank for s in shapes):
        raise Refused("concatenation of tensors of different ranks (PyTorch skips empty 1-D ones)")
    return c.g.concatenate([c.value(t) for t in tensors], int(dim) % rank)

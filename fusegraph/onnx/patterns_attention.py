"""Attention as torch.onnx / transformers export it, fused into one node the importer
lowers to the graph API's ``sdpa``.

Matched, around each ``Softmax`` over the last axis (rank 3 or 4)::

    MatMul(Q', K')  -> [Mul / Div by a scalar constant] -> [Add mask] -> Softmax
      -> [IsNaN/Where guard] -> [Cast to the same type]... -> MatMul(., V')

where Q' may be ``Q * c`` and K' ``Kᵀ * c`` (torch's scaled_dot_product_attention export
scales both by d^-1/4), Kᵀ a ``Transpose`` (its permutation folded into how the sdpa node
reads K: BERT's ``Transpose(perm=[0, 2, 3, 1])`` of the head split reads K as the head
split's ``[0, 2, 1, 3]``), and K or V a grouped-query repeat (``Unsqueeze(axis 2) ->
Expand -> Reshape``, Llama's ``repeat_kv``), which becomes sdpa's own GQA (k/v heads
dividing q's). The scale is the product of the constants (``attn_scale``); a constant mask
that is exactly 0 on and below the diagonal and -inf above becomes ``causal``; any other
mask stays an additive mask. The head split and merge around it (``Reshape`` /
``Transpose``) stay graph ops the engine sees beside the sdpa node.

The guard transformers puts after the softmax (``Where(IsNaN(p), 0, p)``: rows whose keys
are all masked give 0, not NaN) is kept where it can act: with a mask that is not constant,
or a constant one with a fully masked row, the lowering zeroes exactly the rows whose mask
is -inf everywhere. On finite inputs this is the same function; with NaN in Q or K ONNX's
guard gives 0 where the fused node gives NaN (NaN never turns into a number here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import helper

from fusegraph.onnx.model import ONode
from fusegraph.onnx.patterns_common import Ctx, Refused

NAME = "onnx.attention.sdpa"


@dataclass
class _Match:
    nodes: list[ONode] = field(default_factory=list)
    scale: float = 1.0
    q: str = ""
    k: str = ""
    k_perm: tuple[int, ...] = ()
    v: str = ""
    mask: str = ""
    causal: bool = False
    guard: bool = False
    out: str = ""
    where: tuple[np.ndarray, float] | None = None  # Where(cond, scores, fill): cond, fill


def _scalar_factor(ctx: Ctx, node: ONode, chain: str) -> float | None:
    """The factor ``node`` (Mul or Div) applies to ``chain``: c for chain*c / c*chain, 1/c
    for chain/c; None when the other operand is not a one-element float constant."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if node.op_type == "Mul":
        other = b if a == chain else a
        c = ctx.scalar(other)
        return c if c is not None and c != 0.0 and np.isfinite(c) else None
    if node.op_type == "Div" and a == chain:
        c = ctx.scalar(b)
        return 1.0 / c if c is not None and c != 0.0 and np.isfinite(c) else None
    return None


def _scaled(ctx: Ctx, value: str, m: _Match) -> str:
    """``value`` through an optional scalar Mul/Div whose output only the match reads."""
    p = ctx.made_by(value, "Mul", "Div")
    if p is None or ctx.sole_reader(value) is None:
        return value
    for chain in p.inputs:
        f = _scalar_factor(ctx, p, chain)
        if f is not None and chain not in ctx.og.constants:
            m.scale *= f
            m.nodes.append(p)
            return chain
    return value


def _to_matmul(ctx: Ctx, value: str) -> bool:
    """``value`` is a MatMul's output, maybe through a constant-condition Where and one scalar
    Mul/Div."""
    if ctx.made_by(value, "MatMul") is not None:
        return True
    w = ctx.made_by(value, "Where")
    if w is not None and w.inputs[0] in ctx.og.constants:
        return _to_matmul(ctx, w.inputs[1])
    p = ctx.made_by(value, "Mul", "Div")
    return p is not None and any(
        ctx.made_by(c, "MatMul") is not None and _scalar_factor(ctx, p, c) is not None for c in p.inputs
    )


def _repeat_kv(ctx: Ctx, value: str, heads: int, m: _Match) -> str:
    """Llama's repeat_kv -- ``Reshape(Expand(Unsqueeze(x, [2]), [b, hk, n, s, d]), [b, hk*n,
    s, d])`` -- read as x with hk heads (query head i reads key head i // n: sdpa's GQA)."""
    r = ctx.made_by(value, "Reshape")
    e = ctx.made_by(r.inputs[0], "Expand") if r is not None else None
    u = ctx.made_by(e.inputs[0], "Unsqueeze") if e is not None else None
    if r is None or e is None or u is None:
        return value
    if ctx.sole_reader(value) is None or ctx.sole_reader(r.inputs[0]) is None or ctx.sole_reader(e.inputs[0]) is None:
        return value
    x = u.inputs[0]
    xs, us, es, rs = ctx.og.shape(x), ctx.og.shape(u.outputs[0]), ctx.og.shape(r.inputs[0]), ctx.og.shape(value)
    if xs is None or us is None or es is None or rs is None or len(xs) != 4 or len(es) != 5:
        return value
    b, hk, s, d = xs
    if us != (b, hk, 1, s, d) or es != (b, hk, es[2], s, d) or rs != (b, hk * es[2], s, d) or rs[1] != heads:
        return value
    m.nodes += [u, e, r]
    return x


def _k_operand(ctx: Ctx, kt: str, rank: int, heads: int, m: _Match) -> None:
    """K from the second operand Kᵀ of the scores' MatMul: a Transpose producing Kᵀ is
    folded into the permutation the lowering reads K with."""
    swap = list(range(rank))
    swap[-2], swap[-1] = swap[-1], swap[-2]
    t = ctx.made_by(kt, "Transpose")
    if t is not None and ctx.sole_reader(kt) is not None:
        src_rank = len(ctx.og.shape(t.inputs[0]) or ())
        perm = [int(p) for p in t.attr("perm", list(reversed(range(src_rank))))]
        if len(perm) == rank:
            perm[-2], perm[-1] = perm[-1], perm[-2]
            m.nodes.append(t)
            m.k, m.k_perm = t.inputs[0], tuple(perm)
            if m.k_perm == tuple(range(rank)) and rank == 4:
                m.k = _repeat_kv(ctx, m.k, heads, m)
            return
    m.k, m.k_perm = kt, tuple(swap)


def _window_mask(ctx: Ctx, s: str, shape: tuple[int, ...], m: _Match) -> np.ndarray | None:
    """Swin's shifted windows: ``Reshape(Add(Reshape(x, [B, nW, h, N, N]), mask), [B*nW, h, N,
    N])`` before the softmax adds a constant mask per window; returns it broadcast to the
    scores' shape (materialized, in the constant's type), the three nodes appended to
    ``m.nodes``. Added to a first constant mask in float64 and rounded once: the same sum
    ONNX forms in two roundings."""
    r2 = ctx.made_by(s, "Reshape")
    a2 = ctx.made_by(r2.inputs[0], "Add") if r2 is not None else None
    if r2 is None or a2 is None or len(shape) != 4:
        return None
    for split in a2.inputs:
        r1 = ctx.made_by(split, "Reshape")
        other = a2.inputs[1] if a2.inputs[0] == split else a2.inputs[0]
        five = ctx.og.shape(split)
        if r1 is None or five is None or len(five) != 5 or other not in ctx.og.constants:
            continue
        if ctx.og.shape(r1.inputs[0]) != shape or five[0] * five[1] != shape[0] or five[2:] != shape[1:]:
            continue
        c = ctx.og.constants[other]
        if c.ndim > 5 or np.broadcast_shapes(c.shape, five) != five or c.dtype.kind != "f":
            continue
        ctx.only_reader(split, "the windowed scores", [a2])
        ctx.only_reader(a2.outputs[0], "the masked windowed scores", [r2])
        m.nodes += [r2, a2, r1]
        return np.ascontiguousarray(np.broadcast_to(c, five)).reshape(shape)
    return None


def _where_mask(ctx: Ctx, m: _Match, shape: tuple[int, ...], elem: int, anchor: str) -> None:
    """``Where(cond, scores, fill)`` (GPT-2's causal mask): with fill -inf it is the additive
    mask ``where(cond, 0, -inf)`` (joined to an Add's constant mask, or ``causal`` when cond is
    the lower triangle); a causal triangle filled with the type's lowest value is ``causal``
    too -- exp(lowest - row max) is 0 in every row that keeps its diagonal, i.e. whenever the
    kept scores are finite and above lowest + 104. Any other fill replaces scores in a way an
    additive mask cannot, and is refused."""
    assert m.where is not None
    cond, fill = m.where
    if np.broadcast_shapes(cond.shape, shape) != shape:
        raise Refused(f"the Where condition {list(cond.shape)} broadcasts the scores {list(shape)} up")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    sq, sk = shape[-2:]
    tri = cond.shape[-2:] == (sq, sk) and bool(
        np.array_equal(np.broadcast_to(cond, (*cond.shape[:-2], sq, sk)),
                       np.broadcast_to(np.tril(np.ones((sq, sk), dtype=bool)), cond.shape)))
    if tri and (fill == -np.inf or fill == float(np.finfo(dtype).min)):
        m.causal = True
        return
    if fill != -np.inf:
        raise Refused(f"Where fills masked scores with {fill}: only -inf, or the lowest {dtype} value for a "
                      "causal triangle, is the same function as an attention mask")
    extra = np.where(cond, 0.0, -np.inf)
    if not m.mask:
        m.mask = ctx.new_const(f"{anchor}_where_mask", extra.astype(dtype))
    elif m.mask in ctx.og.constants:
        both = np.broadcast_to(ctx.og.constants[m.mask].astype(np.float64), shape) + extra
        m.mask = ctx.new_const(f"{anchor}_where_mask", both.astype(dtype))
    else:
        raise Refused(f"a Where mask beside a mask '{m.mask}' that is not constant")


def _identity(ctx: Ctx, node: ONode, value: str) -> bool:
    """``node`` passes ``value`` through unchanged: Identity, a Cast to its own type, an
    inference Dropout (no training_mode, or a constant false one; its mask unread)."""
    if not node.is_default_domain or node.inputs[0] != value:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Cast":
        return int(node.attr("to", 0)) == ctx.elem(value)
    if node.op_type == "Dropout":
        mode = node.inputs[2] if len(node.inputs) > 2 else ""
        training = ctx.og.constants.get(mode) if mode else np.array(False)
        mask_read = len(node.outputs) > 1 and node.outputs[1] and (
            ctx.consumers.get(node.outputs[1]) or node.outputs[1] in ctx.og.outputs)
        return training is not None and not bool(np.any(training)) and not mask_read
    return False


def _causal(mask: np.ndarray, scores: tuple[int, ...]) -> bool:
    """The constant mask is 0 on and below the diagonal, -inf above, for every batch/head."""
    sq, sk = scores[-2:]
    if mask.dtype.kind != "f" or mask.shape[-2:] != (sq, sk):
        return False
    tri = np.where(np.tril(np.ones((sq, sk), dtype=bool)), 0.0, -np.inf)
    return bool(np.array_equal(np.broadcast_to(mask, (*mask.shape[:-2], sq, sk)), np.broadcast_to(tri, mask.shape)))


def _match(ctx: Ctx, sm: ONode) -> _Match | None:
    """None where ``sm`` is no attention softmax at all; Refused where it nearly is."""
    s = sm.inputs[0]
    shape = ctx.og.shape(s)
    if shape is None or len(shape) not in (3, 4):
        return None
    rank = len(shape)
    # downstream: [guard] [identity casts] -> MatMul(p, V)
    p = sm.outputs[0]
    m = _Match(nodes=[sm])
    after: list[ONode] = []
    readers = ctx.readers(p)
    isnan = next((r for r in readers if r.op_type == "IsNaN" and r.is_default_domain), None)
    if isnan is not None and len(readers) == 2:
        where = next((r for r in readers if r is not isnan), None)
        if (where is not None and where.op_type == "Where" and where.inputs[0] == isnan.outputs[0]
                and where.inputs[2] == p and ctx.const_is(where.inputs[1], 0.0)
                and ctx.sole_reader(isnan.outputs[0]) is where):
            after += [isnan, where]
            m.guard = True
            p = where.outputs[0]
    while True:
        r = ctx.sole_reader(p)
        if r is not None and _identity(ctx, r, p):
            after.append(r)
            p = r.outputs[0]
            continue
        break
    mm2 = next((r for r in ctx.readers(p) if r.op_type == "MatMul" and r.is_default_domain and r.inputs[0] == p), None)
    if mm2 is None:
        return None
    # upstream: MatMul -> [scale] -> [Add mask] -> [windows: Reshape, Add mask, Reshape] -> Softmax
    cur = s
    window = _window_mask(ctx, cur, tuple(shape), m)
    if window is not None:
        cur = m.nodes[-1].inputs[0]
    add = ctx.made_by(cur, "Add")
    if add is not None:
        chain = next((c for c in add.inputs if _to_matmul(ctx, c)), None)
        if chain is None:
            return None
        m.mask = add.inputs[1] if add.inputs[0] == chain else add.inputs[0]
        m.nodes.append(add)
        ctx.only_reader(cur, "the masked scores", m.nodes)
        cur = chain
    wh = ctx.made_by(cur, "Where")
    if wh is not None:
        cond = ctx.og.constants.get(wh.inputs[0])
        fill = ctx.scalar(wh.inputs[2])
        if cond is None or cond.dtype != np.bool_ or fill is None or not _to_matmul(ctx, wh.inputs[1]):
            return None
        ctx.only_reader(cur, "the masked scores", m.nodes)
        m.nodes.append(wh)
        m.where = (cond, fill)
        cur = wh.inputs[1]
    sc = ctx.made_by(cur, "Mul", "Div")
    if sc is not None:
        chain = next((c for c in sc.inputs if _scalar_factor(ctx, sc, c) is not None and ctx.made_by(c, "MatMul")), None)
        if chain is None:
            return None
        f = _scalar_factor(ctx, sc, chain)
        assert f is not None
        m.scale *= f
        ctx.only_reader(cur, "the scaled scores", m.nodes)
        m.nodes.append(sc)
        cur = chain
    mm1 = ctx.made_by(cur, "MatMul")
    if mm1 is None:
        return None
    # from here on the softmax sits between two MatMuls: every failure is a refusal
    ax = sm.attr("axis", -1 if ctx.og.opset >= 13 else 1)
    if int(ax) % rank != rank - 1:
        raise Refused(f"Softmax axis={ax} is not the last axis of the rank-{rank} scores")
    ctx.only_reader(cur, "the scores", m.nodes)
    for value in [sm.outputs[0], *(n.outputs[0] for n in after)]:
        ctx.only_reader(value, "the probabilities", [*after, mm2])
    m.nodes += [mm1, *after, mm2]
    m.out = mm2.outputs[0]
    elem = ctx.elem(s)
    if elem not in (1, 10, 16):  # float, float16, bfloat16
        raise Refused(f"scores '{s}' are not float32/float16/bfloat16 (ONNX type {elem})")
    qs = ctx.og.shape(mm1.inputs[0])
    if qs is None or len(qs) != rank:
        raise Refused(f"Q '{mm1.inputs[0]}' has shape {qs}, not rank {rank}")
    heads = qs[1] if rank == 4 else 1
    m.q = _scaled(ctx, mm1.inputs[0], m)
    kt = _scaled(ctx, mm1.inputs[1], m)
    _k_operand(ctx, kt, rank, heads, m)
    m.v = mm2.inputs[1]
    if rank == 4:
        m.v = _repeat_kv(ctx, m.v, heads, m)
    # shapes: q [b, h, sq, d], k (read through k_perm) [b, hk, sk, d], v [b, hv, sk, dv]
    ks0, vs = ctx.og.shape(m.k), ctx.og.shape(m.v)
    if ks0 is None or vs is None or len(ks0) != rank or len(vs) != rank:
        raise Refused(f"K '{m.k}' / V '{m.v}' shapes {ks0} / {vs} are not rank {rank}")
    ks = tuple(ks0[i] for i in m.k_perm)
    qs = ctx.og.shape(m.q) or qs
    if ks[0] != qs[0] or vs[0] != qs[0]:
        raise Refused(f"batch of Q {list(qs)}, K {list(ks)}, V {list(vs)} differ (MatMul broadcasting over batch)")
    if ks[-1] != qs[-1] or vs[-2] != ks[-2]:
        raise Refused(f"Q {list(qs)}, K {list(ks)}, V {list(vs)} do not chain as attention")
    if rank == 4:
        for what, t in (("K", ks), ("V", vs)):
            if qs[1] % t[1]:
                raise Refused(f"{what} heads {t[1]} do not divide Q's {qs[1]}")
            if t[1] not in (qs[1], 1) and not any(n.op_type == "Expand" for n in m.nodes):
                raise Refused(f"{what} has {t[1]} heads against Q's {qs[1]} (MatMul broadcasting)")
    if not np.isfinite(m.scale):
        raise Refused(f"the scale {m.scale} is not finite")
    if m.mask:
        ms = ctx.og.shape(m.mask)
        if ms is None or len(ms) > rank or ctx.elem(m.mask) != elem:
            raise Refused(f"mask '{m.mask}' has shape {ms} / type {ctx.elem(m.mask)} (want rank <= {rank}, type {elem})")
        full = np.broadcast_shapes(tuple(ms), tuple(shape))
        if tuple(full) != tuple(shape):
            raise Refused(f"mask '{m.mask}' {list(ms)} broadcasts the scores {list(shape)} up to {list(full)}")
        c = ctx.og.constants.get(m.mask)
        if c is not None and _causal(c, tuple(shape)):
            m.causal, m.mask = True, ""
    if m.where is not None:
        _where_mask(ctx, m, tuple(shape), elem, sm.name)
    if window is not None:
        if not m.mask:
            m.mask = ctx.new_const(f"{sm.name}_window_mask", window)
        elif m.mask in ctx.og.constants:
            first = ctx.og.constants[m.mask]
            both = np.broadcast_to(first.astype(np.float64), shape) + window.astype(np.float64)
            m.mask = ctx.new_const(f"{sm.name}_window_mask", both.astype(first.dtype))
        else:
            raise Refused(f"the window mask follows a mask '{m.mask}' that is not constant")
    c = ctx.og.constants.get(m.mask) if m.mask else None
    if not m.mask or (c is not None and not bool(np.any(np.all(np.isneginf(c), axis=-1)))):
        m.guard = False  # no row can be fully masked: the guard never acts on finite inputs
    if why := ctx.excluded(m.nodes):
        raise Refused(why)
    return m


def fuse_attention(ctx: Ctx) -> int:
    count = 0
    gone: set[int] = set()
    for sm in list(ctx.og.nodes):
        if id(sm) in gone or sm.op_type != "Softmax" or not sm.is_default_domain:
            continue
        try:
            m = _match(ctx, sm)
        except Refused as exc:
            ctx.refuse(NAME, sm, exc.reason)
            continue
        if m is None:
            continue
        roles = {"q": m.q, "k": m.k, "v": m.v}
        if m.mask:
            roles["mask"] = m.mask
        rank = len(m.k_perm)
        attrs = {"scale": float(m.scale), "causal": int(m.causal), "guard": int(m.guard),
                 "k_perm": list(m.k_perm), "rank": rank}
        gone.update(id(n) for n in m.nodes)
        ctx.fuse("Attention", m.nodes, m.out, roles, attrs)
        ctx.refused.pop(sm.name, None)
        count += 1
    return count

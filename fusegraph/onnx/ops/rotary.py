"""ONNX Runtime's contrib ``RotaryEmbedding`` (com.microsoft), which its transformer
optimizer emits for RoPE models (LLaMA, Phi, GPT-NeoX), as graph ops.

The rotation angle of a token depends on its position, so the cos/sin rows are picked by
``position_ids`` at run time: a ``gather`` of the caches (folded at import when the ids
and caches are constants). A one-element ``position_ids`` is a start offset: positions
``start .. start + seq - 1``, a constant iota plus the offset. The rotation itself is
pointwise on the two halves of each head's first ``rotary_embedding_dim`` channels (or on
its even/odd channels, ``interleaved``); the rest of the head passes through.

What ONNX Runtime's CPU kernel does not define or fusegraph does not express is refused
with the reason: ragged packed batches (``is_packed_batching``), a ``scale`` other than 1
(the kernel never reads it), caches whose width is not ``rotary_embedding_dim / 2``.
Position ids fed from the host with constant caches are range-checked at ``run()``
(onnx/index_ranges.py: [0, rows), as ONNX Runtime requires); ids computed in the graph or
bound on the device are not, and there a negative one counts from the end of the caches
(the graph's gather rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import reshape
from fusegraph.onnx.ops.table import Unmappable, contrib, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode

OP = "RotaryEmbedding"


@dataclass(frozen=True)
class Rope:
    """The dims one RotaryEmbedding node works on."""

    bnsh: bool  # input is [batch, heads, seq, head] (else [batch, seq, heads * head])
    batch: int
    seq: int
    heads: int
    head: int
    rot: int  # channels rotated at the start of each head (even, <= head)
    interleaved: bool

    @property
    def half(self) -> int:
        return self.rot // 2


def _int_attr(node: ONode, name: str) -> int:
    return int(node.attr(name, 0))


def _geometry(imp: Importer, node: ONode) -> Rope:
    """Reads the attributes and dims as ONNX Runtime's kernel does; refuses the rest."""
    if _int_attr(node, "is_packed_batching"):
        raise Unmappable(f"{OP}: is_packed_batching=1 (ragged batches packed into one sequence) is not lowered")
    scale = float(node.attr("scale", 1.0))
    if scale != 1.0:
        raise Unmappable(f"{OP}: scale={scale} (the spec leaves it undefined; ONNX Runtime's CPU kernel ignores it)")
    interleaved = _int_attr(node, "interleaved")
    if interleaved not in (0, 1):
        raise Unmappable(f"{OP}: interleaved={interleaved} is not 0 or 1")
    names = [node.inputs[k] if k < len(node.inputs) else "" for k in range(4)]
    if not all(names):
        raise Unmappable(f"{OP}: needs input, position_ids, cos_cache and sin_cache (got {names})")
    xs, cs, ss = imp.shape(names[0]), imp.shape(names[2]), imp.shape(names[3])
    if len(cs) != 2 or cs != ss:
        raise Unmappable(f"{OP}: cos_cache {list(cs)} and sin_cache {list(ss)} are not one [max_position, rotary_dim / 2] shape")
    if len(xs) == 3:
        batch, seq, hidden = xs
    elif len(xs) == 4:
        batch, _, seq, _ = xs
        hidden = xs[1] * xs[3]
    else:
        raise Unmappable(f"{OP}: input {list(xs)} is neither [batch, seq, hidden] nor [batch, heads, seq, head]")
    rot_attr, heads_attr = _int_attr(node, "rotary_embedding_dim"), _int_attr(node, "num_heads")
    if rot_attr < 0 or heads_attr < 0:
        raise Unmappable(f"{OP}: rotary_embedding_dim={rot_attr} / num_heads={heads_attr} is negative")
    if rot_attr and not heads_attr:
        raise Unmappable(f"{OP}: rotary_embedding_dim={rot_attr} needs num_heads (ONNX Runtime refuses it too)")
    if rot_attr:
        if hidden % heads_attr:
            raise Unmappable(f"{OP}: hidden size {hidden} is not a multiple of num_heads={heads_attr}")
        head = hidden // heads_attr
    else:
        head = 2 * cs[1]
    heads = heads_attr or (hidden // head if hidden % head == 0 else 0)
    if heads * head != hidden or (len(xs) == 4 and (heads, head) != (xs[1], xs[3])):
        raise Unmappable(
            f"{OP}: input {list(xs)} does not split into num_heads={heads_attr or '?'} heads of "
            f"{head} channels (head size from {'the hidden size' if rot_attr else 'cos_cache width x 2'})"
        )
    rot = rot_attr or head
    if rot > head or rot % 2 or cs[1] != rot // 2:
        raise Unmappable(
            f"{OP}: rotary_embedding_dim {rot} with head size {head} needs even rot <= head and caches "
            f"[max_position, {rot // 2}], got {list(cs)}"
        )
    return Rope(len(xs) == 4, batch, seq, heads, head, rot, bool(interleaved))


def _is_offset(ids_dims: tuple[int, ...]) -> bool:
    """One start offset (a scalar or a one-element vector), as ONNX Runtime tells the forms."""
    return len(ids_dims) == 0 or tuple(ids_dims) == (1,)


def _position_ids(imp: Importer, name: str, r: Rope) -> np.ndarray | TensorAttr:
    """The positions as [batch or 1, seq]: a constant array where they are known at import,
    else a graph tensor (the ids input, or iota + the start offset)."""
    ps = imp.shape(name)
    offset = _is_offset(ps)
    if not offset and list(ps) != [r.batch, r.seq]:
        raise Unmappable(f"{OP}: position_ids {list(ps)} is neither one start offset nor [batch={r.batch}, seq={r.seq}]")
    dt = imp.dtype(name)
    if not dt.is_integer:
        raise Unmappable(f"{OP}: position_ids '{name}' is {dt.name}, not an integer type")
    iota = np.arange(r.seq, dtype=np.int64).reshape(1, r.seq)
    if imp.is_const(name):
        ids = imp.og.constants[name].astype(np.int64)
        return iota + int(ids.reshape(-1)[0]) if offset else ids.reshape(r.batch, r.seq)
    ids_t = imp.tensor(name, "plain")
    if not offset:
        return ids_t
    start = reshape(imp, ids_t, (1, 1))
    return imp.g.add(imp.constant(iota.astype(dt.numpy), "rotary_iota", "plain"), start)


def _rows(imp: Importer, cache: str, ids: np.ndarray | TensorAttr, what: str) -> TensorAttr:
    """``cache[ids]``: [batch or 1, seq, rot / 2]."""
    if isinstance(ids, np.ndarray) and imp.is_const(cache):
        table = imp.og.constants[cache]
        if ids.min() < -table.shape[0] or ids.max() >= table.shape[0]:
            raise Unmappable(
                f"{OP}: position ids {int(ids.min())}..{int(ids.max())} fall outside {what} "
                f"({table.shape[0]} positions)"
            )
        return imp.constant(np.ascontiguousarray(table[ids]), f"{cache}_rows", "plain")
    idx = imp.constant(ids, "rotary_positions", "plain") if isinstance(ids, np.ndarray) else ids
    return imp.g.gather(imp.tensor(cache, "plain"), idx, axis=0)


@lowers(contrib(OP))
def lower_contrib_rotary(imp: Importer, node: ONode) -> None:
    """ONNX Runtime's contrib op: (input, position_ids, cos_cache, sin_cache)."""
    r = _geometry(imp, node)
    ids = _position_ids(imp, node.inputs[1], r)
    cos, sin = _rows(imp, node.inputs[2], ids, "cos_cache"), _rows(imp, node.inputs[3], ids, "sin_cache")
    rows = 1 if _is_offset(imp.shape(node.inputs[1])) else r.batch
    _rotate(imp, node, r, cos, sin, rows)


@lowers(OP)
def lower_rotary(imp: Importer, node: ONode) -> None:
    """The default domain's op (opset 23): (X, cos_cache, sin_cache, position_ids?). With
    position ids the caches are [max_position, rotary_dim / 2] tables, as the contrib op's;
    without, they are the rows already, [batch, seq, rotary_dim / 2]."""
    r = _geometry23(imp, node)
    pos = node.inputs[3] if len(node.inputs) > 3 else ""
    if pos:
        ps = imp.shape(pos)
        if list(ps) != [r.batch, r.seq]:
            raise Unmappable(f"{OP}: position_ids {list(ps)} is not [batch={r.batch}, seq={r.seq}]")
        ids = _position_ids(imp, pos, r)
        cos, sin = _rows(imp, node.inputs[1], ids, "cos_cache"), _rows(imp, node.inputs[2], ids, "sin_cache")
        rows = r.batch
    else:
        cos, sin = imp.tensor(node.inputs[1], "plain"), imp.tensor(node.inputs[2], "plain")
        rows = imp.shape(node.inputs[1])[0]
    _rotate(imp, node, r, cos, sin, rows)


def _geometry23(imp: Importer, node: ONode) -> Rope:
    """The opset-23 op's dims, as its reference implementation reads them; refuses the rest."""
    interleaved = _int_attr(node, "interleaved")
    if interleaved not in (0, 1):
        raise Unmappable(f"{OP}: interleaved={interleaved} is not 0 or 1")
    names = [node.inputs[k] if k < len(node.inputs) else "" for k in range(4)]
    if not all(names[:3]):
        raise Unmappable(f"{OP}: needs X, cos_cache and sin_cache (got {names[:3]})")
    xs, cs, ss = imp.shape(names[0]), imp.shape(names[1]), imp.shape(names[2])
    heads_attr, rot_attr = _int_attr(node, "num_heads"), _int_attr(node, "rotary_embedding_dim")
    if heads_attr < 0 or rot_attr < 0:
        raise Unmappable(f"{OP}: rotary_embedding_dim={rot_attr} / num_heads={heads_attr} is negative")
    if len(xs) == 4:
        batch, heads, seq, head = xs
    elif len(xs) == 3:
        batch, seq, hidden = xs
        if not heads_attr or hidden % heads_attr:
            raise Unmappable(f"{OP}: a [batch, seq, hidden] input {list(xs)} needs num_heads dividing the hidden size "
                             f"(got num_heads={heads_attr})")
        heads, head = heads_attr, hidden // heads_attr
    else:
        raise Unmappable(f"{OP}: X {list(xs)} is neither [batch, seq, hidden] nor [batch, heads, seq, head]")
    rot = rot_attr or head
    want = 2 if names[3] else 3
    if cs != ss or len(cs) != want or cs[-1] != rot // 2 or rot > head or rot % 2:
        form = "[max_position, rotary_dim / 2]" if names[3] else "[batch, seq, rotary_dim / 2]"
        raise Unmappable(f"{OP}: cos_cache {list(cs)} / sin_cache {list(ss)} are not {form} for rotary_dim {rot} "
                         f"(head size {head})")
    if not names[3] and (cs[1] != seq or cs[0] not in (1, batch)):
        raise Unmappable(f"{OP}: caches {list(cs)} do not match batch {batch} and seq {seq}")
    return Rope(len(xs) == 4, batch, seq, heads, head, rot, bool(interleaved))


def _rotate(imp: Importer, node: ONode, r: Rope, cos: TensorAttr, sin: TensorAttr, rows: int) -> None:
    """x1, x2 = the halves (or even/odd channels) of the rotated part of each head;
    out = [x1 cos - x2 sin, x1 sin + x2 cos] (re-interleaved), then the unrotated rest.
    ``cos`` / ``sin``: the rows for each position, [rows, seq, rot / 2] (rows 1 or batch)."""
    x = imp.tensor(node.inputs[0], "plain")
    if r.bnsh:  # [b, n, s, h]; the cache rows broadcast over heads
        x4, by, lead = x, (rows, 1, r.seq, r.half), [r.batch, r.heads, r.seq]
    else:
        x4, by = reshape(imp, x, (r.batch, r.seq, r.heads, r.head)), (rows, r.seq, 1, r.half)
        lead = [r.batch, r.seq, r.heads]
    c4, s4 = reshape(imp, cos, by), reshape(imp, sin, by)
    if r.interleaved:
        x1 = imp.g.slice(x4, [0], [r.rot], [2], axes=[3])
        x2 = imp.g.slice(x4, [1], [r.rot], [2], axes=[3])
    else:
        x1 = imp.g.slice(x4, [0], [r.half], [1], axes=[3])
        x2 = imp.g.slice(x4, [r.half], [r.rot], [1], axes=[3])
    g = imp.g
    real = g.sub(g.mul(x1, c4), g.mul(x2, s4))
    imag = g.add(g.mul(x1, s4), g.mul(x2, c4))
    if r.interleaved:  # [.., half] pairs -> [.., half, 2] -> [.., rot]: real at even channels
        pair = [*lead, r.half, 1]
        both = g.concatenate([g.reshape(real, pair), g.reshape(imag, pair)], axis=4)
        parts = [g.reshape(both, [*lead, r.rot])]
    else:
        parts = [real, imag]
    if r.rot < r.head:
        parts.append(g.slice(x4, [r.rot], [r.head], [1], axes=[3]))
    y = g.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]
    if not r.bnsh:
        y = reshape(imp, y, (r.batch, r.seq, r.heads * r.head))
    for n in reversed(g.nodes):  # the report's fusion counts
        if any(o is y for o in n.outputs.values()):
            n.meta["pattern"] = "rotary.embedding"
            break
    imp.set(node.outputs[0], y)

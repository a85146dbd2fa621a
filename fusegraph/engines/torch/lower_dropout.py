"""fusegraph's attention dropout mask (reference/dropout.py) computed by torch on the plan's
device: Philox4x32-10 in int64 tensor arithmetic, bit for bit the reference's stream.

torch has no unsigned 64-bit arithmetic on every device, so each 32 x 32-bit product is
formed from 16-bit halves, every partial product below 2**49 and so exact in int64. The
seed and offset stay tensors (no ``.item()``): a traced or compiled plan reads each call's
values rather than baking in the first.
"""

from __future__ import annotations

import math

from fusegraph.engines.torch.convert import Tensor, _torch
from fusegraph.reference.dropout import MASK32, PHILOX_M, PHILOX_W, ROUNDS, threshold

_LOW16 = 0xFFFF


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * m, for a in [0, 2**32) and a 32-bit constant m."""
    t = a * (m & _LOW16)
    u = a * (m >> 16) + (t >> 16)
    return u >> 16, ((u & _LOW16) << 16) | (t & _LOW16)


def _words(value: Tensor) -> tuple[Tensor, Tensor]:
    """The low and high 32-bit words of a one-element int64 tensor, as int64 tensors."""
    v = value.reshape(()).to(_torch().int64)
    return v & MASK32, (v >> 32) & MASK32


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_mask(shape: tuple[int, ...], probability: float, seed: Tensor, offset: Tensor) -> Tensor:
    """Boolean keep mask of logical ``shape`` [b, h, s_q, s_kv], on ``seed``'s device."""
    torch = _torch()
    total = math.prod(shape)
    blocks = torch.arange((total + 3) // 4, dtype=torch.int64, device=seed.device)
    o_lo, o_hi = _words(offset)
    s_lo, s_hi = _words(seed)
    words = philox4x32(
        (blocks & MASK32, blocks >> 32, o_lo.expand_as(blocks), o_hi.expand_as(blocks)), (s_lo, s_hi)
    )
    stream = torch.stack(words, dim=1).reshape(-1)[:total]
    return (stream >= threshold(probability)).reshape(shape)

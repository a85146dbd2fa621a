"""The dropout mask of attention: fusegraph's definition, which every engine matches or refuses.

cuDNN draws its attention dropout from Philox with a seed and an offset, but where each
element's number comes from is not published, so no engine can be checked against it.
fusegraph fixes its own stream, from public definitions only:

* the generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
  3", SC 2011): a 128-bit counter and a 64-bit key, ten rounds with the multipliers
  0xD2511F53, 0xCD9E8D57 and the key increments 0x9E3779B9, 0xBB67AE85;
* the key is the seed (an int64, read as its 64 bits: low word first); the counter's two
  high words are the offset (likewise), its two low words the block index;
* the element at logical position (b, h, i, j) of the [batch, q heads, s_q, s_kv]
  probability tensor has the row-major index n = ((b * H + h) * S_q + i) * S_kv + j; its
  number is word n % 4 of the block n // 4 (each Philox call gives four 32-bit words);
* the element is kept when word >= ceil(p * 2**32) (so dropped with probability p, up to
  2**-32), and a kept probability is scaled by 1 / (1 - p).

Consecutive calls of a training loop pass a new offset (or seed); the forward and the
backward of one step pass the same pair and so see one mask.
"""

from __future__ import annotations

import math

import numpy as np

MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of counters given as four uint64 arrays of 32-bit words (one block per
    element), under one 64-bit key; four uint64 arrays of the output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & np.uint64(MASK32) for c in counter)
    k0, k1 = key[0] & MASK32, key[1] & MASK32
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        p0, p1 = c0 * m0, c2 * m1  # exact: both factors < 2**32
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(MASK32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return c0, c1, c2, c3


def threshold(probability: float) -> int:
    """The smallest kept 32-bit word: ceil(p * 2**32), exact in float64 (a power-of-two scale)."""
    return math.ceil(probability * 2.0**32)


def as_u64(value: int) -> int:
    """An int64 seed or offset as its 64 bits."""
    return int(value) & 0xFFFFFFFFFFFFFFFF


def keep_mask(shape: tuple[int, ...], probability: float, seed: int, offset: int) -> np.ndarray:
    """Boolean keep mask of the given logical [b, h, s_q, s_kv] shape (see the module doc)."""
    total = math.prod(shape)
    blocks = np.arange((total + 3) // 4, dtype=np.uint64)
    s, o = as_u64(seed), as_u64(offset)
    words = philox4x32(
        (blocks & np.uint64(MASK32), blocks >> np.uint64(32),
         np.full_like(blocks, o & MASK32), np.full_like(blocks, o >> 32)),
        (s & MASK32, s >> 32),
    )
    stream = np.stack(words, axis=1).reshape(-1)[:total]  # block-major, word-minor: index n
    return (stream >= np.uint64(threshold(probability))).reshape(shape)

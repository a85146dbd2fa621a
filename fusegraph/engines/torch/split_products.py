"""float32 matmuls as three bfloat16 tensor-core products ("bf16x3"), the torch engine's
``fp32_matmul="bf16x3"`` knob.

Why: on NVIDIA GPUs a float32 GEMM runs on CUDA cores (or, with TF32, on tensor cores
with a 10-bit mantissa: 2.5e-4 relative error), while bfloat16 GEMMs run on tensor cores
several times faster. Each float32 operand x splits exactly enough into hi = bf16(x) and
lo = bf16(x - hi) that a @ b ~= ah @ bh + ah @ bl + al @ bh, and the three products are
ONE bf16 GEMM over a 3K-long inner dimension with float32 output (aten's ``mm.dtype`` /
``bmm.dtype``, CUDA only): [ah, ah, al] ([M, 3K]) @ [bh; bl; bh] ([3K, N]). On an H200
(torch 2.11, split included) it gave 1.4-2.2x cuBLAS float32 on ViT-B/16's batch-8 GEMMs
and lost on small or narrow ones (0.70x at 197 x 768 x 3072, 0.95x at 1576 x 768 x 768),
so it is a measured choice (the ONNX door's region layer times it against PyTorch),
never assumed. PyTorch names the same idea for ``set_float32_matmul_precision("high")``.

Error bound (elementwise, u = 2**-8 the bf16 unit roundoff, operands finite, no
underflow): x - hi is exact in float32 and |x - hi - lo| <= u**2 |x|, so the three
products leave out ah rb + ra bh + da db with |.| <= (3 + 2u) u**2 |a| |b|; the kept
products of 8-bit significands are exact in float32 and their 3K-term float32 sum adds at
most gamma_3K (1 + u)**2 (1 + 2u) |a| |b|, gamma_n = n v / (1 - n v) with v = 2**-23 (tensor
cores add with truncation, not rounding to nearest: twice float32's 2**-24). So

    |C - A B| <= ((3 + 2u) u**2 + 1.03 gamma_3K) (|A| |B|)    (bound(k) below)

-- 4.6e-5 plus the float32 summation term (cuBLAS float32's own is about gamma_K), against
TF32's ~2**-11. On random data it is far below: 4e-6..1.4e-5 of max |C| on the H200.
Caveats: an infinite operand becomes NaN (inf - inf in the low half); values within
2**-118 of zero lose the low half to bf16's subnormals (an absolute error of ~2**-126 |b|).

One idea per module: the split, the 3K-long product, the shapes the torch lowering hands
it, and whether the CUDA kernels exist. The product is a parameter (``mm``), so the CPU
tests run this same split against float64 with an emulated bf16 GEMM.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from fusegraph.engines.torch.convert import Tensor, _torch

log = logging.getLogger("fusegraph.engines.torch")

IEEE = "ieee"
BF16X3 = "bf16x3"
CHOICES = (IEEE, BF16X3)
U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)

# A bf16 product over the stacked operands ([..., M, 3K] @ [..., 3K, N]) with float32 output.
Product = Callable[[Tensor, Tensor], Tensor]


def bound(k: int) -> float:
    """The elementwise bound's factor: |C - AB| <= bound(k) * (|A| |B|) for a K = k product."""
    n = 3 * k * 2.0**-23
    return (3 + 2 * U_BF16) * U_BF16**2 + 1.03 * n / (1 - n)


def stacked(x: Tensor, dim: int, lo_at: int, *, functional: bool = False) -> Tensor:
    """``x`` (float32) as its bf16 halves concatenated along ``dim``: [hi, hi, lo]
    (``lo_at=2``, the left operand) or [hi, lo, hi] (``lo_at=1``, the right one).
    ``functional`` (traced plans: Inductor fuses it) concatenates; eagerly the halves are
    written into one buffer (three kernels, no float32 temporaries)."""
    torch = _torch()
    if functional:
        # hi rounded by its bits, not by x.to(bf16).to(float32): Inductor drops such a round
        # trip inside a fused kernel (emulate_precision_casts is off by default), which left
        # lo = 0 -- one bf16 product, 2e-3 relative (seen on the CPU)
        bits = x.view(torch.int32)
        hi32 = ((bits + ((bits >> 16) & 1) + 0x7FFF) & -65536).view(torch.float32)  # round to nearest even
        hi = hi32.to(torch.bfloat16)  # exact
        lo = torch.sub(x, hi32).to(torch.bfloat16)  # x - hi: exact in float32
        return torch.cat((hi, hi, lo) if lo_at == 2 else (hi, lo, hi), dim=dim)
    shape = list(x.shape)
    k = shape[dim]
    shape[dim] = 3 * k
    out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    parts = out.split(k, dim=dim)
    hi = parts[0]
    hi.copy_(x)
    torch.sub(x, hi, out=parts[lo_at])  # computed in float32, rounded once into bf16
    parts[3 - lo_at].copy_(hi)
    return out


def split_matmul(a: Tensor, b: Tensor, mm: Product, *, functional: bool = False) -> Tensor:
    """a [..., M, K] @ b [..., K, N] (float32, equal batch dims) as one product of the
    stacked halves."""
    return mm(stacked(a, -1, 2, functional=functional), stacked(b, -2, 1, functional=functional))


def cuda_product(a3: Tensor, b3: Tensor) -> Tensor:
    """The stacked product on CUDA: cuBLAS bf16 tensor cores, float32 accumulate and output."""
    torch = _torch()
    if a3.dim() == 2:
        return torch.mm(a3, b3, out_dtype=torch.float32)
    return torch.bmm(a3, b3, out_dtype=torch.float32)


@functools.cache
def kernel_available(device: str, op: str) -> bool:
    """Whether ``torch.<op>(bf16, bf16, out_dtype=float32)`` runs on ``device`` (``mm`` or
    ``bmm``): tried once on 2 x 2 operands (the dtype overloads came with torch 2.8 and
    have CUDA kernels only)."""
    torch = _torch()
    fn = getattr(torch, op)
    shape = (2, 2) if op == "mm" else (1, 2, 2)
    try:
        x = torch.ones(shape, dtype=torch.bfloat16, device=device)
        ok = fn(x, x, out_dtype=torch.float32).dtype == torch.float32
    except Exception as exc:  # no overload, no kernel for the device, an old torch
        log.info("no %s(bf16, bf16, out_dtype=float32) on %s: %s: %s", op, device, type(exc).__name__, exc)
        return False
    return bool(ok)


def batched(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether a matmul of these shapes is a true batched one (``lowered`` needs the bmm
    kernel for it): not 2-D, and not one weight for every batch."""
    if len(a) == 2 and len(b) == 2:
        return False
    return not (len(a) >= 3 and all(d == 1 for d in b[:-2]))


def lowered(a: Tensor, b: Tensor, *, functional: bool, bmm: bool, mm: Product | None = None) -> Tensor | None:
    """The torch lowering's float32 matmul (a [..., M, K] @ b [..., K, N], broadcast batch
    dims) split; None where it stays float32 (a true batched matmul without ``bmm``, the
    bmm kernel). One weight for every batch ([..., M, K] @ [K, N] or [1, K, N]) is one
    2-D product of the flattened rows, as the float32 lowering runs it. ``mm`` defaults to
    ``cuda_product`` (looked up at the call: the CPU tests put an emulation in its place)."""
    torch = _torch()
    mm = mm or cuda_product
    k, n = b.shape[-2], b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return split_matmul(a, b, mm, functional=functional)
    if not batched(tuple(a.shape), tuple(b.shape)):
        out = split_matmul(a.reshape(-1, k), b.reshape(k, n), mm, functional=functional)
        return out.reshape(*a.shape[:-1], n)
    if not bmm:
        return None
    m = a.shape[-2]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    # split before broadcasting: each stored operand is split once
    a3 = stacked(a, -1, 2, functional=functional).expand(*batch, m, 3 * k).reshape(-1, m, 3 * k)
    b3 = stacked(b, -2, 1, functional=functional).expand(*batch, 3 * k, n).reshape(-1, 3 * k, n)
    return mm(a3, b3).reshape(*batch, m, n)


def describe_fallback(node_name: str, device: Any) -> str:
    """The log line of a batched matmul that stays float32."""
    return (f"fp32_matmul=bf16x3: matmul '{node_name}' is batched and torch.bmm(out_dtype=float32) "
            f"does not run on {device}: it stays float32 (ieee)")


__all__ = ["BF16X3", "CHOICES", "IEEE", "batched", "bound", "cuda_product", "kernel_available", "lowered", "split_matmul",
           "stacked"]

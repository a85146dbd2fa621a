"""The values a region unit passes between its steps: torch tensors laid out as a step's
graph declares (``laid_out``, ``to_device``, ``to_device_all``), in the model's declared type (``declared``),
and compared where they are (``rel_err``, the trial run's measure against PyTorch)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fusegraph.onnx.units import to_host


def laid_out(execute: Callable[[dict[str, Any]], Any], declared: Sequence[Any],
              keys: Sequence[str]) -> Callable[[dict[str, Any]], Any]:
    """``execute`` given its activations in the layouts its graph declares: a piece run op by
    op may hand on a view (Swin-T's Transpose gave a channels-last-strided [8, 768, 7, 7] to a
    region declaring it dense), and kernel plans read the declared layout only. A copy where
    the strides differ, nothing where they match. Not for torch engine plans, which take a
    view as it is (copying every transposed head before ViT-B/16's attention cost 1.4 ms of
    its 3.8 on an H200)."""
    from fusegraph.engines.torch.compiled import as_declared
    from fusegraph.graph import layout

    fixed = [(k, t, tuple(t.strides)) for k, t in zip(keys, declared, strict=True)
             if not layout.self_overlapping(t.shape, t.strides)]

    def run(pack: dict[str, Any]) -> Any:
        for k, t, strides in fixed:
            pack[k] = as_declared(t, pack[k], strides)
        return execute(pack)

    return run


def declared(value: Any, t: Any) -> Any:
    """A torch tensor in the declared type of the unit's tensor ``t`` (cast where a reduced
    region produced it)."""
    from fusegraph.engines.torch.convert import torch_dtype

    want = torch_dtype(t.dtype)
    return value if value.dtype == want else value.to(want)


def rel_err(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64; inf for a wrong shape or a non-finite value.
    Torch tensors are compared where they are (on a GPU: no copy to the host, which cost a
    cold GPT-style decoder 2.2 s of its setup on an H200)."""
    if type(got).__module__.startswith("torch") and type(want).__module__.startswith("torch"):
        import torch

        if tuple(got.shape) != tuple(want.shape) or got.device != want.device:
            return float("inf")
        g64, w64 = got.detach().to(torch.float64), want.detach().to(torch.float64)
        if not bool(torch.isfinite(g64).all()):
            return float("inf")
        num, den = torch.linalg.vector_norm(g64 - w64), torch.linalg.vector_norm(w64)
        return float(num / torch.clamp(den, min=1e-30))
    g = np.asarray(to_host(got), dtype=np.float64)
    w = np.asarray(to_host(want), dtype=np.float64)
    if g.shape != w.shape or not np.isfinite(g).all():
        return float("inf")
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _host(value: Any) -> Any:
    """``value`` (an array of the model) as a CPU torch tensor over the same bytes."""
    import torch

    arr = to_host(value)
    if not isinstance(arr, np.ndarray):
        arr = np.asarray(arr)
    if str(arr.dtype) == "bfloat16":  # NumPy has no bfloat16 of its own: through its bits
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # only read, by the copy that follows: no copy of its own (a weight over the model's bytes)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _placed(value: Any, t: Any, device: Any, dtype: Any) -> bool:
    import torch

    return (isinstance(value, torch.Tensor) and value.device == device and value.dtype == dtype
            and tuple(value.stride()) == tuple(t.strides))


def to_device(value: Any, t: Any, device: Any) -> Any:
    """``value`` as a torch tensor on ``device`` with ``t``'s dtype and strides (no copy where
    it already is one)."""
    import torch

    from fusegraph.engines.torch.convert import torch_dtype

    dtype = torch_dtype(t.dtype)
    if _placed(value, t, device, dtype):
        return value
    out = torch.empty_strided(t.shape, t.strides, dtype=dtype, device=device)
    out.copy_(value if isinstance(value, torch.Tensor) else _host(value))
    return out


def random_laid_out(t: Any, device: Any, gen: Any = None) -> Any:
    """A tensor of ``t``'s shape, strides and type on ``device``: N(0, 1) where it is
    floating, zeros else -- the activations regions are tried, measured and captured on."""
    import torch

    from fusegraph.engines.torch.convert import torch_dtype

    x = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(t.dtype), device=device)
    return x.normal_(generator=gen) if x.is_floating_point() else x.zero_()


ALIGN = 512  # bytes between weights in one block: where the caching allocator starts a block


def to_device_all(items: Mapping[str, tuple[Any, Any]], device: Any, *, pooled: bool | None = None) -> dict[str, Any]:
    """Each ``name -> (value, tensor)`` as ``to_device`` gives it, the GPU copies carved from
    one allocation: a new process's caching allocator holds nothing yet, so each weight on its
    own is a ``cudaMalloc`` (ViT-B/16's 225 weights took ~0.27 s of a warm open on an H200).
    The weights of a unit live as long as the unit, so one block costs no memory they would
    not hold anyway. ``pooled``: carve one block (default: on a GPU only)."""
    import torch

    from fusegraph.engines.torch.convert import torch_dtype

    if not (getattr(device, "type", "cpu") == "cuda" if pooled is None else pooled):
        return {k: to_device(v, t, device) for k, (v, t) in items.items()}
    out: dict[str, Any] = {}
    carve: list[tuple[str, Any, Any, Any, int, int]] = []  # name, value, tensor, dtype, offset, bytes
    total = 0
    for name, (value, t) in items.items():
        dtype = torch_dtype(t.dtype)
        if _placed(value, t, device, dtype):
            out[name] = value
            continue
        span = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.strides, strict=True)) if all(t.shape) else 0
        if span <= 0:
            out[name] = to_device(value, t, device)
            continue
        nbytes = span * dtype.itemsize
        carve.append((name, value, t, dtype, total, nbytes))
        total += -(-nbytes // ALIGN) * ALIGN
    if carve:
        block = torch.empty(total, dtype=torch.uint8, device=device)
        for name, value, t, dtype, offset, nbytes in carve:
            dst = block[offset:offset + nbytes].view(dtype).as_strided(t.shape, t.strides)
            dst.copy_(value if isinstance(value, torch.Tensor) else _host(value))
            out[name] = dst
    return {k: out[k] for k in items}


__all__ = ["declared", "laid_out", "random_laid_out", "rel_err", "to_device", "to_device_all"]

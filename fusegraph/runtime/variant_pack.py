"""Checks a variant pack (tensor -> array) against a validated graph: the one input contract.

Every engine accepts the same values for a tensor declared with given dims and strides:
NumPy arrays (writable or read-only), torch tensors on the host, anything NumPy or DLPack can
view. Shape and dtype must match exactly. An input whose strides differ from the declared
ones (a broadcast view, a transposed or sliced view: any strides addressing the declared
elements) is copied into the declared layout here, so no engine sees it. An input may read
memory more than once (a broadcast or sliding-window view, as cuDNN allows); it may not
address memory outside the array it views. Outputs the caller gives must match the declared
strides (they are written in place, through those strides: a slice of a larger buffer is
fine), be writable, and share no memory with an input or another output.
Mismatches raise VariantPackError naming the tensor. ``outputs_like`` hands returned outputs
back as the type of the inputs (torch tensors in, torch tensors out).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from fusegraph.errors import VariantPackError
from fusegraph.graph import layout
from fusegraph.graph.tensor import TensorAttr


@dataclass
class ResolvedPack:
    inputs: dict[str, Any]  # graph input name -> array (or device buffer)
    outputs: dict[str, Any]  # output name -> caller's array to write, when given
    overridden: bool = False  # a bound constant (ExecutionPlan.bind_constants) came as another object


def _key_name(graph: Any, key: Any) -> TensorAttr:
    if isinstance(key, TensorAttr):
        if not key.belongs_to(graph):
            raise VariantPackError("tensor belongs to another graph", tensor=key.name)
        return key
    if isinstance(key, str):
        try:
            return graph.tensor_by_name(key)  # type: ignore[no-any-return]
        except KeyError:
            raise VariantPackError("no tensor of this name in the graph", tensor=key) from None
    raise VariantPackError(f"variant pack keys must be TensorAttr or names, got {type(key).__name__}")


def host_view(value: Any) -> np.ndarray | None:
    """A NumPy view of ``value`` without a copy where possible (None: not array-like)."""
    if isinstance(value, np.ndarray):
        return value
    if _is_torch(value):
        t = value.detach()
        if t.device.type != "cpu":
            return None
        arr: np.ndarray = t.resolve_conj().resolve_neg().numpy()
        return arr
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        return np.asarray(value)
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError):
            return None
    return None


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def check_array(t: TensorAttr, value: Any, *, what: str, strides: bool = True) -> np.ndarray:
    """``value`` as a NumPy array matching ``t``; an input in another layout is copied into
    the declared one; ``strides=False`` accepts any memory order (for an engine that lays host
    arrays out itself)."""
    arr = host_view(value)
    if arr is None:
        where = f" on {value.device}" if _is_torch(value) else ""
        raise VariantPackError(
            f"{what} must be a numpy array, a host tensor or a fusegraph Buffer, got {type(value).__name__}{where}",
            tensor=t.name,
        )
    if tuple(arr.shape) != t.shape:
        raise VariantPackError(f"{what} has shape {list(arr.shape)}, expected dims {t.dim}", tensor=t.name)
    if arr.dtype != t.dtype.numpy:
        raise VariantPackError(f"{what} has dtype {arr.dtype}, expected {t.dtype.name} ({t.dtype.numpy})", tensor=t.name)
    _check_within_base(t, arr, what)
    have = layout.element_strides(arr.shape, arr.strides, arr.itemsize)
    if not strides and not layout.self_overlapping(t.shape, t.strides):
        # what the engine can view as is (torch takes no negative strides), else a copy; a
        # tensor declared broadcast or overlapping is laid out as declared (below), where
        # a differently strided array is checked against the memory it claims to share
        return arr if have is not None and min(have, default=0) >= 0 else np.ascontiguousarray(arr)
    if have is not None and layout.same_strides(t.shape, have, t.strides):
        return arr
    if what == "input":  # any view of the declared elements: laid out as declared, here
        dense = layout.empty_strided(t.shape, t.strides, arr.dtype)
        dense[...] = arr
        if layout.self_overlapping(t.shape, t.strides) and not _same_bytes(dense, arr):
            raise VariantPackError(
                f"the tensor declares strides {t.stride}, which read some memory more than once "
                f"(a broadcast or overlapping view), but the {what} array (strides "
                f"{list(have) if have else arr.strides}) holds different values where those reads "
                "meet; pass the view itself (np.broadcast_to, np.lib.stride_tricks.as_strided, "
                "torch's expand) or declare the array's strides",
                tensor=t.name,
            )
        return dense
    raise VariantPackError(
        f"{what} has element strides {list(have) if have else arr.strides}, but the tensor "
        f"declares strides {t.stride}; an output is written in place, so pass an array in that "
        "layout (e.g. fusegraph.graph.layout.empty_strided) or declare its strides",
        tensor=t.name,
    )


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _memory_owner(arr: np.ndarray) -> tuple[int, int] | None:
    """Byte bounds of the memory that ``arr`` ultimately views, or None when unknown."""
    root: Any = arr
    for _ in range(64):
        nxt = getattr(root, "base", None)
        if nxt is None or isinstance(nxt, type):
            break
        root = nxt
    if isinstance(root, np.ndarray):
        return byte_bounds(root)  # type: ignore[no-any-return]
    try:  # bytes, bytearray, mmap, memoryview: anything with the buffer protocol
        return byte_bounds(np.frombuffer(root, np.uint8))  # type: ignore[no-any-return]
    except (TypeError, ValueError, BufferError, AttributeError):
        return None


def _check_within_base(t: TensorAttr, arr: np.ndarray, what: str) -> None:
    """A view built with as_strided can reach past the memory it views: reading it returns
    foreign heap bytes (or crashes), writing it corrupts the heap."""
    if arr.flags.owndata or arr.size == 0 or arr.base is None:
        return
    owner = _memory_owner(arr)
    if owner is None:
        return
    lo, hi = byte_bounds(arr)
    if lo < owner[0] or hi > owner[1]:
        raise VariantPackError(
            f"the {what} array's strides {list(arr.strides)} (bytes) over shape {list(arr.shape)} "
            f"address bytes {lo - owner[0]}..{hi - owner[0]} of a buffer of {owner[1] - owner[0]} bytes: "
            "the view reaches outside the memory it views",
            tensor=t.name,
        )


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    if not np.may_share_memory(a, b):  # bounds only: cheap, and enough for most packs
        return False
    try:  # exact: a slice of a packed QKV buffer may interleave with another slice of it
        return bool(np.shares_memory(a, b, max_work=100_000))  # type: ignore[arg-type]  # numpy takes a positive limit; its stubs list only -1 and 0
    except np.exceptions.TooHardError:
        return True


def _host_memory(value: Any) -> np.ndarray | None:
    """A view of the host memory of a NumPy array or CPU torch tensor (never a copy: a
    device Buffer or anything else converted would only cost a transfer)."""
    if isinstance(value, np.ndarray):
        return value
    if _is_torch(value) and value.device.type == "cpu":
        return host_view(value)
    return None


def check_no_alias(outputs: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Output arrays may share memory with no input and no other output: engines read
    inputs and write outputs in any order (and IREE aliases host inputs), so an in-place
    pack would be silently wrong on some engine. Values that are not host arrays (device
    Buffers) are skipped."""
    outs = [(n, a) for n, v in outputs.items() if (a := _host_memory(v)) is not None]
    if not outs:
        return
    ins = [(n, a) for n, v in inputs.items() if (a := _host_memory(v)) is not None]
    for i, (name, arr) in enumerate(outs):
        for other, src in ins:
            if _shares(arr, src):
                raise VariantPackError(
                    f"output array shares memory with input '{other}'; pass a separate array (an "
                    "output may be a strided view into a larger buffer, but not into memory the "
                    "graph reads)",
                    tensor=name,
                )
        for other, dst in outs[i + 1:]:
            if _shares(arr, dst):
                raise VariantPackError(f"output array shares memory with output '{other}'", tensor=name)


def outputs_like(outputs: dict[str, Any], inputs: Any) -> dict[str, Any]:
    """Returned NumPy outputs as torch tensors when any input was one (the type that went in)."""
    if not outputs or not any(_is_torch(v) for v in inputs):
        return outputs
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v for k, v in outputs.items()}


def resolve_pack(graph: Any, variant_pack: Mapping[Any, Any], *, check: Any = check_array) -> ResolvedPack:
    """Maps the pack onto graph inputs/outputs; ``check`` validates each value."""
    if not isinstance(variant_pack, Mapping):
        raise VariantPackError(f"the variant pack must be a mapping, got {type(variant_pack).__name__}")
    inputs = {t.name: t for t in graph.inputs()}
    outputs = {t.name: t for t in graph.outputs()}
    res = ResolvedPack({}, {})
    given_inputs: dict[str, Any] = {}
    for key, value in variant_pack.items():
        t = _key_name(graph, key)
        if t.name in inputs:
            res.inputs[t.name] = check(t, value, what="input")
            given_inputs[t.name] = value
        elif t.name in outputs:
            arr = check(t, value, what="output")
            if isinstance(arr, np.ndarray) and not arr.flags.writeable:
                raise VariantPackError("output array is read-only", tensor=t.name)
            res.outputs[t.name] = arr
        elif t.is_scalar:
            raise VariantPackError("scalar constants are inlined in the graph; do not pass them", tensor=t.name)
        elif t.is_virtual:
            raise VariantPackError("virtual (intermediate) tensor has no buffer; mark it set_output(True) to read it", tensor=t.name)
        else:
            raise VariantPackError("tensor is not read by any node; nothing takes this array", tensor=t.name)
    missing = [n for n in inputs if n not in res.inputs]
    if missing:
        raise VariantPackError(f"missing input(s) {missing}", tensor=missing[0])
    if res.outputs:
        check_no_alias(res.outputs, given_inputs)
    return res

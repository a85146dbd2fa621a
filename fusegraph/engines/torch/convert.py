"""Values across the torch boundary: fusegraph dtypes as torch dtypes, NumPy arrays and
fusegraph Buffers (IREE device memory, through DLPack) as torch tensors and back, without
copies where the layouts allow.

Why a module of its own: the engine, the lowerings and the plan all cross this boundary, and
none of it may import torch before a torch plan is asked for (issue 10): torch's version
is read from its files, its module imported on first use.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.engines.base import Support
from fusegraph.graph import layout
from fusegraph.graph.tensor import TensorAttr
from fusegraph.runtime.handle import Handle

Tensor = Any  # torch.Tensor, kept untyped so that this module imports without torch

_LOW = {DataType.HALF, DataType.BFLOAT16}
_FP8 = {DataType.FP8_E4M3, DataType.FP8_E5M2}


def _torch() -> Any:
    import torch

    return torch


@functools.cache
def torch_build_info() -> dict[str, str | None]:
    """``__version__``, ``cuda`` and ``hip`` of torch/version.py, read as text: importing
    torch costs 1-2 s, and a build on another engine must not pay it (issue 10)."""
    out: dict[str, str | None] = {"__version__": None, "cuda": None, "hip": None}
    try:
        spec = importlib.util.find_spec("torch")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return out
        tree = ast.parse((Path(next(iter(where))) / "version.py").read_text(encoding="utf-8"))
    except (ImportError, ValueError, OSError, SyntaxError):
        return out
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target if isinstance(stmt, ast.AnnAssign) else None
        value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in out and value is not None:
            with contextlib.suppress(ValueError):
                v = ast.literal_eval(value)
                out[target.id] = str(v) if v is not None else None
    return out


def cuda_torch_support(who: str, hint: str) -> Support:
    """Whether a CUDA build of PyTorch is installed, for an engine (``who``) that runs on its
    CUDA runtime -- read from files, without importing torch."""
    if not torch_installed():
        return Support.no(f"PyTorch is not installed; {who} runs on its CUDA runtime ({hint})")
    info = torch_build_info()
    if not info["cuda"]:
        return Support.no(f"{who} needs an NVIDIA GPU: a CPU-only build of PyTorch ({info['__version__']})")
    return Support.yes()


_VISIBLE: list[int] = []  # the visible GPU count, once asked (fixed for a process's life)


def visible_gpus(torch: Any) -> int:
    """How many GPUs PyTorch sees. Asked once: ``torch.cuda.is_available`` queries the driver
    on every call (0.2 ms; a ViT-B/16 session's first open asked 910 times, 0.18 s)."""
    if not _VISIBLE:
        _VISIBLE.append(int(torch.cuda.device_count()) if torch.cuda.is_available() else 0)
    return _VISIBLE[0]


def gpu_exists(torch: Any, index: int) -> Support:
    """Whether CUDA device ``index`` is one of the visible GPUs."""
    n = visible_gpus(torch)
    if index >= n:
        return Support.no(f"GPU {index} does not exist ({n} visible)")
    return Support.yes()


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["torch"] = None
        return False


_DTYPES: dict[DataType, Any] = {}  # filled on first use (torch imports lazily)


def torch_dtype(dt: DataType) -> Any:
    if not _DTYPES:
        _DTYPES.update(_dtype_table())
    return _DTYPES[dt]


def _dtype_table() -> dict[DataType, Any]:
    torch = _torch()
    table = {
        DataType.HALF: torch.float16,
        DataType.BFLOAT16: torch.bfloat16,
        DataType.FLOAT: torch.float32,
        DataType.DOUBLE: torch.float64,
        DataType.INT8: torch.int8,
        DataType.UINT8: torch.uint8,
        DataType.INT16: torch.int16,
        DataType.INT32: torch.int32,
        DataType.INT64: torch.int64,
        DataType.BOOLEAN: torch.bool,
        DataType.FP8_E4M3: torch.float8_e4m3fn,
        DataType.FP8_E5M2: torch.float8_e5m2,
    }
    return table


# numpy has no bf16/fp8 of its own (ml_dtypes has): they cross as same-size unsigned ints.
_VIEW_AS = {DataType.BFLOAT16: np.uint16, DataType.FP8_E4M3: np.uint8, DataType.FP8_E5M2: np.uint8}


def from_numpy(arr: np.ndarray, dt: DataType) -> Tensor:
    """A torch view of a numpy array (no copy), strides kept."""
    torch = _torch()
    base = arr.view(_VIEW_AS[dt]) if dt in _VIEW_AS else arr
    if not base.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(base)
    else:
        t = torch.from_numpy(base)
    return t.view(torch_dtype(dt)) if dt in _VIEW_AS else t


def to_numpy_into(src: Tensor, dst: np.ndarray, dt: DataType) -> None:
    """Copies a torch tensor (any device) into a numpy array of the tensor's logical shape."""
    from_numpy(dst, dt).copy_(src)


# ---- fusegraph Buffers (IREE device memory) through DLPack, without copies -----------------------
_DLPACK_DEVICE = {"cpu": 1, "cuda": 2, "hip": 10}



def _host_result(value: Tensor, t: TensorAttr, taken: list[int] | None) -> np.ndarray:
    """A result as a NumPy array laid out as ``t`` declares: lent as a view when the caller
    may take it (``taken`` not None: a tensor allocated afresh by this call), is a CPU
    tensor in that layout of a NumPy type, and no other result of the call was lent over
    its memory (``taken`` collects those); else copied."""
    if (
        taken is not None
        and value.device.type == "cpu"
        and t.dtype not in _VIEW_AS
        and layout.same_strides(t.shape, value.stride(), t.strides)
        and value.untyped_storage().data_ptr() not in taken
    ):
        taken.append(value.untyped_storage().data_ptr())
        lent: np.ndarray = value.numpy()
        return lent
    arr = layout.empty_strided(t.shape, t.strides, t.dtype.numpy)
    to_numpy_into(value, arr, t.dtype)
    return arr


def _is_buffer(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "Buffer" and cls.__module__ == "fusegraph.runtime.buffer"


def buffer_to_torch(buf: Any, t: TensorAttr) -> Tensor:
    """A torch view (logical dims, declared strides) of a Buffer's device memory."""
    torch = _torch()
    from fusegraph.engines.iree.runtime import runtime_for

    dev = buf.handle.device
    capsule = runtime_for(buf.handle).hal_device.create_dlpack_capsule(buf.view, _DLPACK_DEVICE[dev.kind], dev.index)
    phys = torch.from_dlpack(capsule)  # dense, in memory order
    order = layout.physical_order(buf.shape, buf.strides)
    logical = phys.permute(tuple(order.index(a) for a in range(len(order))))
    return logical.expand(t.shape) if tuple(logical.shape) != t.shape else logical


def torch_to_buffer(value: Tensor, t: TensorAttr, handle: Handle) -> Any:
    """A Buffer aliasing a (dense, memory-order) copy of a result tensor on its device."""
    from fusegraph.engines.iree.runtime import runtime_for
    from fusegraph.runtime.buffer import Buffer

    order = layout.physical_order(t.shape, t.strides)
    dense = value.permute(order).contiguous()
    rt = runtime_for(handle)
    view = rt.import_dlpack(dense)
    return Buffer(view, handle, rt, tuple(t.shape), tuple(t.strides), t.dtype, alias=True, keep=dense)


def _torch_device(handle: Handle) -> Any:
    torch = _torch()
    if handle.device.kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", handle.device.index)  # ROCm builds of torch call HIP "cuda"

"""Buffer: one tensor's data in device memory on a Handle.

Plans take Buffers as inputs and return Buffers as outputs, so a chain of graphs runs with
no host round trip. A Buffer keeps the tensor's logical dims and strides, and holds the
data as the dense memory-order buffer compiled engines exchange (``layout.physical_shape``);
an NHWC tensor is an [N, H, W, C] buffer underneath, whatever order its dims are listed in.

The memory is an IREE HAL buffer on the handle's device (IREE is the runtime underneath
every compiled plan); on the CPU that is ordinary host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fusegraph.dtypes import DataType, as_data_type
from fusegraph.errors import VariantPackError
from fusegraph.graph import layout
from fusegraph.runtime.handle import Handle, as_handle

if TYPE_CHECKING:
    from fusegraph.graph.tensor import TensorAttr
    from fusegraph.runtime.iree_hal import IreeRuntime

# DLPack device type codes (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM = 1, 2, 3, 10
_DL_FOR_KIND = {"cpu": (_DL_CPU, _DL_CUDA_HOST), "cuda": (_DL_CUDA,), "hip": (_DL_ROCM,)}


class Buffer:
    """Device memory holding one tensor (see the module docstring)."""

    __slots__ = ("__weakref__", "_alias", "_keep", "_runtime", "_view", "data_type", "handle", "physical_shape", "shape", "strides")

    def __init__(
        self,
        view: Any,
        handle: Handle,
        runtime: IreeRuntime,
        dim: tuple[int, ...],
        stride: tuple[int, ...],
        data_type: DataType,
        *,
        alias: bool = False,
        keep: Any = None,
    ) -> None:
        self._view = view  # iree.runtime.HalBufferView, shape == physical_shape
        self._runtime = runtime
        self._alias = alias  # the memory belongs to someone else (DLPack import)
        self._keep = keep  # an object whose memory the view aliases, kept alive
        self.handle = handle
        self.shape = dim  # logical dims, as the tensor lists them
        self.strides = stride  # element strides of the logical view
        self.data_type = data_type
        self.physical_shape = layout.physical_shape(dim, stride)
        _track(self)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, arr: Any, handle: Handle | str | None = None, tensor: TensorAttr | None = None) -> Buffer:
        """Copies an array onto the handle's device.

        With ``tensor``, ``arr`` holds the tensor's logical dims (any strides) and the data is
        laid out as the tensor's strides declare; without, the array's own dense layout is
        kept (an NHWC-strided view stays NHWC) and anything else is stored row-major.
        """
        from fusegraph.runtime.iree_hal import runtime_for

        h = as_handle(handle)
        arr = np.asarray(arr)
        dim, stride, dt = _layout_for(arr, tensor)
        rt = runtime_for(h)
        dense = layout.to_physical(arr, dim, stride)
        return cls(rt.upload(dense, dt), h, rt, dim, stride, dt)

    @classmethod
    def from_dlpack(cls, obj: Any, handle: Handle | str | None = None, tensor: TensorAttr | None = None) -> Buffer:
        """Wraps a DLPack-exporting array (NumPy, PyTorch...) without a copy when it lives on
        the handle's device and is row-major contiguous (and, in host memory, 64-byte
        aligned, as IREE requires); otherwise copies host data there. Only a wrapped
        Buffer writes through to the array when used as an execute output."""
        from fusegraph.runtime.iree_hal import runtime_for

        h = as_handle(handle)
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"{type(obj).__name__} does not export DLPack (__dlpack__)")
        dev_type, dev_id = obj.__dlpack_device__()
        on_device = int(dev_type) in _DL_FOR_KIND[h.device.kind] and (
            h.device.kind == "cpu" or int(dev_id) == h.device.index
        )
        if int(dev_type) in (_DL_CPU, _DL_CUDA_HOST):
            host = np.from_dlpack(obj)
            # IREE imports host memory only when it is 64-byte aligned.
            if not (on_device and _is_row_major(obj) and host.ctypes.data % 64 == 0 and host.nbytes):
                return cls.from_numpy(host, h, tensor)
        if not on_device:
            raise ValueError(
                f"DLPack array lives on device type {dev_type}:{dev_id}, not on {h.device}; "
                "move it there first (or pass a host array)"
            )
        if not _is_row_major(obj):
            raise ValueError("a device DLPack array must be row-major contiguous to be wrapped; call .contiguous() first")
        rt = runtime_for(h)
        view = rt.import_dlpack(obj)
        dims = tuple(int(d) for d in view.shape)
        dt = _data_type_of_view(view)
        stride = layout.packed_strides(dims)
        if tensor is not None:
            if tuple(tensor.shape) != dims or tensor.dtype != dt:
                raise VariantPackError(
                    f"DLPack array has shape {list(dims)} and type {dt.name}, expected {tensor.dim} and {tensor.dtype.name}",
                    tensor=tensor.name,
                )
            if layout.physical_shape(tensor.shape, tensor.strides) != dims:
                raise VariantPackError(
                    f"tensor declares strides {tensor.stride}; a row-major DLPack array cannot be wrapped as it",
                    tensor=tensor.name,
                )
            stride = tensor.strides
        return cls(view, h, rt, dims, stride, dt, alias=True, keep=obj)

    @classmethod
    def empty(cls, tensor: TensorAttr, handle: Handle | str | None = None) -> Buffer:
        """An uninitialized Buffer for a tensor (e.g. to receive an output)."""
        from fusegraph.runtime.iree_hal import runtime_for

        h = as_handle(handle)
        rt = runtime_for(h)
        dim, stride = tuple(tensor.shape), tuple(tensor.strides)
        return cls(rt.allocate(layout.physical_shape(dim, stride), tensor.dtype), h, rt, dim, stride, tensor.dtype)

    # ---- reading ---------------------------------------------------------------------------------
    def to_numpy(self) -> np.ndarray:
        """A host copy of the data, with the logical dims and the declared strides."""
        if self._view is None:
            raise ValueError("this Buffer was released (the interpreter is exiting)")
        phys = self._runtime.download(self._view, self.data_type.numpy, copy=True)
        out = layout.from_physical(phys, self.shape, self.strides)
        if out.shape != self.shape:  # broadcast (zero-stride) axes are stored once
            out = np.broadcast_to(out, self.shape)
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.to_numpy()
        return arr if dtype is None else arr.astype(dtype)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data_type.numpy

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.physical_shape, dtype=np.int64)) * self.data_type.itemsize

    @property
    def device(self) -> str:
        return str(self.handle.device)

    @property
    def view(self) -> Any:
        """The underlying iree.runtime.HalBufferView (memory-order shape)."""
        return self._view

    def __repr__(self) -> str:
        lay = layout.layout_name(self.shape, self.strides)
        return f"Buffer(shape={list(self.shape)}, {self.data_type.name}{', ' + lay if lay else ''}, on {self.device})"

    # ---- used by plans -------------------------------------------------------------------------
    def layout_mismatch(self, dim: tuple[int, ...], stride: tuple[int, ...], dt: DataType) -> str | None:
        """Why this Buffer cannot stand for a tensor of these dims/strides/type, or None."""
        if self.data_type != dt:
            return f"Buffer holds {self.data_type.name}, the tensor is {dt.name}"
        if self.shape != dim:
            return f"Buffer has shape {list(self.shape)}, the tensor has dims {list(dim)}"
        if self.strides == stride:
            return None
        if self.physical_shape == layout.physical_shape(dim, stride) and _same_order(dim, self.strides, stride):
            return None
        return (
            f"Buffer is laid out with strides {list(self.strides)}, the tensor declares {list(stride)}; "
            "make the Buffer with Buffer.from_numpy(array, handle, tensor=t)"
        )

    def _release(self) -> None:
        self._view = None
        self._keep = None

    def _rebind(self, view: Any) -> None:
        """Makes this Buffer hold ``view`` (an execute's result) in place of its memory."""
        self._view = view
        self._keep = None


def _track(b: Buffer) -> None:
    from fusegraph.runtime.iree_hal import track

    track(b)


def _same_order(dim: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    keep = [i for i, d in enumerate(dim) if d > 1]
    oa = [i for i in layout.stride_order(dim, a) if i in keep]
    ob = [i for i in layout.stride_order(dim, b) if i in keep]
    return oa == ob and all((a[i] == 0) == (b[i] == 0) for i in keep)


def _layout_for(arr: np.ndarray, tensor: TensorAttr | None) -> tuple[tuple[int, ...], tuple[int, ...], DataType]:
    if tensor is None:
        dt = as_data_type(arr.dtype)
        dim = tuple(int(d) for d in arr.shape)
        es = layout.element_strides(arr.shape, arr.strides, arr.itemsize) if arr.itemsize else None
        if es is not None and all(s >= 0 for s in es) and layout.is_packed(dim, es):
            return dim, es, dt
        return dim, layout.packed_strides(dim), dt
    if tuple(arr.shape) != tuple(tensor.shape):
        raise VariantPackError(f"array has shape {list(arr.shape)}, expected dims {tensor.dim}", tensor=tensor.name)
    if arr.dtype != tensor.dtype.numpy:
        raise VariantPackError(
            f"array has dtype {arr.dtype}, expected {tensor.dtype.name} ({tensor.dtype.numpy})", tensor=tensor.name
        )
    return tuple(tensor.shape), tuple(tensor.strides), tensor.dtype


def _is_row_major(obj: Any) -> bool:
    shape = tuple(int(d) for d in obj.shape)
    stride_attr = getattr(obj, "stride", None)
    if callable(stride_attr):  # torch: element strides
        strides = tuple(int(s) for s in stride_attr())
    elif isinstance(obj, np.ndarray):
        strides = layout.element_strides(obj.shape, obj.strides, obj.itemsize) or ()
    else:
        return False
    want = layout.packed_strides(shape)
    return all(d == 1 or s == w for d, s, w in zip(shape, strides, want, strict=True))


def _data_type_of_view(view: Any) -> DataType:
    from fusegraph.runtime.iree_hal import element_type

    et = int(view.element_type)
    for dt in DataType:
        try:
            if int(element_type(dt)) == et:
                return dt
        except KeyError:
            continue
    raise TypeError(f"IREE element type {et:#x} has no fusegraph DataType")

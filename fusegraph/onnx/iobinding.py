"""``InferenceSession.io_binding()``: ONNX Runtime's IOBinding, for code written against it.

Inputs are bound as NumPy arrays, ``OrtValue``s, objects NumPy or DLPack can view (torch
tensors), or ONNX Runtime's raw form (device, element type, shape, pointer: how torch users
bind ``tensor.data_ptr()``). Outputs bound to memory are written there by
``run_with_iobinding``; the others are allocated and handed out, as ONNX Runtime does.

On a GPU session (provider option ``device="cuda:N"``) the data stays on the device (issue 24
item 5): CUDA inputs -- torch CUDA tensors, DLPack objects on a CUDA device, raw pointers
with device ``"cuda"`` -- are viewed without a copy and flow into the claimed units as torch
tensors; outputs bound to CUDA memory are written there on the device; outputs bound with
``bind_output(name, "cuda")`` and no buffer come back from ``get_outputs()`` as torch CUDA
tensors (a DLPack consumer takes them without a copy: ``cupy.from_dlpack``,
``jax.dlpack.from_dlpack``...), since ONNX Runtime's CPU build cannot make CUDA ``OrtValue``s.
Only nodes left to ONNX Runtime (its CPU provider) copy to and from the host, which the
partition report names. The work is queued on torch's current stream of the session's device:
``synchronize_outputs()`` waits for it (needed before another stream or the host reads a
bound pointer). A session on the host reads host memory only: a CUDA input or output is
refused by name.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from fusegraph.onnx.ort_errors import InvalidFeedError

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13  # DLPack's device types


def is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr") and hasattr(value, "device")


def is_device_value(value: Any) -> bool:
    """A torch tensor on a GPU (what the feed of a GPU session may hold besides arrays)."""
    return is_torch(value) and value.device.type == "cuda"


def host_array(value: Any, name: str) -> np.ndarray:
    """A NumPy view of ``value`` (no copy where NumPy or DLPack can view it)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, ort.OrtValue):  # a view of its memory: bound outputs are written there
        if str(value.device_name()).lower() != "cpu":
            raise _on_device(name, value.device_name(), "")
        dt = value.numpy().dtype if value.shape() else np.dtype(np.float32)
        return _pointer_array(name, value.device_name(), dt, value.shape(), value.data_ptr())
    if is_device_value(value):
        raise _on_device(name, str(value.device), "")
    if hasattr(value, "__dlpack__"):
        dev = _dlpack_device(value)
        if dev is not None and dev[0] in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise _on_device(name, f"cuda:{dev[1]}", "")
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise InvalidFeedError(f"cannot view {type(value).__name__} on the host: {exc}", tensor=name) from None
    return np.asarray(value)


def feed_value(value: Any, name: str, device: str) -> Any:
    """``value`` as the session on ``device`` ("cpu", "cuda:N") takes it: a NumPy view of host
    memory, or (GPU sessions) a torch tensor viewing CUDA memory on that device -- never a copy."""
    if device == "cpu" or isinstance(value, np.ndarray):
        return host_array(value, name)
    if is_torch(value):
        if value.device.type != "cuda":
            return host_array(value, name)
        _check_device(name, str(value.device), device)
        return value.detach() if value.requires_grad else value
    if hasattr(value, "__dlpack__"):
        dev = _dlpack_device(value)
        if dev is not None and dev[0] in (_DL_CUDA, _DL_CUDA_MANAGED):
            _check_device(name, f"cuda:{dev[1]}", device)
            return _torch_module(name).from_dlpack(value)
        return host_array(value, name)
    if isinstance(value, ort.OrtValue) and str(value.device_name()).lower() != "cpu":
        dt = _ort_element_type(value)
        return _pointer_value(name, value.device_name(), value.device_id(), dt, value.shape(), value.data_ptr(), device)
    return host_array(value, name)


def _dlpack_device(value: Any) -> tuple[int, int] | None:
    fn = getattr(value, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        kind, index = fn()
    except Exception:
        return None
    return int(kind), int(index)


def _on_device(name: str, where: str, device: str) -> InvalidFeedError:
    return InvalidFeedError(
        f"bound on device {where!r}: this session reads host memory (device='cpu'); bind a host array, or "
        "open the session with provider option device='cuda:0' to keep the data on the GPU", tensor=name
    )


def _check_device(name: str, where: str, device: str) -> None:
    """A CUDA value must be on the session's own GPU (no silent cross-device copy)."""
    if device == "cpu":
        raise _on_device(name, where, device)
    want = device if ":" in device else f"{device}:0"
    got = where if ":" in where else f"{where}:0"
    if got != want:
        raise InvalidFeedError(f"on {got}, but the session runs on {want}: move it there first", tensor=name)


def _torch_module(name: str) -> Any:
    try:
        import torch
    except ImportError:
        raise InvalidFeedError("a CUDA value needs torch to be viewed (pip install fusegraph[torch])",
                               tensor=name) from None
    return torch


def _ort_element_type(value: Any) -> np.dtype[Any]:
    """The NumPy dtype of an OrtValue's element type ("tensor(float)")."""
    text = str(value.data_type()).removeprefix("tensor(").removesuffix(")")
    code = onnx.TensorProto.DataType.Value({"float": "FLOAT", "double": "DOUBLE"}.get(text, text.upper()))
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))


def _pointer_value(name: str, device_type: Any, device_id: int, element_type: Any, shape: Any, buffer_ptr: int,
                   device: str) -> Any:
    """ONNX Runtime's raw (device, element type, shape, pointer) as a host array or, for
    device 'cuda' on a GPU session, a torch tensor viewing that memory."""
    kind = str(device_type).lower()
    if kind == "cpu":
        return _pointer_array(name, device_type, element_type, shape, buffer_ptr)
    if kind not in ("cuda", "gpu"):
        raise InvalidFeedError(f"bound on device {device_type!r}: expected 'cpu' or 'cuda'", tensor=name)
    _check_device(name, f"cuda:{int(device_id)}", device)
    return cuda_view(name, element_type, shape, buffer_ptr, int(device_id))


class _CudaArray:
    """The ``__cuda_array_interface__`` of raw CUDA memory, for torch to view it."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 2,
                                         "strides": None}


def cuda_view(name: str, element_type: Any, shape: Any, buffer_ptr: int, device_id: int) -> Any:
    """A torch tensor over ``buffer_ptr`` (contiguous ``shape`` of ``element_type`` on
    cuda:``device_id``), no copy."""
    torch = _torch_module(name)
    try:
        dt = np.dtype(element_type)
    except TypeError:
        raise InvalidFeedError(f"element_type {element_type!r} is not a NumPy type", tensor=name) from None
    dims = tuple(int(d) for d in shape)
    if math.prod(dims) == 0:
        return torch.empty(dims, dtype=_torch_dtype(torch, dt), device=f"cuda:{device_id}")
    if not buffer_ptr:
        raise InvalidFeedError("buffer_ptr is null", tensor=name)
    with torch.cuda.device(device_id):
        t = torch.as_tensor(_CudaArray(int(buffer_ptr), dims, dt.str), device=f"cuda:{device_id}")
    return t


def _torch_dtype(torch: Any, dt: np.dtype[Any]) -> Any:
    return torch.from_numpy(np.empty(0, dt)).dtype


def numpy_dtype(value: Any) -> np.dtype[Any]:
    """The NumPy dtype of an array or a torch tensor (bfloat16 as ml_dtypes')."""
    if is_torch(value):
        text = str(value.dtype).removeprefix("torch.")
        if text == "bfloat16":
            import ml_dtypes

            bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
            return bf16
        return np.dtype({"bool": "bool", "half": "float16"}.get(text, text))
    arr: np.ndarray = value if isinstance(value, np.ndarray) else np.asarray(value)
    return arr.dtype


def _pointer_array(name: str, device_type: str, element_type: Any, shape: Any, buffer_ptr: int) -> np.ndarray:
    if str(device_type).lower() != "cpu":
        raise _on_device(name, str(device_type), "cpu")
    dt = np.dtype(element_type)
    dims = tuple(int(d) for d in shape)
    n = math.prod(dims)
    if n == 0:
        return np.empty(dims, dt)
    if not buffer_ptr:
        raise InvalidFeedError("buffer_ptr is null", tensor=name)
    raw = (ctypes.c_byte * (n * dt.itemsize)).from_address(int(buffer_ptr))
    return np.frombuffer(raw, dtype=dt, count=n).reshape(dims)


class IOBinding:
    """Inputs and outputs bound ahead of ``InferenceSession.run_with_iobinding``."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._device: str = str(getattr(session, "device", "cpu"))
        self._inputs: dict[str, Any] = {}  # NumPy arrays, or torch CUDA tensors on a GPU session
        self._outputs: dict[str, Any] = {}  # None: allocated by the run on the host; "cuda": on the device
        self._results: list[tuple[str, Any]] = []
        self._ortvalues: dict[str, ort.OrtValue] = {}  # outputs bound as OrtValues, handed back as such

    # ---- inputs ---------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        self._inputs[name] = host_array(arr_on_cpu, name)

    def bind_input(
        self, name: str, device_type: Any, device_id: int = 0, element_type: Any = None,
        shape: Any = None, buffer_ptr: int | None = None,
    ) -> None:
        if buffer_ptr is None:  # bind_input(name, array or tensor): a convenience ONNX Runtime lacks
            if isinstance(device_type, str):
                raise InvalidFeedError(f"bind_input on device {device_type!r} needs element_type, shape and "
                                       "buffer_ptr (or pass the array / tensor itself)", tensor=name)
            self._inputs[name] = feed_value(device_type, name, self._device)
            return
        if element_type is None or shape is None:
            raise InvalidFeedError("bind_input with buffer_ptr needs element_type and shape", tensor=name)
        self._inputs[name] = _pointer_value(name, device_type, device_id, element_type, shape, buffer_ptr,
                                            self._device)

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._inputs[name] = feed_value(ortvalue, name, self._device)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # ---- outputs --------------------------------------------------------------------------------
    def bind_output(
        self, name: str, device_type: Any = "cpu", device_id: int = 0, element_type: Any = None,
        shape: Any = None, buffer_ptr: int | None = None,
    ) -> None:
        """Where output ``name`` goes: the host (default) or ``"cuda"`` (allocated by the run),
        a buffer given by pointer, or -- a convenience ONNX Runtime lacks -- an array or a
        tensor passed as ``device_type``, written in place."""
        if buffer_ptr is None:
            if not isinstance(device_type, str):
                dest = feed_value(device_type, name, self._device)
                self._outputs[name] = dest
                return
            kind = device_type.lower()
            if kind == "cpu":
                self._outputs[name] = None
                return
            if kind not in ("cuda", "gpu"):
                raise InvalidFeedError(f"bound on device {device_type!r}: expected 'cpu' or 'cuda'", tensor=name)
            _check_device(name, f"cuda:{int(device_id)}", self._device)
            self._outputs[name] = "cuda"
            return
        if element_type is None or shape is None:
            raise InvalidFeedError("bind_output with buffer_ptr needs element_type and shape", tensor=name)
        self._outputs[name] = _pointer_value(name, device_type, device_id, element_type, shape, buffer_ptr,
                                             self._device)

    def bind_ortvalue_output(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._outputs[name] = feed_value(ortvalue, name, self._device)
        self._ortvalues[name] = ortvalue

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._ortvalues.clear()
        self._results = []

    # ---- results --------------------------------------------------------------------------------
    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        from fusegraph.onnx.units import to_host

        return [np.array(to_host(a), copy=True) for _, a in self._results]

    def get_outputs(self) -> list[Any]:
        """``OrtValue``s for outputs on the host; torch CUDA tensors for outputs on the GPU."""
        out: list[Any] = []
        for n, a in self._results:
            if n in self._ortvalues:
                out.append(self._ortvalues[n])
            elif is_device_value(a):
                out.append(a)
            else:
                out.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)))
        return out

    def synchronize_inputs(self) -> None:
        """Waits for the device's pending work (nothing to wait for on the host)."""
        self._synchronize()

    def synchronize_outputs(self) -> None:
        """Waits until the outputs are written (nothing to wait for on the host)."""
        self._synchronize()

    def _synchronize(self) -> None:
        if self._device != "cpu":
            torch = _torch_module("")
            torch.cuda.synchronize(self._device)

    # ---- for the session ------------------------------------------------------------------------
    def _run(self, run_options: Any = None) -> None:
        names = list(self._outputs)
        on_device = self._device != "cpu" and (
            any(is_device_value(v) for v in self._inputs.values())
            or any(d is not None and not isinstance(d, np.ndarray) for d in self._outputs.values())
        )
        if not names:
            got: list[Any] = []
        elif on_device:
            got = self._session._run_on_device(names, dict(self._inputs), run_options)
        else:
            got = self._session.run(names, dict(self._inputs), run_options)
        results = []
        for name, value in zip(names, got, strict=True):
            dest = self._outputs[name]
            if dest is None:
                results.append((name, _host(value)))
            elif isinstance(dest, str):  # "cuda": handed out as a torch tensor on the device
                results.append((name, _on_gpu(value, self._device)))
            elif isinstance(dest, np.ndarray):
                v = _host(value)
                _check_dest(name, dest.dtype, tuple(dest.shape), v)
                np.copyto(dest, v)
                results.append((name, dest))
            else:  # a torch CUDA tensor (bound by pointer, DLPack or as itself)
                _check_dest(name, numpy_dtype(dest), tuple(dest.shape), value)
                dest.copy_(_on_gpu(value, self._device))
                results.append((name, dest))
        self._results = results


def _host(value: Any) -> np.ndarray:
    from fusegraph.onnx.units import to_host

    v = to_host(value)
    return np.ascontiguousarray(v) if isinstance(v, np.ndarray) else np.asarray(v)


def _on_gpu(value: Any, device: str) -> Any:
    """``value`` as a contiguous torch tensor on ``device`` (a host result -- from ONNX
    Runtime -- is uploaded: the one copy its producer makes necessary)."""
    torch = _torch_module("")
    if is_torch(value):
        t = value if value.device.type == "cuda" else value.to(device)
        return t.contiguous()
    arr = np.ascontiguousarray(value)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr).to(device)


def _check_dest(name: str, dtype: np.dtype[Any], shape: tuple[int, ...], value: Any) -> None:
    got_dt, got_shape = numpy_dtype(value), tuple(np.shape(value)) if not is_torch(value) else tuple(value.shape)
    if dtype != got_dt or shape != got_shape:
        raise InvalidFeedError(
            f"bound output is {dtype}{list(shape)}, the run produced {got_dt}{list(got_shape)}", tensor=name,
        )

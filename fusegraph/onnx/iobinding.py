"""``InferenceSession.io_binding()``: ONNX Runtime's IOBinding, for code written against it.

Inputs are bound as NumPy arrays, ``OrtValue``s, objects NumPy or DLPack can view (torch CPU
tensors), or ONNX Runtime's raw form (device, element type, shape, pointer: how torch users
bind ``tensor.data_ptr()``). Outputs bound to memory are written there by
``run_with_iobinding``; the others are allocated and handed out as ``OrtValue``s, as ONNX
Runtime does. The session on the host reads host memory only: a pointer on another device is
refused by name.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import onnxruntime as ort

from fusegraph.onnx.ort_errors import InvalidFeedError


def host_array(value: Any, name: str) -> np.ndarray:
    """A NumPy view of ``value`` (no copy where NumPy or DLPack can view it)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, ort.OrtValue):  # a view of its memory: bound outputs are written there
        dt = value.numpy().dtype if value.shape() else np.dtype(np.float32)
        return _pointer_array(name, value.device_name(), dt, value.shape(), value.data_ptr())
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise InvalidFeedError(f"cannot view {type(value).__name__} on the host: {exc}", tensor=name) from None
    return np.asarray(value)


def _pointer_array(name: str, device_type: str, element_type: Any, shape: Any, buffer_ptr: int) -> np.ndarray:
    if str(device_type).lower() != "cpu":
        raise InvalidFeedError(
            f"bound on device {device_type!r}: this session reads host memory (bind a CPU buffer)", tensor=name
        )
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
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, np.ndarray | None] = {}  # None: allocated by the run
        self._results: list[tuple[str, np.ndarray]] = []
        self._ortvalues: dict[str, ort.OrtValue] = {}  # outputs bound as OrtValues, handed back as such

    # ---- inputs ---------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        self._inputs[name] = host_array(arr_on_cpu, name)

    def bind_input(
        self, name: str, device_type: Any, device_id: int = 0, element_type: Any = None,
        shape: Any = None, buffer_ptr: int | None = None,
    ) -> None:
        if buffer_ptr is None:  # bind_input(name, array): a convenience ONNX Runtime lacks
            self._inputs[name] = host_array(device_type, name)
            return
        if element_type is None or shape is None:
            raise InvalidFeedError("bind_input with buffer_ptr needs element_type and shape", tensor=name)
        self._inputs[name] = _pointer_array(name, device_type, element_type, shape, buffer_ptr)

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._inputs[name] = host_array(ortvalue, name)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # ---- outputs --------------------------------------------------------------------------------
    def bind_output(
        self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
        shape: Any = None, buffer_ptr: int | None = None,
    ) -> None:
        if buffer_ptr is None:
            if str(device_type).lower() != "cpu":
                raise InvalidFeedError(f"bound on device {device_type!r}: this session runs on the host", tensor=name)
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise InvalidFeedError("bind_output with buffer_ptr needs element_type and shape", tensor=name)
        self._outputs[name] = _pointer_array(name, device_type, element_type, shape, buffer_ptr)

    def bind_ortvalue_output(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._outputs[name] = host_array(ortvalue, name)
        self._ortvalues[name] = ortvalue

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._ortvalues.clear()
        self._results = []

    # ---- results --------------------------------------------------------------------------------
    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [np.array(a, copy=True) for _, a in self._results]

    def get_outputs(self) -> list[ort.OrtValue]:
        return [
            self._ortvalues[n] if n in self._ortvalues else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
            for n, a in self._results
        ]

    def synchronize_inputs(self) -> None:
        """Host memory: nothing to wait for."""

    def synchronize_outputs(self) -> None:
        """Host memory: nothing to wait for."""

    # ---- for the session ------------------------------------------------------------------------
    def _run(self, run_options: Any = None) -> None:
        names = list(self._outputs)
        got = self._session.run(names, dict(self._inputs), run_options) if names else []
        results = []
        for name, value in zip(names, got, strict=True):
            dest = self._outputs[name]
            if dest is None:
                results.append((name, np.asarray(value)))
                continue
            if dest.shape != np.shape(value) or dest.dtype != np.asarray(value).dtype:
                raise InvalidFeedError(
                    f"bound output is {dest.dtype}{list(dest.shape)}, the run produced "
                    f"{np.asarray(value).dtype}{list(np.shape(value))}", tensor=name,
                )
            np.copyto(dest, value)
            results.append((name, dest))
        self._results = results

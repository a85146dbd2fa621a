"""IREE runtime state per device: VM instance, HAL device, and the modules loaded on it.

Device memory (fusegraph.runtime.buffer.Buffer) is IREE HAL memory, so the HAL lives in
the runtime layer; the IREE engine (engines/iree/) imports it from here. Only IREE's
runtime bindings are imported (``bindings()``), and only when a device is opened -- never
the compiler.

A Handle reaches its device's state through ``runtime_for(handle)``. State is shared by
every Handle of the same device (an explicit registry), so a Buffer made through one
``Handle("cpu")`` runs with a plan built through another. Loaded modules are kept per
cache key: a second plan for the same compiled graph binds the same function.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.errors import ExecutionError, UnsupportedError
from fusegraph.runtime.exit_release import ExitRelease
from fusegraph.runtime.handle import Device, Handle

log = logging.getLogger("fusegraph.iree")
MAX_LOADED_MODULES = 256  # per runtime (device); like the IREE engine's in-memory module cache

STATE_KEY = "iree"
# Handle device kind -> the IREE HAL driver that runs it (engines/iree/targets.py's table
# of compile targets names these).
HAL_DRIVERS: dict[str, str] = {"cpu": "local-task", "cuda": "cuda", "hip": "hip"}
# IREE buffers must be this aligned to be imported without a copy (codegen assumes it).
IMPORT_ALIGNMENT = 64


RUNTIME_FLAGS_ENV = "IREE_PY_RUNTIME_FLAGS"  # IREE's own: parsed when iree.runtime is imported


@functools.cache
def bindings() -> Any:
    """IREE's native runtime module: every class and function fusegraph uses from
    ``iree.runtime`` (which re-exports them from it) lives there.

    ``import iree.runtime`` also loads the package's pure-Python helpers (array interop,
    benchmarking, subprocess, ...): 9-10 ms of CPU in a fresh process, against 4 ms for
    the native module alone, which is what ``iree.runtime._binding`` loads (IREE 3.13).
    The full package is imported where IREE's ``IREE_PY_RUNTIME_FLAGS`` is set (its import
    parses them) or where the native module is not found there."""
    if not os.environ.get(RUNTIME_FLAGS_ENV):
        try:
            from iree._runtime.libs import _runtime

            if hasattr(_runtime, "HalDriver") and hasattr(_runtime, "get_cached_hal_driver"):
                return _runtime
        except ImportError:
            pass
    from iree.runtime import _binding

    return _binding


def runtime_version_module() -> Any:
    """IREE runtime's version module (``iree.runtime.version`` re-exports it)."""
    try:
        from iree._runtime_libs import version
    except ImportError:
        from iree.runtime import version
    return version


def element_type(dt: DataType) -> Any:
    return _element_types()[dt]


@functools.cache
def _element_types() -> dict[DataType, Any]:
    """DataType -> HalElementType, made once (every host input of every call asks)."""
    e = bindings().HalElementType
    return {
        DataType.HALF: e.FLOAT_16,
        DataType.BFLOAT16: e.BFLOAT_16,
        DataType.FLOAT: e.FLOAT_32,
        DataType.DOUBLE: e.FLOAT_64,
        DataType.INT8: e.SINT_8,
        DataType.UINT8: e.UINT_8,
        DataType.INT16: e.SINT_16,
        DataType.INT32: e.SINT_32,
        DataType.INT64: e.SINT_64,
        DataType.BOOLEAN: e.BOOL_8,
        DataType.FP8_E4M3: e.FLOAT_8_E4M3_FN,
        DataType.FP8_E5M2: e.FLOAT_8_E5M2,
    }


@dataclass
class LoadedModule:
    """A compiled module bound on one device: its VM context and entry function."""

    key: str
    module: Any  # iree.runtime.VmModule
    context: Any  # iree.runtime.VmContext
    function: Any  # iree.runtime.VmFunction
    num_results: int

    def invoke(self, args: Any) -> Any:
        """Runs the entry function (synchronously) on a VmVariantList of buffer views."""
        rt = bindings()
        results = rt.VmVariantList(self.num_results)
        self.context.invoke(self.function, args, results)
        return results


class IreeRuntime:
    """Per-device IREE state (see the module docstring)."""

    def __init__(self, device: Device) -> None:
        rt = bindings()

        self.device = device
        self.driver_name = HAL_DRIVERS[device.kind]
        self._rt = rt
        try:
            driver = rt.get_cached_hal_driver(self.driver_name)  # what iree.runtime.get_driver calls
            if device.kind == "cpu":
                hal = driver.create_default_device()
            else:
                found = driver.query_available_devices()
                if device.index >= len(found):
                    raise UnsupportedError(
                        f"{device}: the IREE '{self.driver_name}' driver sees {len(found)} device(s)"
                    )
                hal = driver.create_device(found[device.index]["device_id"])
        except UnsupportedError:
            raise
        except Exception as exc:  # IREE raises RuntimeError/ValueError with its status text
            raise UnsupportedError(f"{device}: cannot open an IREE '{self.driver_name}' device: {exc}") from None
        self.hal_device = hal
        self.allocator = hal.allocator
        self.instance = rt.VmInstance()
        self.hal_module = rt.create_hal_module(self.instance, hal)
        self.host_visible = device.kind == "cpu"
        # Loaded modules by key, least recently used first. Bounded: each costs ~0.13 MiB
        # resident, and a process building graph after distinct graph (a fuzzer, varying
        # shapes) grew without end (benchmarks/bench_lifetimes.py --distinct: +68 MiB over
        # 540 graphs). Evicting only drops the runtime's reference: live plans keep theirs.
        self._modules: OrderedDict[str, LoadedModule] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<IreeRuntime {self.device} driver={self.driver_name}>"

    # ---- modules ---------------------------------------------------------------------------
    def load(self, key: str, vmfb: bytes, func_name: str, num_results: int) -> LoadedModule:
        """Binds a compiled module (once per key) and looks its function up (once)."""
        with self._lock:
            hit = self._modules.get(key)
            if hit is not None:
                self._modules.move_to_end(key)
                return hit
            rt = self._rt
            try:
                module = rt.VmModule.copy_buffer(self.instance, vmfb)
                context = rt.VmContext(self.instance, [self.hal_module, module])
                function = module.lookup_function(func_name)
            except Exception as exc:
                raise ExecutionError(f"IREE could not load the compiled module ({key[:12]}): {exc}") from None
            if function is None:
                raise ExecutionError(f"compiled module {key[:12]} has no function '{func_name}'")
            loaded = LoadedModule(key, module, context, function, num_results)
            self._modules[key] = loaded
            while len(self._modules) > MAX_LOADED_MODULES:
                self._modules.popitem(last=False)
            return loaded

    def loaded(self, key: str) -> LoadedModule | None:
        with self._lock:
            hit = self._modules.get(key)
            if hit is not None:
                self._modules.move_to_end(key)
            return hit

    def forget(self, key: str | None = None) -> None:
        """Drops loaded modules (all when key is None); live plans keep theirs."""
        with self._lock:
            if key is None:
                self._modules.clear()
            else:
                self._modules.pop(key, None)

    # ---- buffers -----------------------------------------------------------------------------
    def upload(self, arr: np.ndarray, dt: DataType, *, allow_alias: bool = False) -> Any:
        """A HalBufferView holding ``arr`` (C-contiguous). With ``allow_alias`` on a host
        device and a suitably aligned array, the view aliases ``arr``'s memory (no copy);
        the caller keeps ``arr`` alive and unchanged while the view is in use."""
        rt = self._rt
        et = element_type(dt)
        if allow_alias and self.host_visible and arr.ctypes.data % IMPORT_ALIGNMENT == 0 and arr.nbytes > 0:
            buf = self.allocator.import_host_allocation(
                arr,
                memory_type=rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE,
                allowed_usage=rt.BufferUsage.DEFAULT,
            )
            return rt.HalBufferView(buf, arr.shape, et)
        return self.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT,
            device=self.hal_device,
            buffer=arr,
            element_type=et,
        )

    def allocate(self, shape: Sequence[int], dt: DataType) -> Any:
        """An uninitialized device buffer view."""
        rt = self._rt
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        buf = self.allocator.allocate_buffer(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, allocation_size=nbytes
        )
        return rt.HalBufferView(buf, list(shape), element_type(dt))

    def download(self, view: Any, dtype: np.dtype[Any], *, copy: bool = True) -> np.ndarray:
        """The view's contents as a host array (a copy unless ``copy=False`` on a host device)."""
        rt = self._rt
        shape = list(view.shape)
        buf = view.get_buffer()
        mappable = (buf.memory_type() & int(rt.MemoryType.HOST_VISIBLE)) and (
            buf.allowed_usage() & int(rt.BufferUsage.MAPPING_SCOPED)
        )
        if mappable:
            mapped = view.map().asarray(shape, dtype)
            return np.array(mapped, copy=True) if copy else mapped
        host = np.empty(shape, dtype=dtype)
        staging = self.allocator.allocate_buffer(
            memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
            allowed_usage=rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING,
            allocation_size=buf.byte_length(),
        )
        self.copy_buffer(buf, staging)
        host[...] = staging.map().asarray(shape, dtype)
        return host

    def copy_buffer(self, source: Any, target: Any) -> None:
        """Device-side copy of one HalBuffer into another, waited for."""
        # A command buffer rather than queue_copy: the latter demands DISCARD_WRITE access,
        # which buffers imported through DLPack do not grant.
        rt = self._rt
        cb = rt.HalCommandBuffer(self.hal_device)
        cb.copy(source, target, end=True)
        sem = self.hal_device.create_semaphore(0)
        self.hal_device.queue_execute(
            cb, wait_semaphores=rt.HalFence.create_at(sem, 0), signal_semaphores=rt.HalFence.create_at(sem, 1)
        )
        rt.HalFence.create_at(sem, 1).wait()

    def import_dlpack(self, obj: Any) -> Any:
        """A HalBufferView aliasing a DLPack-exporting array's memory."""
        return self.hal_device.from_dlpack_capsule(obj.__dlpack__())


_RUNTIMES: dict[Device, IreeRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()

# IREE 3.13's Python bindings crash at interpreter exit when a buffer that a function
# returned outlives its HAL device, and nanobind complains of "leaks" for IREE objects
# still alive when its module goes (module teardown frees things in any order). So every
# holder of IREE objects (Buffers, plans, handles) is tracked here and let go of them
# before teardown begins; a Buffer or plan used after that raises instead of crashing.
_HOLDERS = ExitRelease()
_HANDLES: list[weakref.ref[Handle]] = []


def track(holder: Any) -> None:
    """Registers an object with a ``_release()`` to call at exit (Buffers, plans)."""
    _HOLDERS.track(holder)


@atexit.register
def _release_at_exit() -> None:
    _HOLDERS.release()
    for ref in _HANDLES:
        h = ref()
        if h is not None:
            h.state.pop(STATE_KEY, None)
    _HANDLES.clear()
    for rt in _RUNTIMES.values():
        rt.forget()
    _RUNTIMES.clear()


def runtime_for(handle: Handle) -> IreeRuntime:
    """The IREE state of the handle's device (opened on first use, then shared)."""
    state = handle.state.get(STATE_KEY)
    if state is not None:
        return state  # type: ignore[no-any-return]
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(handle.device)
        if rt is None:
            rt = IreeRuntime(handle.device)
            _RUNTIMES[handle.device] = rt
    handle.state[STATE_KEY] = rt
    if len(_HANDLES) > 256:
        _HANDLES[:] = [r for r in _HANDLES if r() is not None]
    _HANDLES.append(weakref.ref(handle))
    return rt


def available_drivers() -> tuple[str, ...]:
    """HAL drivers compiled into the installed IREE runtime (not whether a device exists)."""
    try:
        return tuple(bindings().HalDriver.query())  # iree.runtime.query_available_drivers()
    except Exception:
        return ()

"""Second tier: a region of ops the graph API lacks, compiled whole through IREE's
torch-mlir ONNX importer (``iree.compiler.extras.onnx_importer``, the code behind
``iree-import-onnx``) with ``input_type="onnx"``, instead of running in ONNX Runtime.

Policy (provider option ``torch_mlir_tier``):

* ``off``: never; unclaimed regions run in ONNX Runtime.
* ``on``: every unclaimed region that IREE compiles runs through it (ONNX Runtime where
  it does not).
* ``auto`` (default): only where it wins. A call into IREE from Python costs about half a
  millisecond however small the region (measured here: 0.57 ms for Relu+Pad on
  1x3x8x8), so regions whose ONNX Runtime time is below ``AUTO_MIN_ORT_MS`` are left
  alone without compiling. Larger ones are compiled, both are timed on the same random
  input (median of ``_REPEATS`` after a warm-up), outputs compared, and IREE is kept only
  when it agrees and is faster.

Compiled modules are cached by content (model bytes, flags, IREE version) in
``cache_dir`` (default: the user cache directory, ``fusegraph/onnx-tier``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from fusegraph.errors import CompileError
from fusegraph.onnx.model import OnnxGraph, ONode
from fusegraph.onnx.units import OrtUnit, sub_model
from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import atomic_write_bytes

log = logging.getLogger("fusegraph.onnx")

AUTO_MIN_ORT_MS = 1.0
IMPORT_OPSET = 17  # IREE's ONNX importer handles opset-9 BatchNormalization only once upgraded
_REPEATS = 5


def _target(device: str) -> tuple[list[str], list[str], str]:
    """(target backends, extra flags, runtime driver) for a device string."""
    if device.startswith("cuda"):
        return ["cuda"], ["--iree-cuda-target=sm_80"], "cuda"
    return ["llvm-cpu"], ["--iree-llvmcpu-target-cpu=host"], "local-task"


def _cache_root(cache_dir: str | None) -> Path:
    from fusegraph.runtime.cache_dir import cache_root  # FUSEGRAPH_CACHE_DIR, else the user's

    return (Path(cache_dir) if cache_dir else cache_root()) / "onnx-tier"


def _prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), IMPORT_OPSET)
    if version < IMPORT_OPSET:
        model = onnx.version_converter.convert_version(model, IMPORT_OPSET)
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def compile_region(model: onnx.ModelProto, device: str, cache_dir: str | None) -> bytes:
    """A vmfb of the region's ONNX model; CompileError (with the MLIR kept) when IREE refuses."""
    from iree.compiler import ir
    from iree.compiler.extras import onnx_importer

    backends, flags, _ = _target(device)
    data = model.SerializeToString()
    key = hashlib.sha256(data + repr((backends, flags, _iree_version())).encode()).hexdigest()[:32]
    root = _cache_root(cache_dir)
    cached = root / f"{key}.vmfb"
    if cached.is_file():
        with contextlib.suppress(OSError):  # evicted meanwhile: compiled again below
            data = cached.read_bytes()
            cache_limit.touch(cached)
            return data
    try:
        prepared = _prepare(model)
        ctx = ir.Context()
        info = onnx_importer.ModelInfo(prepared)
        module = info.create_module(context=ctx).operation
        onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
        asm = module.get_asm()
    except Exception as exc:
        raise CompileError(f"IREE's ONNX importer rejects the region: {exc}".splitlines()[0]) from exc
    from fusegraph.engines.iree.compile import IreeCompileFailure, compile_mlir

    cl = ["--iree-input-type=onnx", *(f"--iree-hal-target-backends={b}" for b in backends),
          "--mlir-print-op-on-diagnostic=false", *flags]
    try:  # a bounded child iree-compile, as the IREE engine's compiles (engines/iree/compile.py)
        vmfb = compile_mlir(asm, cl).vmfb
    except IreeCompileFailure as exc:
        root.mkdir(parents=True, exist_ok=True)
        repro = root / f"{key}.failed.mlir"
        repro.write_text(asm)
        raise CompileError(f"IREE failed to compile the region: {exc}", diagnostic=exc.diagnostic,
                           reproducer=repro) from exc
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(cached, bytes(vmfb))  # a writer killed halfway leaves no truncated module
    cache_limit.enforce(root.parent, keep=[cached])
    return bytes(vmfb)


def _iree_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("iree-base-compiler")
    except metadata.PackageNotFoundError:
        return "unknown"


class IreeOnnxUnit:
    """An unclaimed region compiled whole by IREE from its ONNX form."""

    kind = "iree-onnx"

    def __init__(
        self, name: str, nodes: list[ONode], inputs: list[str], outputs: list[str],
        vmfb: bytes, function: str, device: str,
    ) -> None:
        import iree.runtime as rt

        self.name = name
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs
        self.note = ""
        _, _, driver = _target(device)
        config = rt.Config(driver)
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
        self._fn = ctx.modules.module[function]
        self._ctx = ctx

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        args = [np.ascontiguousarray(values[i]) for i in self.inputs]
        res = self._fn(*args)
        if not isinstance(res, tuple | list):
            res = (res,)
        return {o: np.asarray(r.to_host() if hasattr(r, "to_host") else r) for o, r in zip(self.outputs, res, strict=True)}


def _sample_inputs(og: OnnxGraph, inputs: Sequence[str]) -> dict[str, np.ndarray] | None:
    """Random inputs for timing, or None when some input is not a static float tensor
    (integer inputs are often indices or shapes, which random values would break)."""
    rng = np.random.default_rng(0)
    out = {}
    for i in inputs:
        t = og.types.get(i)
        if t is None or t.shape is None or t.numpy_dtype is None or t.numpy_dtype.kind != "f":
            return None
        out[i] = rng.standard_normal(t.shape).astype(t.numpy_dtype)
    return out


def _median_ms(fn: Any, feed: Mapping[str, Any]) -> float:
    fn(feed)
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn(feed)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def try_unit(
    name: str,
    og: OnnxGraph,
    nodes: list[ONode],
    inputs: list[str],
    outputs: list[str],
    ort_unit: OrtUnit,
    *,
    mode: str,
    device: str,
    cache_dir: str | None,
    strict: bool,
) -> IreeOnnxUnit | None:
    """The region through IREE where the policy says so (see the module docstring)."""
    if mode == "off" or not outputs:
        return None
    feed = _sample_inputs(og, inputs)
    ort_ms = None
    if mode == "auto":
        if feed is None or ort_unit.session is None:
            return None
        try:
            ort_ms = _median_ms(ort_unit.run, feed)
        except Exception:
            return None
        if ort_ms < AUTO_MIN_ORT_MS:
            return None
    model, complete = sub_model(og, nodes, inputs, outputs, name.replace("-", "_"))
    if not complete:
        return None
    try:
        vmfb = compile_region(model, device, cache_dir)
        unit = IreeOnnxUnit(name, nodes, inputs, outputs, vmfb, model.graph.name, device)
    except Exception as exc:
        if strict and mode == "on":
            raise CompileError(f"torch-mlir tier: region {name} failed: {exc}") from exc
        log.warning("torch-mlir tier: region %s stays on ONNX Runtime: %s", name, str(exc).splitlines()[0])
        return None
    if mode == "on":
        unit.note = "torch_mlir_tier=on"
        return unit
    assert feed is not None and ort_ms is not None
    try:
        want = ort_unit.run(feed)
        got = unit.run(feed)
        iree_ms = _median_ms(unit.run, feed)
    except Exception as exc:
        log.info("torch-mlir tier: region %s failed to run in IREE: %s", name, exc)
        return None
    for o in outputs:
        a, b = np.asarray(got[o], np.float64), np.asarray(want[o], np.float64)
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-3, atol=1e-4, equal_nan=True):
            log.info("torch-mlir tier: region %s disagrees with ONNX Runtime on '%s'; not used", name, o)
            return None
    if iree_ms >= ort_ms:
        return None
    unit.note = f"torch_mlir_tier=auto: IREE {iree_ms:.2f} ms vs ONNX Runtime {ort_ms:.2f} ms"
    return unit

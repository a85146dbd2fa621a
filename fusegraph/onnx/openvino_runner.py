"""The whole model on OpenVINO's CPU plugin: one candidate runner beside ONNX Runtime.

fusegraph's own engines do not beat ONNX Runtime's MLAS kernels broadly on small x86 CPUs
(docs/models.md); OpenVINO's CPU plugin (oneDNN kernels, its own graph transformations)
reads the same ONNX file and is faster on some models and slower on others, so it is
offered to the floor as one more whole-model candidate (``floor.choose_runner``), measured
against the caller's ONNX Runtime session and kept only where clearly faster and in
agreement. Always in f32 (``INFERENCE_PRECISION_HINT``): on CPUs with bf16 or f16 units the
plugin's default would trade accuracy for speed, which a drop-in for ONNX Runtime must not.

openvino is an optional dependency (the ``openvino`` extra), imported only when a runner
is made; without it ``unavailable()`` says why and nothing else changes.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import io
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusegraph.errors import UnsupportedError
from fusegraph.runtime import cache_limit

log = logging.getLogger("fusegraph.onnx")

NAME = "openvino"
LABEL = "OpenVINO (CPU plugin, f32)"
CACHE_SUBDIR = "openvino"  # OpenVINO's compiled-model cache, under fusegraph's cache directory


class OpenVinoUnavailable(UnsupportedError):
    """OpenVINO is not installed or cannot take the model; the message says why."""


def unavailable() -> str | None:
    """Why no OpenVINO runner can be made here (None: it can), without importing openvino."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (pip install 'fusegraph[openvino]')"
    return None


def version() -> str:
    """openvino's version, for the floor's verdict keys (cheap: package metadata)."""
    try:
        return f"openvino {md.version('openvino')}"
    except md.PackageNotFoundError:
        return "no openvino"


def config(threads: int = 0) -> dict[str, Any]:
    """The compile configuration: latency (one stream, every core), f32 throughout, no
    dynamic quantization; ``threads`` > 0 caps the inference threads (the caller's
    ``intra_op_num_threads``)."""
    out: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                           "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    if threads > 0:
        out["INFERENCE_NUM_THREADS"] = threads
    return out


class OpenVinoRunner:
    """A compiled model and one inference request. ``run`` takes the feed by input name and
    returns the wanted outputs as NumPy arrays of their own (the request's buffers are
    reused by the next call); calls are serialized (one request), as a session's are
    where the caller does not run it from several threads."""

    name = NAME
    label = LABEL

    def __init__(self, model: str | bytes, shapes: Mapping[str, Sequence[int]] | None = None, *,
                 threads: int = 0, cache_dir: str | Path | None = None) -> None:
        why = unavailable()
        if why:
            raise OpenVinoUnavailable(why)
        import openvino as ov

        core = ov.Core()
        if cache_dir is not None:
            try:
                Path(cache_dir).mkdir(parents=True, exist_ok=True)
                core.set_property({"CACHE_DIR": str(cache_dir)})
            except (OSError, RuntimeError) as exc:  # a cold compile each time, nothing worse
                log.info("OpenVINO's model cache is off (%s)", exc)
        try:
            source: Any = io.BytesIO(model) if isinstance(model, bytes) else str(model)
            ov_model = core.read_model(source)
            if shapes:
                ov_model.reshape({k: list(v) for k, v in shapes.items()})
            if any(p.get_partial_shape().is_dynamic for p in ov_model.inputs):
                raise OpenVinoUnavailable("the model's input shapes are dynamic (OpenVINO is measured on static shapes only)")
            self._compiled = core.compile_model(ov_model, "CPU", config(threads))
        except OpenVinoUnavailable:
            raise
        except Exception as exc:  # OpenVINO's refusal (an op it cannot convert, ...) is a reason
            raise OpenVinoUnavailable(f"OpenVINO cannot compile the model: {_first_lines(exc)}") from None
        if cache_dir is not None and Path(cache_dir).name == "openvino":  # fusegraph's own cache
            # OpenVINO reads its blobs itself (their mtime is their write): evicted oldest first
            cache_limit.enforce(Path(cache_dir).parent)
        self._request = self._compiled.create_infer_request()
        self._lock = threading.Lock()
        # A port may carry several tensor names (an input aliased by an internal value, as in
        # GPT-2's export): each input is matched to the feed by whichever of its names it has.
        self._input_names = [p.get_names() for p in self._compiled.inputs]
        self._order: list[str] | None = None
        self._outputs = {}
        for p in self._compiled.outputs:
            for n in p.get_names():
                self._outputs[n] = p
        self.output_names = [p.get_any_name() for p in self._compiled.outputs]

    @property
    def threads(self) -> int:
        return int(self._compiled.get_property("INFERENCE_NUM_THREADS"))

    def run(self, wanted: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any = None) -> list[np.ndarray]:
        names = list(wanted) if wanted else self.output_names
        if self._order is None:
            self._order = [next((n for n in sorted(names) if n in feed), min(names)) for names in self._input_names]
        inputs = {k: np.ascontiguousarray(feed[n]) for k, n in enumerate(self._order)}
        with self._lock:  # inputs shared, not copied: the call waits for the request to finish
            self._request.start_async(inputs, share_inputs=True)
            self._request.wait()
            return [np.array(self._request.get_tensor(self._outputs[n]).data, copy=True) for n in names]


def _first_lines(exc: BaseException, n: int = 4) -> str:
    """OpenVINO's messages start with C++ source locations; the summary lines say why."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return " ".join((useful or lines or [type(exc).__name__])[:n])[:400]

"""Reduced precision for the regions of a claimed unit (the ``precision`` provider option,
issue 24 item 4).

fp16 and bf16 are a property of each region's graph: its float32 tensors (inputs, outputs,
intermediates, scalar constants) become the reduced type, so every engine and the
incumbent build and time the same reduced computation, and the region's verdict has a key
of its own. Weights are cast once when the unit is built; activations are cast where they
cross into a region of another type; the unit's outputs are cast back to the model's
declared type. A region that would overflow in fp16 keeps float32, with the reason:
a softmax whose input is not scaled (exp of unscaled logits is where attention overflows),
a scalar constant or an observed value beyond fp16's range (with headroom: the sample
inputs are not the user's). bf16 has float32's range, so only non-finite observations
refuse it. tf32 keeps float32 storage and allows TF32 tensor-core products (torch's
backend flags while the unit runs, the ``tf32`` knob where an engine has one).

Why a module: the region path (plan_regions.py) asks three questions -- which type, may
this region take it, how far is the result from float32 -- and their answers are numeric
policy, kept in one place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusegraph.dtypes import DataType
from fusegraph.graph.graph import Graph
from fusegraph.graph.ops import OpKind, PointwiseAttrs, PointwiseMode
from fusegraph.graph.serialize import graph_from_dict, graph_to_dict

FP16_MAX = 65504.0
# Observed values must stay this many times inside fp16's range: the sample inputs are
# random normal, not the user's data, and an intermediate may grow with its inputs.
HEADROOM = 4.0
# Relative error (||a-b||/||b||) two implementations of one reduced-precision region may
# differ by and still agree (the project's per-dtype tolerances): the region floor's trial
# run uses it in place of the float32 bar (1e-3).
AGREE = {"fp16": 1e-2, "bf16": 2e-2, "tf32": 1e-2}  # TF32 keeps fp16's 10-bit mantissa in products

_TYPES = {"fp16": DataType.HALF, "bf16": DataType.BFLOAT16}
# Ports whose float32 type is the op's own (graph.OWN_TYPE_PORTS): kept float32.
_OWN = {OpKind.SDPA: "stats"}
# Ops a softmax input passes through unchanged in magnitude.
_MOVEMENT = {OpKind.RESHAPE, OpKind.TRANSPOSE}
_NORMS = {OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.BATCHNORM_INFERENCE}


@dataclass(frozen=True)
class Precision:
    """The session's precision option, as the region path uses it."""

    name: str = "fp32"

    @property
    def reduced(self) -> DataType | None:
        """The storage type of fp16 / bf16; None for fp32 and tf32 (float32 storage)."""
        return _TYPES.get(self.name)

    @property
    def tf32(self) -> bool:
        return self.name == "tf32"

    @property
    def agree(self) -> float | None:
        """The trial run's tolerance for a region in this precision (None: the float32 one)."""
        return AGREE.get(self.name)


def convert(graph: Graph, dtype: DataType) -> Graph:
    """``graph`` with its float32 tensors (scalars included) in ``dtype``, validated; the
    op's own float32 outputs (attention statistics) stay float32."""
    d = graph_to_dict(graph)
    own = {n["outputs"][port] for n in d["nodes"] for kind, port in _OWN.items()
           if n["op"] == kind.value and port in n["outputs"]}
    for t in d["tensors"]:
        if t.get("data_type") == DataType.FLOAT.value and t["name"] not in own:
            t["data_type"] = dtype.value
            if "data_type" not in t["set"]:
                t["set"] = [*t["set"], "data_type"]
    for k in ("io_data_type", "intermediate_data_type"):
        if d.get(k) == DataType.FLOAT.value:
            d[k] = dtype.value
    d["name"] = f"{d.get('name') or 'graph'}.{dtype.value}"
    return graph_from_dict(d).validate()


def refusal(graph: Graph, inputs: tuple[str, ...], outputs: tuple[str, ...], observed: Mapping[str, float],
            precision: Precision, parent: Graph | None = None, label: Mapping[str, str] | None = None) -> str:
    """Why the region ``graph`` (its in0.. / out0.. standing for the tensors ``inputs`` /
    ``outputs`` of the unit's graph ``parent``) keeps float32 in ``precision``; '' where it
    may take the reduced type. ``observed``: the largest magnitude each parent tensor took
    on the sample inputs; ``label``: the model's node name of a unit graph's node (for messages)."""
    dtype = precision.reduced
    if dtype is None:
        return ""
    if not any(t.dtype == DataType.FLOAT for t in graph.tensors):
        return ""  # nothing float32 to convert (integer shape arithmetic, a float16 model)
    names = {f"in{i}": p for i, p in enumerate(inputs)} | {f"out{j}": p for j, p in enumerate(outputs)}
    for p in names.values():
        v = observed.get(p)
        if v is not None and not math.isfinite(v):
            return f"a non-finite value was observed at '{p}' in float32"
    if dtype != DataType.HALF:
        return ""
    limit = FP16_MAX / HEADROOM
    for p in names.values():
        v = observed.get(p)
        if v is not None and v > limit:
            return (f"values up to {v:.3g} were observed at '{p}' on the sample inputs; fp16 holds "
                    f"{FP16_MAX:g} and {HEADROOM:g}x headroom is required")
    for t in graph.tensors:
        if t.is_scalar and t.dtype == DataType.FLOAT and isinstance(t.value, float) and math.isfinite(t.value) \
                and abs(t.value) > FP16_MAX:
            return f"the constant {t.value:g} is beyond fp16's range ({FP16_MAX:g})"
    for n in graph.nodes:
        if n.kind == OpKind.SOFTMAX:
            why = _unscaled([(graph, names), (parent, {})] if parent is not None else [(graph, names)],
                            n.inputs["x"].name, label or {})
            if why:
                return f"softmax: {why}; fp16 logits may overflow"
    return ""


def _unscaled(graphs: list[tuple[Graph, Mapping[str, str]]], name: str, label: Mapping[str, str]) -> str:
    """'' where the softmax input ``name`` is scaled or normalized before it -- a Mul / Div
    by a constant or a norm, looked for through data movement and added masks, in the region
    and on into the unit's graph (``graphs``: the region with its names in the unit, then the
    unit's graph) -- else why not."""
    for graph, up in graphs:
        producers = {t.name: n for n in graph.nodes for t in n.outputs.values()}
        for _ in range(32):
            n = producers.get(name)
            if n is None:
                break
            if n.kind in _NORMS:
                return ""
            ins = list(n.inputs.values())
            if n.kind in _MOVEMENT:
                name = ins[0].name
                continue
            if not isinstance(n.attrs, PointwiseAttrs):
                return f"its input comes from {n.kind.value} '{label.get(n.name, n.name)}' without a scale"
            mode = n.attrs.mode
            if mode in (PointwiseMode.MUL, PointwiseMode.DIV) and any(t.is_scalar for t in ins):
                return ""
            if mode in (PointwiseMode.ADD, PointwiseMode.SUB, PointwiseMode.IDENTITY):
                name = ins[0].name  # a mask or a bias added to the logits: look at the logits
                continue
            return f"its input comes from pointwise {mode.value} '{label.get(n.name, n.name)}' without a scale"
        if name not in up:
            break
        name = up[name]
    return "its input is not scaled or normalized before it (it comes from outside the unit)"


@contextlib.contextmanager
def tf32_allowed(on: bool, *, force: bool = False) -> Iterator[None]:
    """torch's TF32 flags on while the region unit builds or runs (restored after; no-op
    where ``on`` is False -- unless ``force``, which sets them off -- or torch is absent).
    Plans that pin their own numerics (the torch engine's convolutions and matmuls on a GPU)
    set theirs inside."""
    if not on and not force:
        yield
        return
    try:
        import torch
    except ImportError:
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def max_abs(value: Any) -> float:
    """The largest magnitude in a torch tensor or array (inf / nan where present); 0 for
    non-float values."""
    if type(value).__module__.startswith("torch"):
        if not value.is_floating_point() or value.numel() == 0:
            return 0.0
        return float(value.detach().abs().max().float().item()) if bool(value.isfinite().all()) else math.inf
    arr = np.asarray(value)
    if arr.dtype.kind != "f" or arr.size == 0:
        return 0.0
    return float(np.abs(arr).max()) if np.isfinite(arr).all() else math.inf


@dataclass(frozen=True)
class Accuracy:
    """The reduced unit against its float32 path on the same sample inputs."""

    rel: float  # max over outputs of ||got - want|| / ||want||
    max_abs: float  # max over outputs of max |got - want|
    max_rel: float  # max over outputs of max |got - want| / max |want|

    def describe(self) -> str:
        return (f"against the float32 path on the unit's sample inputs: relative error {self.rel:.2e} "
                f"(max abs {self.max_abs:.2e}, max abs / max |fp32| {self.max_rel:.2e})")


def accuracy(got: Mapping[str, Any], want: Mapping[str, Any]) -> Accuracy:
    """``got`` against ``want`` (same keys), in float64; non-finite results are infinitely far."""
    rel = mabs = mrel = 0.0
    for k, w in want.items():
        g = _f64(got[k])
        wv = _f64(w)
        if g.shape != wv.shape or not np.isfinite(g).all():
            return Accuracy(math.inf, math.inf, math.inf)
        if g.size == 0:
            continue
        diff = np.abs(g - wv)
        scale = float(np.abs(wv).max())
        rel = max(rel, float(np.linalg.norm(diff) / max(float(np.linalg.norm(wv)), 1e-30)))
        mabs = max(mabs, float(diff.max()))
        mrel = max(mrel, float(diff.max()) / max(scale, 1e-30))
    return Accuracy(rel, mabs, mrel)


def _f64(value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        return np.asarray(value.detach().to("cpu").double().numpy())
    return np.asarray(value, dtype=np.float64)


__all__ = ["AGREE", "FP16_MAX", "HEADROOM", "Accuracy", "Precision", "accuracy", "convert", "max_abs", "refusal",
           "tf32_allowed"]

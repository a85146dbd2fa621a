"""Provider options of the FusegraphExecutionProvider, parsed and validated.

Like ONNX Runtime's provider options, values may arrive as strings ("1", "cuda:0",
"Conv,Gemm"); an unknown option or a bad value raises ValueError naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fusegraph.errors import OptionError
from fusegraph.runtime.handle import parse_device

PROVIDER = "FusegraphExecutionProvider"
TIERS = ("off", "on", "auto")
LAYOUTS = ("auto", "on", "off")
FLOOR_MODES = ("background", "inline")
FLOOR_MODE_ENV = "FUSEGRAPH_FLOOR_MODE"  # the default of floor_mode (the test suite sets inline)
# Whole-model runners the floor may measure against the caller's ONNX Runtime session
# (fusegraph.onnx.floor.RUNNERS). ``auto`` holds the one that won on the corpus here
# (docs/models.md, "Whole-model runners"): OpenVINO's CPU plugin was slower than ONNX Runtime
# without spinning on 16 of 17 models, so it is opt-in (``runners=openvino``).
RUNNER_NAMES = ("openvino", "ort-nospin")
AUTO_RUNNERS = ("ort-nospin",)
# The machine's load class, part of a whole-model runner's verdict key: which ONNX Runtime
# configuration wins depends on it (without spinning: 0.62x the default beside other work,
# 1.11x on a quiet machine; docs/models.md), so a verdict taken in one class never decides
# for the other. "auto" reads it at session creation (floor.machine_load).
LOADS = ("auto", "quiet", "busy")
# Claimed units split into regions, each on the engine that wins it against the same nodes op
# by op on PyTorch (plan_regions.py): "auto" on a GPU only, "on" on the CPU too.
REGIONS = ("auto", "on", "off")
# The precision claimed regions run in (precision.py): fp32 as exported, fp16 / bf16 storage
# and compute (weights cast once, activations at region boundaries, outputs in the model's
# declared type), tf32: fp32 storage with TF32 tensor-core matmuls / convolutions allowed.
PRECISIONS = ("fp32", "fp16", "bf16", "tf32")
# How float32 x float32 matmuls of an fp32 session's regions on CUDA may run (region_choice.py):
# "auto" also builds each torch-engine region holding one with the engine's fp32_matmul=bf16x3
# knob (three bf16 tensor-core products, ~5e-6 relative on the H200) and keeps it only where
# it beats the incumbent; "ieee" keeps float32 products as declared.
FP32_MATMULS = ("auto", "ieee")


@dataclass(frozen=True)
class ProviderOptions:
    device: str = "cpu"  # "cpu", "cuda", "cuda:N"
    engine: str | None = None  # engine for claimed subgraphs; None = best available, "auto" = selection layer
    min_subgraph_size: int = 1  # claimed subgraphs with fewer nodes run on ONNX Runtime
    op_types_to_exclude: tuple[str, ...] = ()  # never claimed
    strict: bool = False  # a claimed subgraph that fails to compile is an error, not a fallback
    cache_dir: str | None = None  # compile cache of the engines (and of the torch-mlir tier)
    dump_dir: str | None = None  # partition report, sub-models and graphs are written here
    lazy_compile: bool = False  # compile claimed subgraphs at their first run
    torch_mlir_tier: str = "auto"  # unclaimed regions through IREE's ONNX importer: off / on / auto (where it wins)
    channels_last: str = "auto"  # activations NHWC inside partitions with convolutions / pooling
    autotune: float = 0.0  # seconds per claimed subgraph to time engine configs at creation (0: off)
    floor: str = "auto"  # claimed subgraphs timed against ONNX Runtime: auto / on / off / a budget in seconds
    # where the floor measures a model it has no verdict for: "background" (the session runs
    # ONNX Runtime meanwhile; background.py) or "inline" (at session creation)
    floor_mode: str = field(default_factory=lambda: _floor_mode(os.environ.get(FLOOR_MODE_ENV, "background")))
    # whole-model runners timed against ONNX Runtime with the floor: auto, off, or names (RUNNER_NAMES)
    runners: str = "auto"
    # the load class whole-model runner verdicts are taken and looked up under: auto / quiet / busy
    load: str = "auto"
    regions: str = "auto"  # claimed units run region by region (plan_regions.py): auto (GPU) / on / off
    # the precision of the claimed regions (precision.py); anything but fp32 needs the region path
    precision: str = "fp32"
    # float32 matmuls on CUDA: auto (the bf16x3 split where it measures faster) / ieee
    fp32_matmul: str = "auto"

    def runner_candidates(self) -> tuple[str, ...]:
        """The whole-model runners the floor measures (none with ``runners=off``)."""
        if self.runners == "auto":
            return AUTO_RUNNERS
        if self.runners == "off":
            return ()
        return tuple(self.runners.split(","))

    def floor_budget(self, *, pinned: bool) -> float:
        """Seconds the floor may spend timing (0: off). ``auto`` is on unless an engine is
        pinned (a pinned engine is the caller's explicit choice)."""
        if self.floor == "auto":
            return 0.0 if pinned else DEFAULT_FLOOR_S
        if self.floor == "on":
            return DEFAULT_FLOOR_S
        if self.floor == "off":
            return 0.0
        return float(self.floor)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> ProviderOptions:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise OptionError(
                f"unknown {PROVIDER} option(s) {unknown}; known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        if "device" in raw:
            dev = str(raw["device"]).strip().lower()
            try:
                parse_device(dev)
            except ValueError as exc:
                raise OptionError(f"{PROVIDER} option device={raw['device']!r}: {exc}") from None
            values["device"] = dev
        if "engine" in raw:
            e = raw["engine"]
            values["engine"] = None if e is None or str(e).strip() == "" else str(e).strip()
        if "min_subgraph_size" in raw:
            values["min_subgraph_size"] = _int(raw["min_subgraph_size"], "min_subgraph_size", lo=1)
        if "op_types_to_exclude" in raw:
            v = raw["op_types_to_exclude"]
            items = v.split(",") if isinstance(v, str) else list(v or [])
            values["op_types_to_exclude"] = tuple(sorted({str(s).strip() for s in items if str(s).strip()}))
        for flag in ("strict", "lazy_compile"):
            if flag in raw:
                values[flag] = _bool(raw[flag], flag)
        for path in ("cache_dir", "dump_dir"):
            if path in raw:
                values[path] = str(raw[path]) if raw[path] not in (None, "") else None
        if "torch_mlir_tier" in raw:
            values["torch_mlir_tier"] = _choice(raw["torch_mlir_tier"], "torch_mlir_tier", TIERS)
        if "autotune" in raw:
            values["autotune"] = _budget(raw["autotune"])
        if "floor" in raw:
            values["floor"] = _floor(raw["floor"])
        if "floor_mode" in raw:
            values["floor_mode"] = _floor_mode(raw["floor_mode"])
        if "channels_last" in raw:
            values["channels_last"] = _choice(raw["channels_last"], "channels_last", LAYOUTS)
        if "runners" in raw:
            values["runners"] = _runners(raw["runners"])
        if "load" in raw:
            values["load"] = _choice(raw["load"], "load", LOADS)
        if "regions" in raw:
            values["regions"] = "auto" if str(raw["regions"]).strip() == "" else _choice(raw["regions"], "regions", REGIONS)
        if "precision" in raw:
            values["precision"] = _precision(raw["precision"], values.get("regions", "auto"))
        if "fp32_matmul" in raw:
            v = raw["fp32_matmul"]
            values["fp32_matmul"] = "auto" if str(v).strip() == "" else _choice(v, "fp32_matmul", FP32_MATMULS)
        return cls(**values)

    def as_strings(self) -> dict[str, str]:
        """As ONNX Runtime reports provider options: every value a string."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                out[f.name] = "1" if v else "0"
            elif isinstance(v, float):
                out[f.name] = f"{v:g}"
            elif isinstance(v, tuple):
                out[f.name] = ",".join(v)
            else:
                out[f.name] = "" if v is None else str(v)
        return out


DEFAULT_AUTOTUNE_S = 60.0
DEFAULT_FLOOR_S = 30.0  # fusegraph.onnx.floor.DEFAULT_BUDGET_S (kept here: options import nothing above)


def _floor(v: Any) -> str:
    """auto, on (1), off (0), or a positive budget in seconds."""
    s = str(v).strip().lower()
    alias = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "auto"}
    s = alias.get(s, s)
    if s in ("auto", "on", "off"):
        return s
    try:
        f = float(s)
    except ValueError:
        raise OptionError(f"{PROVIDER} option floor={v!r}: expected auto, on, off or a budget in seconds") from None
    if not f > 0 or f == float("inf"):
        raise OptionError(f"{PROVIDER} option floor={v!r}: expected auto, on, off or a budget in seconds")
    return f"{f:g}"


def _runners(v: Any) -> str:
    """auto, off (0, none), or a comma-separated list of RUNNER_NAMES."""
    if isinstance(v, str) and not v.strip():
        return "auto"  # as ONNX Runtime reports an unset option
    items = v.split(",") if isinstance(v, str) else list(v or [])
    names = [str(s).strip().lower() for s in items if str(s).strip()]
    if not names or (len(names) == 1 and names[0] in ("0", "off", "none", "false", "no")):
        return "off"  # an empty list: no runner
    if len(names) == 1 and names[0] in ("auto", "1", "on", "true", "yes"):
        return "auto"
    bad = [n for n in names if n not in RUNNER_NAMES]
    if bad:
        raise OptionError(f"{PROVIDER} option runners={v!r}: unknown {bad}; expected auto, off or names "
                         f"among {list(RUNNER_NAMES)}")
    return ",".join(dict.fromkeys(names))


def _precision(v: Any, regions: str) -> str:
    """fp32 (also float32, ''), fp16 (half, float16), bf16 (bfloat16) or tf32; reduced
    precision is a property of the region path, so ``regions=off`` refuses it."""
    s = str(v).strip().lower()
    alias = {"": "fp32", "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
             "bfloat16": "bf16"}
    s = alias.get(s, s)
    if s not in PRECISIONS:
        raise OptionError(f"{PROVIDER} option precision={v!r}: expected one of {list(PRECISIONS)}")
    if s != "fp32" and regions == "off":
        raise OptionError(f"{PROVIDER} option precision={v!r} needs the region path (regions=auto or on), "
                         "but regions=off")
    return s


def _floor_mode(v: Any) -> str:
    s = str(v).strip().lower()
    if s not in FLOOR_MODES:
        raise OptionError(f"{PROVIDER} option floor_mode={v!r}: expected one of {list(FLOOR_MODES)}")
    return s


def _budget(v: Any) -> float:
    """0 / off, 1 / on (the default budget), or a budget in seconds."""
    s = str(v).strip().lower()
    if s in ("", "0", "off", "false", "no"):
        return 0.0
    if s in ("on", "true", "yes", "1"):
        return DEFAULT_AUTOTUNE_S
    try:
        f = float(s)
    except ValueError:
        raise OptionError(f"{PROVIDER} option autotune={v!r}: expected 0/1 or a budget in seconds") from None
    if f < 0 or f != f:
        raise OptionError(f"{PROVIDER} option autotune={v!r}: expected 0/1 or a budget in seconds")
    return f


def _int(v: Any, name: str, lo: int) -> int:
    try:
        i = int(str(v).strip()) if not isinstance(v, int) else v
    except ValueError:
        raise OptionError(f"{PROVIDER} option {name}={v!r}: expected an integer") from None
    if isinstance(v, bool) or i < lo:
        raise OptionError(f"{PROVIDER} option {name}={v!r}: expected an integer >= {lo}")
    return i


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise OptionError(f"{PROVIDER} option {name}={v!r}: expected 0/1 (or true/false)")


def _choice(v: Any, name: str, choices: tuple[str, ...]) -> str:
    s = str(v).strip().lower()
    alias = {"1": "on", "true": "on", "0": "off", "false": "off"}
    s = alias.get(s, s)
    if s not in choices:
        raise OptionError(f"{PROVIDER} option {name}={v!r}: expected one of {list(choices)}")
    return s

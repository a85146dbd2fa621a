"""Compile flag sets: the IREE engine's compiler knobs and a measured default per target.

Flags change CPU speed by 2x or more (docs/iree_engine.md), so they are knobs that
the autotuner searches, not constants. A FlagSet is a small frozen value: it renders to
the exact iree-compile flags and is part of the cache key.

CPU default, from ``benchmarks/bench_iree_cpu.py --flags`` (2 shared Zen 4 cores; 8 ResNet-50
conv shapes, conv+bias+ReLU, GEMM 256/1024, layernorm, a 6-op chain; docs/iree_engine.md):
O2 with data tiling and IREE's default ukernel choice. Data tiling is what makes matmul-like
work competitive (GEMM 1024^3 best-of 8.6 ms vs 54 ms without); ukernels "all"/"mmt4d" and
O3 were not better in geomean (and noisier); O1 compiled a little faster (median 0.55 vs
0.74 s) but ran slower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from fusegraph.engines.base import Knob
from fusegraph.engines.iree.targets import Target

OPT_LEVELS = ("O0", "O1", "O2", "O3")
UKERNELS = ("default", "none", "mmt4d", "all")


@dataclass(frozen=True)
class FlagSet:
    """The engine's compiler settings (target selection lives in targets.py)."""

    opt_level: str = "O2"
    data_tiling: bool = False
    ukernels: str = "default"
    aggressive_fusion: bool = False
    fuse_padding: bool = False
    extra_flags: tuple[str, ...] = ()

    def flags(self, target: Target) -> tuple[str, ...]:
        """The iree-compile flags for this set on ``target`` (target flags first)."""
        out = [*target.flags(), f"--iree-opt-level={self.opt_level}"]
        out.append(f"--iree-opt-data-tiling={'true' if self.data_tiling else 'false'}")
        if self.ukernels != "default":
            if target.kind == "cpu":
                out.append(f"--iree-llvmcpu-enable-ukernels={self.ukernels}")
            elif target.kind == "hip":
                out.append(f"--iree-rocm-enable-ukernels={self.ukernels}")
        if self.aggressive_fusion:
            out.append("--iree-dispatch-creation-enable-aggressive-fusion")
        if self.fuse_padding:
            out.append("--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops")
        out.extend(self.extra_flags)
        return tuple(out)

    def as_knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Measured defaults (see the module docstring). GPU rows: IREE's own defaults until the
# lead's H200 runs of benchmarks/bench_iree_gpu.py say otherwise.
DEFAULTS: dict[str, FlagSet] = {
    "cpu": FlagSet(opt_level="O2", data_tiling=True, ukernels="default"),
    "cuda": FlagSet(opt_level="O2"),
    "hip": FlagSet(opt_level="O2"),
}


def default_flagset(target: Target) -> FlagSet:
    return DEFAULTS[target.kind]


def flag_knobs(target: Target) -> list[Knob]:
    """The flag knobs for a target, with the target's default as each knob's default."""
    d = default_flagset(target)
    knobs = [
        Knob("opt_level", d.opt_level, OPT_LEVELS, description="IREE global optimization level (--iree-opt-level)"),
        Knob("data_tiling", d.data_tiling, (False, True), description="pack matmul/conv operands into tiled layouts (--iree-opt-data-tiling)"),
        Knob("aggressive_fusion", d.aggressive_fusion, (False, True), description="--iree-dispatch-creation-enable-aggressive-fusion"),
        Knob("fuse_padding", d.fuse_padding, (False, True), description="fuse a convolution's zero padding into its dispatch (--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops)"),
        Knob("extra_flags", d.extra_flags, description="more iree-compile flags, appended as given (a tuple of strings)"),
    ]
    if target.kind in ("cpu", "hip"):
        knobs.insert(2, Knob("ukernels", d.ukernels, UKERNELS, description="IREE microkernels (--iree-llvmcpu-enable-ukernels)"))
    return knobs


def flagset_from_knobs(target: Target, knobs: Mapping[str, Any]) -> FlagSet:
    """The FlagSet for knob values (missing knobs keep the target's default); checks values."""
    table = {k.name: k for k in flag_knobs(target)}
    values: dict[str, Any] = {}
    for name, value in knobs.items():
        knob = table.get(name)
        if knob is None:
            continue
        if name == "extra_flags":
            if isinstance(value, str):
                value = tuple(value.split())
            if not isinstance(value, tuple | list) or not all(isinstance(f, str) for f in value):
                raise ValueError(f"knob 'extra_flags': expected a tuple of strings, got {value!r}")
            value = tuple(value)
        else:
            knob.check(value)
        values[name] = value
    return replace(default_flagset(target), **values)

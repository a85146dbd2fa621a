"""Heuristics: rank (engine, knob config) candidates for a graph without running anything.

The built-in rules are a small decision table over graph features (which op classes the
graph has, how much work it is) and the device kind. Every rule names the benchmark
numbers it comes from; docs/engines.md has the table and the data. Plugins from the
``fusegraph.heuristics`` entry points are consulted first (modes A and B) and may abstain.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusegraph.engines.base import Engine, EngineConfig, Knob
from fusegraph.engines.heuristic import Heuristic as Heuristic  # the plugin interface, re-exported
from fusegraph.graph.graph import Graph
from fusegraph.graph.node import Node
from fusegraph.graph.ops import CONVOLUTIONS, DATA_MOVEMENT, NORM_BACKWARD, NORMS, OpKind
from fusegraph.runtime.handle import Handle
from fusegraph.select.modes import HeurMode

log = logging.getLogger("fusegraph.select")

COMPUTE_OPS = CONVOLUTIONS | {OpKind.MATMUL, OpKind.SDPA, OpKind.SDPA_BACKWARD}
REDUCE_OPS = NORMS | NORM_BACKWARD | {OpKind.REDUCTION, OpKind.SOFTMAX, OpKind.POOLING}
MAX_CONFIGS_PER_ENGINE = 32


# ---- graph features --------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphFeatures:
    kinds: frozenset[OpKind]
    n_nodes: int
    n_compute: int  # convolutions, matmuls, attention
    n_reduce: int  # reductions, norms, softmax, pooling
    n_pointwise: int
    n_data: int  # reshape / transpose / concat / slice
    flops: float  # multiply-adds x2 of the compute ops
    bytes: float  # graph input + output bytes

    @property
    def op_class(self) -> str:
        if self.n_compute:
            return "compute"
        if self.n_reduce:
            return "reduction"
        if self.n_pointwise:
            return "pointwise"
        return "data"


def _prod(xs: Sequence[int]) -> int:
    return math.prod(xs) if xs else 1


def features(graph: Graph) -> GraphFeatures:
    graph.ensure_valid()
    flops = 0.0
    n_compute = n_reduce = n_pw = n_data = 0
    for n in graph.nodes:
        if n.kind in COMPUTE_OPS:
            n_compute += 1
            flops += _node_flops(n)
        elif n.kind in REDUCE_OPS:
            n_reduce += 1
        elif n.kind == OpKind.POINTWISE:
            n_pw += 1
        elif n.kind in DATA_MOVEMENT:
            n_data += 1
    io = [*graph.inputs(), *graph.outputs()]
    nbytes = float(sum(_prod(t.shape) * t.dtype.itemsize for t in io))
    return GraphFeatures(frozenset(n.kind for n in graph.nodes), len(graph.nodes), n_compute, n_reduce, n_pw, n_data, flops, nbytes)


def _node_flops(n: Node) -> float:
    if n.kind == OpKind.MATMUL:
        c = n.outputs["c"].shape
        k = n.inputs["a"].shape[-1]
        return 2.0 * _prod(c) * k
    if n.kind in (OpKind.SDPA, OpKind.SDPA_BACKWARD):
        b, h, sq, d = n.inputs["q"].shape
        skv, dv = n.inputs["k"].shape[2], n.inputs["v"].shape[3]
        return 2.0 * b * h * sq * skv * (d + dv) * (2.5 if n.kind == OpKind.SDPA_BACKWARD else 1.0)
    # convolutions: every output element of fprop costs C/groups x kernel MACs
    if n.kind == OpKind.CONV_FPROP:
        y, w = n.outputs["y"].shape, n.inputs["w"].shape
    elif n.kind == OpKind.CONV_DGRAD:
        y, w = n.inputs["dy"].shape, n.inputs["w"].shape
    else:
        y, w = n.inputs["dy"].shape, n.outputs["dw"].shape
    # groups need no factor: the filter's second dim is already C / groups
    return 2.0 * _prod(y) * _prod(w[1:])


# ---- the built-in rule table -----------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """When ``device`` and ``op_class`` match (and the work is within bounds), prefer
    ``order``: engines with the knob values the rule sets (others keep their defaults)."""

    name: str
    device: str  # "gpu" | "cpu"
    op_classes: frozenset[str]
    order: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    why: str
    min_pointwise: int = 0
    max_pointwise: int = 10**9
    max_flops: float = math.inf
    min_flops: float = 0.0
    kinds: frozenset[OpKind] = frozenset()  # the graph must contain one of these (if any)


def _r(
    name: str,
    device: str,
    classes: str,
    order: Sequence[tuple[str, Mapping[str, Any]] | str],
    why: str,
    **bounds: Any,
) -> Rule:
    steps = tuple(
        (o, ()) if isinstance(o, str) else (o[0], tuple(sorted(o[1].items()))) for o in order
    )
    bounds["kinds"] = frozenset(bounds.get("kinds", ()))
    return Rule(name, device, frozenset(classes.split(",")), steps, why, **bounds)


COMPILE = {"compile": True}

# Read top to bottom; the first rule that matches decides the order of the engines it
# names; engines it does not name follow in registry order. Numbers: docs/engines.md.
RULES: tuple[Rule, ...] = (
    # GPU rules: H100 80GB, f16 I/O, f32 compute, NHWC, side by side in one process
    # (benchmarks/bench_gpu.py; docs/gpu.md). cudnn only runs graphs its check_support and a
    # built plan accept (a convolution or matmul with pointwise epilogues, norms, sdpa);
    # others fall through to the next engine named.
    _r("gpu.attention_long", "gpu", "compute", [("cudnn", {"heur_mode": "b"}), "torch", "iree"],
       "sdpa b2 h16 s8192 d128 f16: cuDNN's heuristic B 1.66 ms vs mode A's first plan 1.83 "
       "(full), 0.93 vs 1.03 (causal) on the H100; 1.66 vs 1.85 and 0.94 vs 1.06 on the H200; "
       "at s2048 the two are within 2%", kinds={OpKind.SDPA}, min_flops=5e11),
    _r("gpu.compute", "gpu", "compute", ["cudnn", "torch", "iree"],
       "H100: one fused cuDNN kernel for conv+bias+ReLU 0.037 ms vs eager 0.057 (n32 c64 56x56), "
       "0.146 vs 0.372 ms at n256; GEMM+bias+GELU 8192x4096x4096 0.411 vs 0.461 ms; sdpa "
       "causal s2048 0.266 vs 0.274 ms (flash); IREE 5.5-9x behind cuDNN/cuBLAS (H200)"),
    _r("gpu.norm_backward", "gpu", "reduction", ["cudnn", "triton", "torch", "iree"],
       "cuDNN's frontend publishes RMSNorm backward 16384x4096 bf16 at 0.106 ms on the H200 "
       "(PyTorch 0.223); the Triton kernel pair (engines/triton/norm_backward.py) is not measured "
       "yet: bench_gpu.py --group backward decides the order", kinds=NORM_BACKWARD),
    _r("gpu.reduction", "gpu", "reduction", ["triton", "cudnn", ("torch", COMPILE), "torch", "iree"],
       "H200 8192x4096 f16: a Triton row kernel runs layernorm+GELU in 0.059-0.064 ms vs cuDNN's "
       "fused 0.065-0.069 / eager 0.101, softmax 0.039 vs compile 0.080 / eager 0.109, plain "
       "layernorm and rmsnorm within 5% of cuDNN; pooling and rows past 16384 (triton refuses): "
       "cuDNN, then compile 0.081 / eager 0.11 / IREE 0.30 ms"),
    _r("gpu.pointwise_chain", "gpu", "pointwise", [("torch", COMPILE), "iree", "torch", "cudnn"],
       "H100 8-op chain 8192x4096: compile 0.10 / eager 0.49 ms; cuDNN has no engine for "
       "pointwise-only graphs; H200: IREE 0.28 ms", min_pointwise=3),
    _r("gpu.pointwise_short", "gpu", "pointwise,data", ["torch", "iree", "cudnn"],
       "1-2 pointwise ops are one or two bandwidth-bound eager kernels already; cuDNN has no "
       "engine for pointwise-only graphs"),
    _r("cpu.attention", "cpu", "compute", [("iree", {"attention": "decomposed"}), "torch"],
       "CPU sdpa 1x8x256x64 f32: IREE attention=decomposed 0.61-0.74 ms, torch 0.83-1.01 ms, "
       "IREE's default attention lowering 15-20 ms", kinds={OpKind.SDPA}),
    _r("cpu.conv", "cpu", "compute", ["torch", "iree"],
       "CPU f32 NHWC convs (+bias+ReLU): oneDNN via torch 0.41-0.59 ms vs IREE 0.58-1.22 ms "
       "(1.2-2.1x) on the four ResNet-50 shapes", kinds=CONVOLUTIONS),
    _r("cpu.matmul", "cpu", "compute", ["iree", "torch"],
       "CPU f32 GEMM 1024^3: IREE (data tiling) 10.9 ms vs torch 23.5 ms; 256^3: 0.17 vs "
       "0.18 ms", kinds={OpKind.MATMUL}),
    _r("cpu.reduction", "cpu", "reduction", ["torch", "iree"],
       "CPU layernorm+GELU 512x1024: torch 0.17 ms vs IREE 0.31 ms; softmax 0.13 vs 0.27 ms"),
    _r("cpu.pointwise", "cpu", "pointwise,data", ["iree", "torch"],
       "CPU 8-op pointwise chain 1024x1024: IREE 0.53 ms (one fused dispatch) vs torch "
       "eager 2.24 ms"),
)


def matching_rule(feat: GraphFeatures, handle: Handle) -> Rule | None:
    dev = "gpu" if handle.device.is_gpu else "cpu"
    for rule in RULES:
        if rule.device != dev or feat.op_class not in rule.op_classes:
            continue
        if not rule.min_pointwise <= feat.n_pointwise <= rule.max_pointwise:
            continue
        if not rule.min_flops <= feat.flops <= rule.max_flops:
            continue
        if rule.kinds and not rule.kinds & feat.kinds:
            continue
        return rule
    return None


def _valid_knobs(
    knobs: Sequence[Knob], wanted: tuple[tuple[str, Any], ...]
) -> tuple[tuple[str, Any], ...] | None:
    """The wanted knob values the engine really has for this graph; None if any is missing."""
    by_name = {k.name: k for k in knobs}
    out = []
    for name, value in wanted:
        k = by_name.get(name)
        if k is None:
            return None
        try:
            k.check(value)
        except (ValueError, TypeError):
            return None
        if value != k.default:
            out.append((name, value))
    return tuple(out)


def knob_configs(knobs: Sequence[Knob], limit: int = MAX_CONFIGS_PER_ENGINE) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of knob values (defaults first); range knobs try low, default, high;
    a knob that changes the numbers keeps its default."""
    names = [k.name for k in knobs]
    values: list[list[Any]] = []
    for k in knobs:
        if k.numerics:
            vals = [k.default]
        elif k.choices:
            vals = [k.default, *(c for c in k.choices if c != k.default)]
        elif k.range is not None:
            lo, hi = k.range
            cast = type(k.default)
            vals = list(dict.fromkeys([k.default, cast(lo), cast(hi)]))
        else:
            vals = [k.default]
        values.append(vals)
    out = []
    for combo in itertools.islice(itertools.product(*values), limit):
        out.append(tuple((n, v) for n, v, k in zip(names, combo, knobs, strict=True) if v != k.default))
    return out


def _config(engine: str, knobs: tuple[tuple[str, Any], ...]) -> EngineConfig:
    return EngineConfig(engine, tuple(sorted(knobs)))


class BuiltinHeuristic:
    """The rule table above (mode A) and its expansion over every knob setting (mode B)."""

    name = "builtin"

    def explain(self, graph: Graph, handle: Handle) -> str:
        feat = features(graph)
        rule = matching_rule(feat, handle)
        return f"{rule.name}: {rule.why}" if rule else "no rule matches; registry order"

    def rank(
        self, graph: Graph, handle: Handle, mode: HeurMode, engines: Sequence[Engine]
    ) -> list[EngineConfig]:
        by_name = {e.name: e for e in engines if e.name != "reference"}
        feat = features(graph)
        rule = matching_rule(feat, handle)
        firsts: list[EngineConfig] = []
        knob_cache: dict[str, Sequence[Knob]] = {}

        def knobs_of(name: str) -> Sequence[Knob]:
            if name not in knob_cache:
                try:
                    knob_cache[name] = list(by_name[name].knobs(graph, handle))
                except Exception as exc:  # a plugin's knobs() must not break selection
                    log.info("engine '%s' knobs() failed: %s", name, exc)
                    knob_cache[name] = []
            return knob_cache[name]

        if rule is not None:
            for name, wanted in rule.order:
                if name not in by_name:
                    continue
                # an engine's knobs are asked only when the rule sets one: knobs() may load its
                # library (a fresh process building a stored cuDNN plan spent 100 ms importing
                # the torch and IREE engines' modules for nothing)
                valid = _valid_knobs(knobs_of(name), wanted) if wanted else ()
                # a knob the engine lacks here (torch.compile without Triton...): its defaults
                cfg = _config(name, valid if valid is not None else ())
                if cfg not in firsts:
                    firsts.append(cfg)
        for name in by_name:
            if all(c.engine != name for c in firsts):
                firsts.append(EngineConfig(name))
        if mode != HeurMode.B:
            return firsts  # A: the rule's steps, then every other engine at its defaults
        out = list(firsts)
        for name in by_name:
            for combo in knob_configs(knobs_of(name)):
                cfg = _config(name, combo)
                if cfg not in out:
                    out.append(cfg)
        return out


BUILTIN = BuiltinHeuristic()


def fallback_configs(handle: Handle, engines: Sequence[Engine]) -> list[EngineConfig]:
    """FALLBACK: every engine with default knobs; the reference last and only on the CPU."""
    out = [EngineConfig(e.name) for e in engines if e.name != "reference"]
    if not handle.device.is_gpu and any(e.name == "reference" for e in engines):
        out.append(EngineConfig("reference"))
    return out

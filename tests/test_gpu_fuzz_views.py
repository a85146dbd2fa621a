"""The kernel engines (cudnn, triton) on region graphs whose border reshapes are folded into
views (fusegraph/regions/views.py), fuzzed on a GPU and compared with the float64 reference.

Both GPU front doors -- the ONNX provider's region path (onnx/region_choice.py ``folded``)
and the torch.compile backend (torch/plans.py) -- hand ``folded_kernel_plan`` region graphs
whose converters reshaped for the graph API: a layer or RMS norm over [B, S, F] as [B*S, F]
rows with its weight as [1, F], a linear layer's [B, S, K] activation as rows, ONNX's rank-3
attention as one head of [b, 1, s, d], a softmax of opset < 13 over rows. tests/
test_fuzz_views.py checks the folding with the reference engine only; here the folded plan
runs on the real kernel engines, fed torch CUDA tensors as the front doors feed it.

Two sources of graphs: ``draw_region`` draws the front doors' region shapes (float16,
bfloat16, float32; F from 1 to 4096, rows up to 8192, odd sizes; large magnitudes where
the op is stable), and the graph fuzzer's drawer (test_fuzz_graphs.draw_graph, as
test_fuzz_views runs it) adds the random graphs that fold. Each folded graph is built on
each kernel engine on its own (``engines=(name,)``: the heuristics' order would test only
the first that builds); a refusal is counted with its reason, never a failure, and the test
asserts that enough graphs reached each engine. Results are checked as the graph fuzzer
checks them (``Answers`` and ``tolerance`` of select/autotune.py); a mismatch or an error
at run time prints a reproducer: ``reproduce(graph_json, seed, scales, engine)`` below.

The CPU tests run the same drawing, folding and comparison with the reference engine
standing in for the kernel engine (and once with the torch engine on the CPU, fed torch
tensors through ``folded_kernel_plan`` as on the GPU), check the comparison catches a wrong
answer, and check from the engines' own pure-Python claims (triton's ``rows.analyze``,
cudnn's ``rules.refusal``) that the GPU case list gives each engine enough graphs to build.

GPU run (estimated at about a minute on an H100; the per-engine seconds are printed): ``python3 -m pytest -m gpu -q -s tests/test_gpu_fuzz_views.py``
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_graphs import draw_graph

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.engines.base import ExecutionPlan
from fusegraph.errors import FusegraphError, UnsupportedError
from fusegraph.graph.ops import NormFwdPhase, OpKind
from fusegraph.graph.tensor import TensorAttr
from fusegraph.reference.inputs import random_inputs
from fusegraph.regions.views import (
    KERNEL_ENGINES,
    FoldedPlan,
    fold_border_reshapes,
    folded_kernel_plan,
)
from fusegraph.select.autotune import Answers, tolerance
from fusegraph.select.partition import to_host

DEVICE = "cuda:0"
FAMILIES = ("layernorm_torch", "layernorm_onnx", "rmsnorm_torch", "rmsnorm_onnx", "softmax", "matmul",
            "attention", "attention_heads")
# How often each family is drawn; attention_heads keeps its transposes inside the folded
# graph (views.py folds reshapes only), so neither kernel engine takes it: a few check
# that it is refused cleanly.
WEIGHTS = (4, 3, 3, 2, 4, 4, 4, 1)
GPU_CASES = 56  # ~27 Triton kernels and ~31 cuDNN graphs to build (claims printed by the CPU test below)
CPU_CASES = 40
GPU_SEED, CPU_SEED = 20261127, 7
DRAWN = 900  # fuzzer graphs drawn; ~2-3% fold (test_fuzz_views)
# Graphs of the GPU case list each engine must build, overall and of some families, where
# the engines' pure-Python rules accept more (test_the_gpu_case_list_gives_each_engine_
# enough_graphs prints how many): cuDNN's heuristics may still turn down a shape or two.
MIN_BUILT = {"triton": 20, "cudnn": 18}
MIN_BUILT_FAMILY = {("cudnn", "attention"): 3, ("cudnn", "matmul"): 4, ("cudnn", "layernorm_onnx"): 3,
                    ("triton", "softmax"): 2, ("triton", "rmsnorm_torch"): 2, ("triton", "layernorm_torch"): 3}

Scales = dict[str, tuple[float, float]]  # input name -> (factor, offset) applied to its random values


@dataclass(frozen=True)
class Case:
    """One region graph and how its inputs are drawn."""

    family: str
    seed: int  # the input RNG's seed
    graph: fg.Graph
    scales: Scales = field(default_factory=dict)

    def reproducer(self, engine: str, extra: str = "") -> str:
        return (f"family {self.family}, engine {engine}, input seed {self.seed}, scales {self.scales!r}{extra}\n"
                f"reproduce: tests/test_gpu_fuzz_views.py reproduce(graph_json, seed={self.seed}, "
                f"scales={self.scales!r}, engine={engine!r})\ngraph_json = {self.graph.to_json()}")


# ---- drawing the front doors' region graphs ----------------------------------------------------
def _pick(rng: np.random.Generator, options: list[Any] | tuple[Any, ...]) -> Any:
    return options[int(rng.integers(len(options)))]


def _graph(style: str, name: str, dt: DataType) -> fg.Graph:
    """A graph typed as the front door's converter types it: the torch backend's graphs
    carry PyTorch's dtype as io and intermediate type and compute half-precision ops in
    float32; the ONNX importer's graphs type every tensor from its inputs."""
    if style == "torch":
        return fg.Graph(name, io_data_type=dt, intermediate_data_type=dt,
                        compute_data_type=DataType.FLOAT if dt != DataType.FLOAT else None)
    return fg.Graph(name)


def _rows_shape(rng: np.random.Generator, big: bool) -> tuple[int, int, int]:
    """(B, S, F): small and odd sizes, transformer sizes, and (``big``) up to 8192 x 4096."""
    tier = _pick(rng, ("small", "small", "medium", "medium", "large")) if big else _pick(rng, ("small", "small", "medium"))
    if tier == "small":
        return _pick(rng, (1, 2, 3)), _pick(rng, (1, 3, 7, 16)), _pick(rng, (1, 3, 5, 8, 17, 64))
    if tier == "medium" or not big:
        f = _pick(rng, (96, 128, 257, 768, 769, 1024)) if big else _pick(rng, (96, 128, 257, 769))
        return _pick(rng, (1, 2, 4)), _pick(rng, (8, 64, 127, 256) if big else (3, 8, 13)), f
    b, s = _pick(rng, ((8, 1024), (4, 2048), (2, 512), (1, 4096), (1, 77)))
    return b, s, _pick(rng, (1024, 2048, 4096))


def _magnitude(rng: np.random.Generator, limit: float) -> float:
    return min(limit, float(_pick(rng, (1.0, 1.0, 1.0, 16.0, 1000.0))))


def _epilogue(rng: np.random.Generator, g: fg.Graph, y: TensorAttr, dt: DataType) -> TensorAttr:
    """What follows a row op in a region: nothing, an activation, a scale by a constant,
    or a cast to float32 (each reads only the row op's result and scalars, so the reshape
    back to [B, S, F] before it moves past it to the border)."""
    kind = _pick(rng, ("none", "none", "gelu", "relu", "scale", "cast"))
    if kind == "gelu":
        return g.gelu(y)
    if kind == "relu":
        return g.relu(y)
    if kind == "scale":
        return g.mul(y, g.scalar(float(_pick(rng, (0.5, 2.0, -3.0))), DataType.FLOAT))
    if kind == "cast" and dt != DataType.FLOAT:
        return g.identity(y).set_data_type(DataType.FLOAT)
    return y


def _norm(rng: np.random.Generator, family: str, dt: DataType, big: bool) -> tuple[fg.Graph, Scales]:
    style = family.split("_")[1]
    rms = family.startswith("rms")
    g = _graph(style, family, dt)
    b, s, f = _rows_shape(rng, big)
    x = g.tensor("x", [b, s, f], data_type=dt)
    rows = g.reshape(x, [b * s, f])
    eps = float(_pick(rng, (1e-5, 1e-6, float(np.finfo(np.float32).eps))))

    def param(name: str) -> TensorAttr:
        if style == "onnx" and rng.random() < 0.5:  # a constant initializer, laid out [1, F] by the importer
            return g.tensor(name, [1, f], data_type=dt)
        return g.reshape(g.tensor(name, [f], data_type=dt), [1, f])

    # the torch backend converts aten's norms in the training phase (the statistics are
    # results); where nothing reads them their reshapes are dead. ONNX's are inference.
    train = style == "torch"
    read_stats = train and rng.random() < 0.5
    phase = NormFwdPhase.TRAINING if train else NormFwdPhase.INFERENCE
    stats: list[tuple[str, TensorAttr]] = []
    if rms:
        bias = param("b") if style == "onnx" and rng.random() < 0.3 else None
        y, inv = g.rmsnorm(rows, param("w"), eps, phase, bias=bias)
        if inv is not None:
            stats.append(("rstd", inv))
    else:
        y, mean, inv = g.layernorm(rows, param("w"), param("b"), eps, phase)
        if mean is not None and inv is not None:
            stats += [("mean", mean), ("rstd", inv)]
    for name, t in stats:  # PyTorch's CUDA norms keep their statistics in float32
        t.set_data_type(DataType.FLOAT)
        st_ = g.reshape(t, [b, s, 1]).set_data_type(DataType.FLOAT)
        if read_stats:
            st_.set_output(True).set_name(name)
    out = _epilogue(rng, g, g.reshape(y, [b, s, f]), dt)
    if style == "onnx" and rng.random() < 0.3:  # ViT's first norm: transposed for the attention after it
        out = g.transpose(out, [1, 0, 2])
    out.set_output(True).set_name("out")
    scale = _magnitude(rng, 1000.0)
    offset = float(_pick(rng, (0.0, 0.0, 3.0 * scale)))  # a mean several deviations off zero
    return g.validate(), {"x": (scale, offset)}


def _softmax(rng: np.random.Generator, dt: DataType, big: bool) -> tuple[fg.Graph, Scales]:
    """ONNX Softmax of opset < 13 over the last axis: rows, softmax, reshaped back; a
    scale before it (attention scores) and an epilogue after it at times."""
    g = _graph(_pick(rng, ("torch", "onnx")), "softmax", dt)
    b, s, f = _rows_shape(rng, big)
    x = g.tensor("x", [b, s, f], data_type=dt)
    rows = g.reshape(x, [b * s, f])
    if rng.random() < 0.4:
        rows = g.mul(rows, g.scalar(float(_pick(rng, (0.125, 0.5, 2.0))), DataType.FLOAT))
    y = g.softmax(rows, axis=1, log=bool(rng.random() < 0.3))
    _epilogue(rng, g, g.reshape(y, [b, s, f]), dt).set_output(True).set_name("out")
    return g.validate(), {"x": (_magnitude(rng, 1000.0), 0.0)}


def _matmul(rng: np.random.Generator, dt: DataType, big: bool) -> tuple[fg.Graph, Scales]:
    """A linear layer over [B, S, K] as rows: matmul by a [K, N] weight (row-major, or
    column-major as ONNX's constant "matrix" operands are laid out), + bias ([N], or [1, N]
    reshaped from it), + activation, reshaped back to [B, S, N]."""
    g = _graph(_pick(rng, ("torch", "onnx")), "matmul", dt)
    b, s, _ = _rows_shape(rng, big)
    if big and b * s >= 2048:
        sizes: tuple[int, ...] = (256, 768, 1024, 4096)
    elif big:
        sizes = (1, 3, 16, 64, 128, 257, 768, 1024)
    else:
        sizes = (1, 3, 8, 16, 33, 64)
    k, n = _pick(rng, sizes), _pick(rng, sizes)
    while b * s * k * n > 2**33:  # the float64 reference stays a few seconds at most
        k = max(1, k // 2)
    x = g.tensor("x", [b, s, k], data_type=dt)
    w = g.tensor("w", [k, n], [1, k] if rng.random() < 0.5 else [n, 1], data_type=dt)
    y = g.matmul(g.reshape(x, [b * s, k]), w)
    bias = _pick(rng, ("none", "vector", "row"))
    if bias == "vector":
        y = g.add(y, g.tensor("bias", [n], data_type=dt))
    elif bias == "row":
        y = g.add(y, g.reshape(g.tensor("bias", [n], data_type=dt), [1, n]))
    act = _pick(rng, ("none", "relu", "gelu", "gelu_tanh", "swish", "tanh"))
    if act != "none":
        acts: dict[str, Callable[[TensorAttr], TensorAttr]] = {
            "relu": g.relu, "gelu": g.gelu, "gelu_tanh": g.gelu_approx_tanh, "swish": g.swish, "tanh": g.tanh}
        y = acts[act](y)
    g.reshape(y, [b, s, n]).set_output(True).set_name("out")
    # f16 products of K up to 4096 stay far from its 65504 with |x| <= 16
    return g.validate(), {"x": (_magnitude(rng, 16.0 if dt == DataType.HALF else 1000.0), 0.0)}


def _attention(rng: np.random.Generator, dt: DataType, big: bool, heads: bool) -> tuple[fg.Graph, Scales]:
    """ONNX attention: the fused rank-3 node as one head ([b, s, d] -> [b, 1, s, d] and
    back; a [sq, skv] or [b, sq, skv] additive mask reshaped to four dims), or (``heads``)
    contrib Attention's [b, s, h*d] split into heads by a reshape and a transpose."""
    g = _graph("onnx", "attention", dt)
    b = _pick(rng, (1, 2, 4))
    sq = _pick(rng, (1, 3, 16, 64, 128, 256, 1024) if big else (1, 3, 16, 33))
    skv = sq if rng.random() < 0.6 else _pick(rng, (1, 7, 64, 128) if big else (1, 7, 16))
    d = _pick(rng, (8, 32, 64, 64, 128, 128, 20))
    dv = d if rng.random() < 0.8 else _pick(rng, (32, 64))
    causal = bool(rng.random() < 0.4)
    scale = _pick(rng, (None, 0.125, 0.5))
    if heads:
        h = _pick(rng, (2, 4))
        q, k, v = (g.tensor(nm, [b, s_, h * dd], data_type=dt) for nm, s_, dd in (("q", sq, d), ("k", skv, d), ("v", skv, dv)))
        q4, k4, v4 = (g.transpose(g.reshape(t, [b, t.dim[1], h, t.dim[2] // h]), [0, 2, 1, 3]) for t in (q, k, v))
        o = g.sdpa(q4, k4, v4, attn_scale=scale, causal=causal)
        g.reshape(g.transpose(o, [0, 2, 1, 3]), [b, sq, h * dv]).set_output(True).set_name("out")
        return g.validate(), {"q": (float(_pick(rng, (1.0, 4.0))), 0.0)}
    q = g.tensor("q", [b, sq, d], data_type=dt)
    k = g.tensor("k", [b, skv, d], data_type=dt)
    v = g.tensor("v", [b, skv, dv], data_type=dt)
    q4, k4, v4 = (g.reshape(t, [b, 1, t.dim[1], t.dim[2]]) for t in (q, k, v))
    mask = None
    if not causal and rng.random() < 0.4:
        m = g.tensor("mask", _pick(rng, ([sq, skv], [b, sq, skv])), data_type=dt)
        mask = g.reshape(m, [m.dim[0] if len(m.dim) == 3 else 1, 1, sq, skv])
    o = g.sdpa(q4, k4, v4, attn_scale=scale, causal=causal, mask=mask)
    g.reshape(o, [b, sq, dv]).set_output(True).set_name("out")
    return g.validate(), {"q": (float(_pick(rng, (1.0, 4.0))), 0.0)}


def draw_region(rng: np.random.Generator, family: str, dt: DataType, big: bool) -> tuple[fg.Graph, Scales]:
    """One region graph of ``family`` in io type ``dt`` (``big``: realistic sizes too)."""
    if family in ("layernorm_torch", "layernorm_onnx", "rmsnorm_torch", "rmsnorm_onnx"):
        return _norm(rng, family, dt, big)
    if family == "softmax":
        return _softmax(rng, dt, big)
    if family == "matmul":
        return _matmul(rng, dt, big)
    return _attention(rng, dt, big, heads=family == "attention_heads")


@functools.cache
def region_cases(count: int, seed: int, big: bool) -> tuple[Case, ...]:
    """The deterministic case list: families by WEIGHTS, float16 and bfloat16 twice as
    often as float32 (cuDNN takes matmuls and attention in half precision only)."""
    rng = np.random.default_rng(seed)
    p = np.asarray(WEIGHTS, np.float64) / sum(WEIGHTS)
    cases = []
    for i in range(count):
        family = FAMILIES[int(rng.choice(len(FAMILIES), p=p))]
        dt = _pick(rng, (DataType.HALF, DataType.HALF, DataType.BFLOAT16, DataType.BFLOAT16, DataType.FLOAT))
        graph, scales = draw_region(rng, family, dt, big)
        cases.append(Case(family, seed * 1000 + i, graph, scales))
    return tuple(cases)


@functools.cache
def drawn_cases(examples: int) -> tuple[Case, ...]:
    """The graph fuzzer's random graphs (derandomized, as test_fuzz_views draws them) that fold."""
    found: list[Case] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def draw(data: st.DataObject, seed: int) -> None:
        g, ops = draw_graph(data.draw, "reference")
        if fold_border_reshapes(g, transposes=True) is not None:
            found.append(Case("fuzz:" + "+".join(ops), seed, g))

    draw()
    return tuple(found)


# ---- running and comparing -------------------------------------------------------------------
def make_inputs(graph: fg.Graph, seed: int, scales: Mapping[str, tuple[float, float]]) -> dict[str, np.ndarray]:
    """Random inputs laid out as declared (random_inputs), the named ones scaled and shifted."""
    inputs = random_inputs(graph, np.random.default_rng(seed))
    for name, (factor, offset) in scales.items():
        arr = inputs[name]
        scaled = (arr.astype(np.float64) * factor + offset).astype(arr.dtype)
        out = np.empty_like(arr)  # keeps the declared strides (every scaled input is packed)
        out[...] = scaled
        inputs[name] = out
    return inputs


def to_device(graph: fg.Graph, inputs: Mapping[str, np.ndarray], device: str) -> dict[str, Any]:
    """The inputs as torch CUDA tensors in their declared layouts, as a front door feeds a plan."""
    import torch

    from fusegraph.engines.expanded_copy import copy_strided
    from fusegraph.engines.torch.convert import from_numpy

    out = {}
    for t in graph.inputs():
        host = from_numpy(np.ascontiguousarray(inputs[t.name]), t.dtype)
        out[t.name] = copy_strided(torch.empty_strided(t.shape, t.strides, dtype=host.dtype, device=device), host)
    return out


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok", "refused", "mismatch", "raised"
    detail: str = ""
    ops: str = ""  # the folded graph's op kinds


Builder = Callable[[fg.Graph], ExecutionPlan]


def reference_stand_in(graph: fg.Graph) -> ExecutionPlan:
    """The CPU stand-in for folded_kernel_plan: the folded graph on the reference engine, behind views."""
    folded = fold_border_reshapes(graph, transposes=True)
    if folded is None:
        raise UnsupportedError(f"graph '{graph.name}': no border reshape to fold into a view")
    return FoldedPlan(graph, folded, folded.graph.build(engine="reference"))


def run_case(case: Case, engine: str, build: Builder, device: str | None,
             memo: dict[str, Any] | None = None) -> Outcome:
    """``case`` on the plan ``build`` makes, fed through its views on fresh random data
    (torch tensors on ``device``, NumPy arrays without one), against the float64 reference
    with the graph fuzzer's tolerance. Only a refusal at build time is "refused". ``memo``
    keeps one case's inputs and answers for its next engine. A typed error at build time is a
    refusal (kernel_plan turns every engine's own failure into one); an untyped one is not."""
    g = case.graph
    folded = fold_border_reshapes(g, transposes=True)
    ops = "+".join(sorted({n.kind.value for n in folded.graph.nodes})) if folded is not None else "-"
    try:
        plan = build(g)
    except UnsupportedError as exc:
        return Outcome("refused", str(exc), ops)
    except FusegraphError as exc:  # typed, so a refusal still; its type is kept among the reasons
        return Outcome("refused", f"{type(exc).__name__}: {exc}", ops)
    except Exception as exc:  # an untyped error from the selection or the folding is a finding
        return Outcome("raised", f"building raised untyped {type(exc).__name__}: {str(exc)[:600]}\n"
                       + case.reproducer(engine), ops)
    config = f", config {plan.config}"
    memo = {} if memo is None else memo
    if "answers" not in memo:
        memo["inputs"] = make_inputs(g, case.seed, case.scales)
        memo["answers"] = Answers(g, memo["inputs"], cast=True)  # the reference engine's answers of the graph
    inputs: dict[str, np.ndarray] = memo["inputs"]
    answers: Answers = memo["answers"]
    for name, arr in answers.exact.items():
        if not np.all(np.isfinite(np.asarray(arr, np.float64))):
            raise AssertionError(f"the drawing made a graph whose reference output '{name}' is not finite:\n"
                                 + case.reproducer(engine))
    try:
        got = plan.execute(to_device(g, inputs, device) if device else dict(inputs))
        host = {t.name: to_host(got[t.name]) for t in g.outputs() if t.name in got}
    except Exception as exc:  # a plan that built must run: an error here is a finding
        typed = "" if isinstance(exc, FusegraphError) else "untyped "
        return Outcome("raised", f"raised {typed}{type(exc).__name__}: {str(exc)[:600]}\n" + case.reproducer(engine, config), ops)
    for t in g.outputs():
        got_t = host.get(t.name)
        if got_t is None or tuple(got_t.shape) != t.shape or got_t.dtype != t.dtype.numpy:
            what = "missing" if got_t is None else f"{list(got_t.shape)} {got_t.dtype}"
            return Outcome("mismatch", f"output '{t.name}' came back {what}, expected {t.dim} {t.dtype.numpy}\n"
                           + case.reproducer(engine, config), ops)
    tol = tolerance(g)
    err, why = answers.error(host, tol)
    if not err <= tol:  # NaN fails too
        return Outcome("mismatch", f"rel err {err:.3g} > tol {tol:g} {why}\n" + case.reproducer(engine, config), ops)
    return Outcome("ok", f"{err:.2e}", ops)


def reproduce(graph_json: str, seed: int, scales: Mapping[str, tuple[float, float]] | None = None,
              engine: str = "triton", device: str = DEVICE) -> Outcome:
    """A reported case again: its graph folded and built on ``engine`` at ``device``."""
    g = fg.Graph.from_json(graph_json).validate()
    case = Case("reproduce", seed, g, dict(scales or {}))
    return run_case(case, engine, _kernel_builder(engine, device), device)


def _kernel_builder(engine: str, device: str) -> Builder:
    from fusegraph.runtime.handle import as_handle

    handle = as_handle(device)
    return lambda g: folded_kernel_plan(g, handle, engines=(engine,), transposes=True)


@dataclass
class Tally:
    """Outcomes per engine and per (engine, family); the failures' messages in order."""

    by_engine: dict[str, Counter[str]] = field(default_factory=dict)
    by_family: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    built_family: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, engine: str, case: Case, out: Outcome, seconds: float) -> None:
        family = case.family.split(":")[0]
        self.by_engine.setdefault(engine, Counter())[out.status] += 1
        self.by_family.setdefault((engine, f"{family}[{out.ops}]"), Counter())[out.status] += 1
        self.seconds[engine] = self.seconds.get(engine, 0.0) + seconds
        if out.status != "refused":
            self.built_family[(engine, family)] += 1
        if out.status == "refused":
            self.reasons[f"{engine}: {_reason_head(out.detail)}"] += 1
        elif out.status != "ok":
            self.failures.append(f"{engine} {out.status}: {out.detail}")

    def built(self, engine: str) -> int:
        c = self.by_engine.get(engine, Counter())
        return c["ok"] + c["mismatch"] + c["raised"]

    def report(self, title: str) -> str:
        lines = [f"{title}:"]
        for engine, c in sorted(self.by_engine.items()):
            lines.append(f"  {engine}: {dict(c)} built {self.built(engine)} ({self.seconds.get(engine, 0.0):.1f} s)")
        for (engine, fam), c in sorted(self.by_family.items()):
            lines.append(f"    {engine} {fam}: {dict(c)}")
        for why, n in self.reasons.most_common(12):
            lines.append(f"  refused x{n}: {why}")
        return "\n".join(lines)

    def assert_no_failures(self) -> None:
        if self.failures:
            shown = "\n\n".join(self.failures[:3])
            rest = "\n".join(f.split("\n", 1)[0] for f in self.failures[3:])
            raise AssertionError(f"{len(self.failures)} folded plan(s) gave a wrong answer or failed to run:\n\n"
                                 f"{shown}\n\nthe others:\n{rest}")


def _reason_head(detail: str) -> str:
    """A refusal's reason without the graph's names and sizes, to count reasons."""
    text = detail.split("builds it on", 1)[-1]
    return " ".join(text.split())[:160]


def run_all(cases: tuple[Case, ...], engines: tuple[str, ...], builders: Mapping[str, Builder],
            device: str | None) -> Tally:
    tally = Tally()
    for case in cases:
        memo: dict[str, Any] = {}
        for engine in engines:
            t0 = time.perf_counter()
            out = run_case(case, engine, builders[engine], device, memo)
            tally.add(engine, case, out, time.perf_counter() - t0)
    return tally


# ---- the engines' own claims, read on the CPU ----------------------------------------------------
def claimed_by(graph: fg.Graph) -> set[str]:
    """The kernel engines whose pure-Python rules accept the folded ``graph`` (cuDNN's
    heuristics and Triton's compiler may still turn it down on the GPU); a Triton kernel's
    source is generated and parsed on the way."""
    from fusegraph.engines.cudnn import rules
    from fusegraph.engines.triton.rows import Refusal, analyze

    folded = fold_border_reshapes(graph, transposes=True)
    if folded is None:
        return set()
    out = set()
    if rules.refusal(folded.graph) is None:
        out.add("cudnn")
    try:
        rg = analyze(folded.graph)
    except Refusal:
        return out
    from fusegraph.engines.triton.codegen import kernel_source
    from fusegraph.engines.triton.engine import default_tiling

    # the kernel's text is written on the CPU too: it must be Python (Triton compiles it on the GPU)
    text = kernel_source(folded.graph, rg, default_tiling(rg.rows, rg.cols)[0])
    compile(text, f"<triton kernel of {graph.name}>", "exec")
    out.add("triton")
    return out


# ---- CPU tests: the pipeline with the reference engine standing in --------------------------------
def test_region_graphs_fold_and_match_through_views_on_the_cpu() -> None:
    """Every drawn region graph folds, loses every reshape of its border, and the folded
    plan fed through views gives the reference's answer (tolerance of the graph fuzzer)."""
    cases = region_cases(CPU_CASES, CPU_SEED, big=False)
    for case in cases:
        folded = fold_border_reshapes(case.graph, transposes=True)
        assert folded is not None, case.reproducer("-")
        left = [n.kind for n in folded.graph.nodes if n.kind == OpKind.RESHAPE]
        assert not left, f"reshapes left inside the folded graph: {left}\n" + case.reproducer("-")
    tally = run_all(cases, ("reference",), {"reference": reference_stand_in}, None)
    print(tally.report("front-door region graphs, reference stand-in (CPU)"))
    tally.assert_no_failures()
    assert tally.by_engine["reference"]["ok"] == len(cases)
    assert {c.family for c in cases} == set(FAMILIES)
    assert {c.graph.io_data_type or c.graph.inputs()[0].dtype for c in cases} == {
        DataType.HALF, DataType.BFLOAT16, DataType.FLOAT}


def test_fuzzer_graphs_that_fold_match_through_views_on_the_cpu() -> None:
    cases = drawn_cases(DRAWN)
    claims = Counter(e for c in cases for e in claimed_by(c.graph))
    print(f"fuzzer graphs that fold: {len(cases)}, claimed {dict(claims)}")
    tally = run_all(cases, ("reference",), {"reference": reference_stand_in}, None)
    print(tally.report(f"fuzzer graphs that fold ({len(cases)} of {DRAWN}), reference stand-in (CPU)"))
    tally.assert_no_failures()
    assert len(cases) >= 12, len(cases)


def test_the_gpu_case_list_gives_each_engine_enough_graphs() -> None:
    """The GPU test's own cases (drawn, not run): each folds, and the engines' pure-Python
    rules accept more of them than the GPU test requires each engine to build."""
    cases = region_cases(GPU_CASES, GPU_SEED, big=True)
    claims: Counter[str] = Counter()
    per_family: Counter[str] = Counter()
    for case in cases:
        assert fold_border_reshapes(case.graph, transposes=True) is not None, case.reproducer("-")
        for e in claimed_by(case.graph):
            claims[e] += 1
            per_family[f"{e} {case.family}"] += 1
    print(f"GPU cases: {len(cases)}, claimed {dict(claims)}, {dict(sorted(per_family.items()))}")
    for engine, least in MIN_BUILT.items():
        assert claims[engine] >= least + 5, (engine, dict(claims))
    for (engine, family), least in MIN_BUILT_FAMILY.items():
        assert per_family[f"{engine} {family}"] >= least + 1, (engine, family, dict(per_family))
    sizes = [math.prod(c.graph.inputs()[0].shape) for c in cases]
    assert max(sizes) >= 8192 * 1024, max(sizes)  # realistic sizes are run, odd ones too:
    assert {1, 3}.issubset({c.graph.inputs()[0].shape[-1] for c in cases})
    assert {c.graph.inputs()[0].dtype for c in cases} == {DataType.HALF, DataType.BFLOAT16, DataType.FLOAT}


def test_the_gpu_path_runs_with_torch_tensors_on_the_cpu() -> None:
    """The GPU tests' own path -- ``folded_kernel_plan`` with one engine pinned, inputs as
    torch tensors in their declared layouts (``to_device``), results read back from torch
    (bfloat16 included) -- with the torch engine on the CPU in the kernel engine's place."""
    pytest.importorskip("torch", reason="the torch extra is not installed: the GPU path feeds torch tensors")
    builder = {"torch": _kernel_builder("torch", "cpu")}
    region = run_all(region_cases(CPU_CASES, CPU_SEED, big=False), ("torch",), builder, "cpu")
    drawn = run_all(drawn_cases(DRAWN), ("torch",), builder, "cpu")
    print(region.report("front-door region graphs, torch engine on the CPU, torch tensors"))
    print(drawn.report("fuzzer graphs that fold, torch engine on the CPU, torch tensors"))
    region.assert_no_failures()
    drawn.assert_no_failures()
    assert region.built("torch") == CPU_CASES
    assert drawn.built("torch") >= 30, drawn.report("counts")


@pytest.mark.parametrize("style", ["torch", "onnx"])
def test_a_cast_after_the_rows_reshaped_back_folds_to_the_border(style: str) -> None:
    g = _graph(style, "ln_cast", DataType.BFLOAT16)
    x, w, b = (g.tensor(n, d, data_type=DataType.BFLOAT16) for n, d in (("x", [2, 3, 8]), ("w", [1, 8]), ("b", [1, 8])))
    y, _, _ = g.layernorm(g.reshape(x, [6, 8]), w, b, 1e-5)
    g.identity(g.reshape(y, [2, 3, 8])).set_data_type(DataType.FLOAT).set_output(True).set_name("out")
    folded = fold_border_reshapes(g.validate())
    assert folded is not None
    assert [n.kind for n in folded.graph.nodes] == [OpKind.LAYERNORM, OpKind.POINTWISE]


class _Skewed(FoldedPlan):
    """The reference stand-in with its first output scaled by ``factor``, one element NaN
    (``nan``), or an error at run time (``fail``): what a wrong kernel would hand back."""

    factor, nan, fail = 1.0, False, False

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("an illegal memory access was encountered")
        got = super().execute(variant_pack)
        name = self.graph.outputs()[0].name
        wrong = np.array(got[name], copy=True) * np.asarray(self.factor, got[name].dtype)
        if self.nan:
            wrong.reshape(-1)[0] = np.nan
        return {**got, name: wrong}


def _skewed(factor: float = 1.0, nan: bool = False, fail: bool = False) -> Builder:
    def build(g: fg.Graph) -> ExecutionPlan:
        folded = fold_border_reshapes(g, transposes=True)
        assert folded is not None
        plan = _Skewed(g, folded, folded.graph.build(engine="reference"))
        plan.factor, plan.nan, plan.fail = factor, nan, fail
        return plan

    return build


def _refuse(g: fg.Graph) -> ExecutionPlan:
    raise UnsupportedError(f"graph '{g.name}': not here")


def test_a_wrong_answer_fails_with_a_reproducer() -> None:
    """The comparison is not a formality: a stand-in off by 5% in one output, with NaN in
    one element, or raising at run time fails with the input seed, the graph's JSON and the
    engine in the message; only a refusal at build time is counted as one."""
    for case in region_cases(CPU_CASES, CPU_SEED, big=False)[:4]:
        assert run_case(case, "stand-in", _skewed(), None).status == "ok"
        for builder, status in ((_skewed(factor=1.05), "mismatch"), (_skewed(nan=True), "mismatch"),
                                (_skewed(fail=True), "raised")):
            out = run_case(case, "stand-in", builder, None)
            assert out.status == status, (out, case.family)
            assert f"input seed {case.seed}" in out.detail and "engine stand-in" in out.detail
            assert json.loads(out.detail.split("graph_json = ", 1)[1])["name"] == case.graph.name
        assert run_case(case, "stand-in", _refuse, None).status == "refused"
        tally = Tally()
        tally.add("stand-in", case, run_case(case, "stand-in", _skewed(factor=1.05), None), 0.0)
        with pytest.raises(AssertionError, match="graph_json"):
            tally.assert_no_failures()


# ---- GPU tests ---------------------------------------------------------------------------------------
def _engines_here() -> tuple[str, ...]:
    from fusegraph.engines.registry import REGISTRY

    for name in KERNEL_ENGINES:
        state = REGISTRY.get(name).available()
        if not state:
            pytest.fail(f"kernel engine {name} is not available on this GPU machine: {state.reason}")
    return KERNEL_ENGINES


@pytest.mark.gpu
def test_kernel_engines_on_folded_region_graphs() -> None:
    engines = _engines_here()
    cases = region_cases(GPU_CASES, GPU_SEED, big=True)
    tally = run_all(cases, engines, {e: _kernel_builder(e, DEVICE) for e in engines}, DEVICE)
    print(tally.report(f"front-door region graphs on {DEVICE}"))
    tally.assert_no_failures()
    for engine, least in MIN_BUILT.items():
        assert tally.built(engine) >= least, f"{engine} built {tally.built(engine)} < {least}"
    for (engine, family), least in MIN_BUILT_FAMILY.items():
        assert tally.built_family[(engine, family)] >= least, f"{engine} built {family} {tally.built_family[(engine, family)]} < {least}"


@pytest.mark.gpu
def test_kernel_engines_on_folded_fuzzer_graphs() -> None:
    engines = _engines_here()
    cases = drawn_cases(DRAWN)
    tally = run_all(cases, engines, {e: _kernel_builder(e, DEVICE) for e in engines}, DEVICE)
    print(tally.report(f"fuzzer graphs that fold ({len(cases)} of {DRAWN}) on {DEVICE}"))
    tally.assert_no_failures()
    assert len(cases) >= 12

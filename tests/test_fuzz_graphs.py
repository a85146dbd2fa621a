"""Graph fuzzer: random valid graphs over the op table, run by every CPU engine and compared
with the float64 reference engine.

A graph is drawn step by step (hypothesis shrinks failures to the smallest graph): inputs in
random memory layouts (any stride permutation), broadcast inputs (size-1 dims or stride-0
views), io types f32/f16/bf16/f64, dims with size 1 and odd sizes; then a chain or DAG of
1-6 ops from every family (pointwise of every mode, reductions, softmax, matmul, conv
fprop/dgrad/wgrad, pooling, the four norms, sdpa, reshape/transpose/concat/slice), each
output in a random layout. Values stay in each op's domain (a log reads ``|x| + 0.5``) and
bounded, and discontinuous ops (floor, ceil, comparisons) read only graph inputs, which
every engine sees exactly, so a mismatch is a bug, not a rounding tie.

Short mode (default) runs in CI. Long mode::

    FUSEGRAPH_FUZZ_EXAMPLES=10000 pytest -m fuzz tests/test_fuzz_graphs.py -s

``FUSEGRAPH_FUZZ_KEEP_GOING=<file.jsonl>`` records mismatches (graph JSON, seed, error)
instead of failing on the first, to triage a long run, and appends one line per graph to
``<file.jsonl>.log`` (so a run cut short still has its count); the counts per engine are
printed at the end (``-s``). A failure prints the input seed and the graph's JSON.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz_profiles import MAIN_KINDS, ORDERS, PROFILES, Profile
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.registry import REGISTRY
from fusegraph.errors import UnsupportedError
from fusegraph.graph import layout
from fusegraph.graph.infer import INFER
from fusegraph.graph.ops import NormFwdPhase, PointwiseMode, PoolingMode, ReductionMode
from fusegraph.graph.tensor import TensorAttr
from fusegraph.reference.inputs import random_inputs
from fusegraph.regions.incumbent import op_by_op_config
from fusegraph.select.autotune import Answers, tolerance

# FUSEGRAPH_FUZZ_DEVICE=cuda:0 fuzzes the GPU engines on that GPU (the long run's command
# is in docs/reliability.md); unset, the CPU engines.
DEVICE = os.environ.get("FUSEGRAPH_FUZZ_DEVICE") or None
_AVAILABLE = {x.name for x in REGISTRY.available_engines()}
CPU_ENGINES = [e for e in ("torch", "iree") if e in _AVAILABLE]
# An engine with a numerics knob pinned, fuzzed as an engine of its own on a GPU: the ONNX
# door picks the torch engine's fp32_matmul=bf16x3 (float32 matmuls as three bf16
# products) by measurement. Named without "torch" so that fuzz_farm.py's `-k` selects it alone.
# "untimed": the configuration a GPU region unit's op-by-op pieces start with until its
# background upgrade (regions/incumbent.op_by_op_config with benchmark off: cuDNN's
# deterministic pick, depthwise convolutions on PyTorch's own kernel), knobs the engine does
# not offer for the graph left out as the unit leaves them out.
VARIANTS: dict[str, tuple[str, dict[str, Any] | Callable[[fg.Graph, fg.Handle], EngineConfig]]] = {
    "bf16x3": ("torch", {"fp32_matmul": "bf16x3"}),
    "untimed": ("torch", lambda g, h: op_by_op_config(g, h, benchmark=False)),
}
GPU_ENGINES = ("cudnn", "triton", "torch", "bf16x3", "untimed")
ENGINES = ([e for e in GPU_ENGINES if VARIANTS.get(e, (e,))[0] in _AVAILABLE] if DEVICE and DEVICE.startswith("cuda")
           else CPU_ENGINES)
SHORT_EXAMPLES = {"torch": 60, "iree": 24}
GPU_SHORT_EXAMPLES = {"cudnn": 40, "triton": 40, "torch": 40, "bf16x3": 40, "untimed": 40}
POISONED = 3  # a long run's worker exits with this after a CUDA error poisoned its context
BOUND = 8.0  # values fed to ops stay within this magnitude (squashed with tanh otherwise)

Draw = Callable[[st.SearchStrategy[Any]], Any]


@dataclass
class Value:
    t: TensorAttr
    bound: float  # max |value| (loose)
    is_input: bool = False
    # Axes along which the value is known constant (a stride-0 input and what pointwise ops
    # make of it): a layer/batch norm over such axes only has groups of one repeated value.
    flat: frozenset[int] = frozenset()

    @property
    def dims(self) -> list[int]:
        return list(self.t.dim)


def _spread(v: Value, axes: Iterable[int]) -> bool:
    """Whether ``v`` may vary within a group over ``axes`` (a layer/batch norm's input).

    A norm of a group of one repeated value is y = bias + scale * (x - mean) / sqrt(eps): the
    f32 rounding of the computed mean (an ulp of |x|, sum-then-divide) amplified 1/sqrt(eps)
    = 316 times. An f32 engine's error is then ~2e-5 * |x| * |scale| per element, and a sum
    of y that cancels (its mean ~0.02 against values ~1: seed 173, layernorm of a stride-0
    input -> reduce_avg) reaches 1e-4 relative. That is the problem's conditioning, not a
    lowering bug: torch's layer_norm happens to be exact there (its Welford mean of equal
    values is exact), and a shifted mean that made IREE exact too cost 4-29% on every
    layernorm/batchnorm (docs/reliability.md). The fuzzer feeds norms groups with spread."""
    return not all(a in v.flat for a in axes if v.dims[a] > 1)


@dataclass
class Fuzz:
    """Draws one graph; ``ops`` lists what was added (for statistics and messages)."""

    draw: Draw
    g: fg.Graph
    io: DataType
    pool: list[Value] = field(default_factory=list)
    bools: list[Value] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    n_inputs: int = 0
    known: set[str] = field(default_factory=set)  # known bugs of the engine, not drawn
    profile: Profile | None = None  # what the engine under test claims (fuzz_profiles.py)
    mains: int = 0  # convolutions, matmuls and sdpas drawn so far
    family: str | None = None  # the image layout of this graph, under a one_family profile

    # ---- inputs -----------------------------------------------------------------------------
    def input(
        self, dims: list[int], *, broadcast: bool = True, keep_dims: bool = False, dtype: DataType | None = None,
        role: str = "any",
    ) -> Value:
        d = self.draw
        self.n_inputs += 1
        dims = list(dims)
        strides: list[int] | None
        one_in = self.profile.broadcast_one_in if self.profile else 6
        if broadcast and len(dims) > 0 and d(st.integers(0, one_in - 1)) == 0:
            # a broadcast input: some axes size 1 (NumPy style) or stride 0 over full dims
            axes = d(st.lists(st.integers(0, len(dims) - 1), min_size=1, max_size=len(dims), unique=True))
            if not keep_dims and d(st.booleans()):
                dims = [1 if i in axes else x for i, x in enumerate(dims)]
                strides = list(self._strides(dims, role))
            else:
                dense = [1 if i in axes else x for i, x in enumerate(dims)]
                strides = [0 if i in axes else s for i, s in enumerate(self._strides(dense, role))]
        else:
            strides = list(self._strides(dims, role))
        t = self.g.tensor(f"in{self.n_inputs}", dims, strides, dtype or self.io)
        flat = frozenset(i for i, (x, s) in enumerate(zip(dims, strides, strict=True)) if s == 0 or x == 1)
        return Value(t, 6.0 if (dtype or self.io).is_integer else 1.5, is_input=True, flat=flat)

    def _strides(self, dims: list[int], role: str = "any") -> tuple[int, ...]:
        """Packed strides in a random memory order; under a profile, in one of the orders the
        engine claims for ``role`` except one draw in ``profile.odd``."""
        p = self.profile
        if p is not None and len(dims) > 1 and not self.odd():
            orders = p.orders(role, len(dims))
            if p.one_family and role in ("any", "image") and len(dims) >= 3:
                if self.family is None:
                    self.family = self.draw(st.sampled_from(["row-major", "channels-last"]))
                orders = [ORDERS[self.family](len(dims))]
            return layout.packed_strides(dims, self.draw(st.sampled_from(orders)))
        order = self.draw(st.permutations(list(range(len(dims))))) if len(dims) > 1 else list(range(len(dims)))
        return layout.packed_strides(dims, order)

    def float_stats(self, *stats: TensorAttr) -> None:
        """Under a profile with full norm parameters: statistics kept as float32, as cuDNN writes them."""
        if self.profile is not None and self.profile.full_norm_params and not self.odd():
            for t in stats:
                t.set_data_type(DataType.FLOAT)

    def odd(self, one_in: int | None = None) -> bool:
        """Under a profile: whether this draw leaves what the engine claims (1 in profile.odd)."""
        if self.profile is None:
            return False
        return self.draw(st.integers(0, (one_in or self.profile.odd) - 1)) == 0

    # ---- helpers ----------------------------------------------------------------------------
    def pick(self, pred: Callable[[Value], bool] = lambda v: True) -> Value | None:
        if self.profile is not None and self.profile.chain and self.pool and pred(self.pool[-1]) and not self.odd():
            return self.pool[-1]  # the last result: one chain, no forks
        cands = [v for v in self.pool if pred(v)]
        return self.draw(st.sampled_from(cands)) if cands else None

    def squash(self, v: Value, limit: float = BOUND, *, linear: bool = False) -> Value:
        if v.bound <= limit:
            return v
        if linear:  # see op_batchnorm
            self.ops.append("scale(squash)")
            return Value(self.g.mul(v.t, self.g.scalar(limit / v.bound)), limit, flat=v.flat)
        self.ops.append("tanh(squash)")
        return Value(self.g.tanh(v.t), 1.0, flat=v.flat)

    def positive(self, v: Value) -> Value:
        """|v| + 0.5: the domain of log, sqrt, rsqrt, reciprocal, pow's base and divisors."""
        v = self.squash(v)
        a = self.g.abs(v.t)
        return Value(self.g.add(a, self.g.scalar(0.5)), v.bound + 0.5, flat=v.flat)

    def add(self, v: Value) -> Value:
        if not v.t.dim:  # inference failed quietly at build time: surface its error
            INFER[self.g.nodes[-1].kind](self.g.nodes[-1])
            raise AssertionError(f"no dims inferred for {v.t}")
        self.pool.append(v)
        return v

    # ---- ops --------------------------------------------------------------------------------
    def step(self, first: bool = False) -> None:
        kinds = [
            "unary", "unary", "binary", "binary", "reduction", "softmax", "matmul", "conv",
            "dgrad", "wgrad", "pool", "batchnorm_inference", "batchnorm", "layernorm", "rmsnorm",
            "sdpa", "reshape", "transpose", "concat", "slice", "compare_select", "discrete", "backward",
            "gather", "gather_backward", "pool_backward",
        ]
        if self.io.is_integer:
            kinds = ["int_unary", "int_binary", "int_binary", "int_reduction", "reshape", "transpose",
                     "concat", "slice", "compare_select"]
        elif self.profile is not None:
            p = self.profile
            kinds = list(p.kinds) if not self.odd(p.odd_kinds) else kinds
            if first and p.first:
                kinds = list(p.first)
            if p.one_main and self.mains and not self.odd(p.odd_kinds):
                kinds = [k for k in kinds if k not in p.main_kinds] or ["unary"]
        kind = self.draw(st.sampled_from(kinds))
        self.mains += kind in (self.profile.main_kinds if self.profile else MAIN_KINDS)
        getattr(self, f"op_{kind}")()

    # ---- integer graphs: exact arithmetic, values kept far from overflow -------------------
    def op_int_unary(self) -> None:
        v = self.pick()
        assert v is not None
        mode = self.draw(st.sampled_from([PointwiseMode.ABS, PointwiseMode.NEG, PointwiseMode.IDENTITY,
                                          PointwiseMode.RELU_FWD]))
        self.ops.append(f"int_{mode.value}")
        self.add(Value(self.g.pointwise(v.t, mode=mode), v.bound))

    def op_int_binary(self) -> None:
        v = self.pick()
        assert v is not None
        w = self._partner(v)
        modes = [PointwiseMode.ADD, PointwiseMode.SUB, PointwiseMode.MAX, PointwiseMode.MIN]
        if v.bound * w.bound < 1e5:
            modes.append(PointwiseMode.MUL)
        mode = self.draw(st.sampled_from(modes))
        self.ops.append(f"int_{mode.value}")
        bound = v.bound * w.bound if mode == PointwiseMode.MUL else v.bound + w.bound
        self.add(Value(self.g.pointwise(v.t, w.t, mode=mode), bound))

    def op_int_reduction(self) -> None:
        v = self.pick()
        assert v is not None
        rank = len(v.dims)
        axes = self.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        mode = self.draw(st.sampled_from([ReductionMode.SUM, ReductionMode.MAX, ReductionMode.MIN, ReductionMode.AMAX]))
        self.ops.append(f"int_reduce_{mode.value}")
        n = math.prod(v.dims[a] for a in axes)
        self.add(Value(self.g.reduction(v.t, mode, axes=sorted(axes)), v.bound * (n if mode == ReductionMode.SUM else 1)))

    def op_unary(self) -> None:
        v = self.pick()
        assert v is not None
        mode = self.draw(st.sampled_from([
            PointwiseMode.ABS, PointwiseMode.NEG, PointwiseMode.EXP, PointwiseMode.LOG,
            PointwiseMode.SQRT, PointwiseMode.RSQRT, PointwiseMode.RECIPROCAL, PointwiseMode.SIN,
            PointwiseMode.COS, PointwiseMode.ERF, PointwiseMode.IDENTITY, PointwiseMode.RELU_FWD,
            PointwiseMode.TANH_FWD, PointwiseMode.SIGMOID_FWD, PointwiseMode.GELU_FWD,
            PointwiseMode.GELU_APPROX_TANH_FWD, PointwiseMode.ELU_FWD, PointwiseMode.SWISH_FWD,
            PointwiseMode.SOFTPLUS_FWD,
        ]))
        self.ops.append(mode.value)
        g = self.g
        if mode in (PointwiseMode.LOG, PointwiseMode.SQRT, PointwiseMode.RSQRT, PointwiseMode.RECIPROCAL):
            p = self.positive(v)
            bound = {PointwiseMode.LOG: math.log(p.bound) + 1, PointwiseMode.SQRT: math.sqrt(p.bound)}.get(mode, 2.0)
            self.add(Value(g.pointwise(p.t, mode=mode), bound, flat=p.flat))
            return
        if mode == PointwiseMode.EXP:
            v = self.squash(v, 2.0)
            self.add(Value(g.exp(v.t), math.exp(v.bound), flat=v.flat))
            return
        params: dict[str, float] = {}
        if mode == PointwiseMode.RELU_FWD:
            params = self.draw(st.sampled_from([
                {}, {"relu_lower_clip_slope": 0.1}, {"relu_upper_clip": 0.5},
                {"relu_lower_clip": -0.25, "relu_upper_clip": 0.75, "relu_lower_clip_slope": 0.2},
            ]))
        elif mode == PointwiseMode.ELU_FWD:
            params = {"elu_alpha": self.draw(st.sampled_from([1.0, 0.5]))}
        elif mode == PointwiseMode.SWISH_FWD:
            params = {"swish_beta": self.draw(st.sampled_from([1.0, 1.702]))}
        elif mode == PointwiseMode.SOFTPLUS_FWD:
            params = {"softplus_beta": self.draw(st.sampled_from([1.0, 2.0]))}
        bounded = {PointwiseMode.SIN, PointwiseMode.COS, PointwiseMode.ERF, PointwiseMode.TANH_FWD,
                   PointwiseMode.SIGMOID_FWD}
        bound = 1.0 if mode in bounded else v.bound + 1.0
        self.add(Value(g.pointwise(v.t, mode=mode, **params), bound, flat=v.flat))

    def _partner(self, v: Value) -> Value:
        """A second operand broadcastable to ``v``: another value of its dims or a new input."""
        chain = self.profile is not None and self.profile.chain
        other = None if chain else self.pick(lambda w: w.dims == v.dims and w is not v)
        if other is not None and self.draw(st.booleans()):
            return other
        return self.input(v.dims)

    def op_binary(self) -> None:
        v = self.pick()
        assert v is not None
        w = self._partner(v)
        mode = self.draw(st.sampled_from([
            PointwiseMode.ADD, PointwiseMode.SUB, PointwiseMode.MUL, PointwiseMode.DIV,
            PointwiseMode.MAX, PointwiseMode.MIN, PointwiseMode.POW,
        ]))
        self.ops.append(mode.value)
        a, b = (v, w) if self.draw(st.booleans()) else (w, v)
        g = self.g
        flat = a.flat & b.flat
        if mode == PointwiseMode.DIV:
            a = self.squash(a)
            self.add(Value(g.div(a.t, self.positive(b).t), a.bound * 2, flat=flat))
        elif mode == PointwiseMode.POW:
            base = self.positive(self.squash(a, 2.0))
            e = self.squash(b, 1.0)
            self.add(Value(g.pow(base.t, e.t), base.bound ** e.bound + 2, flat=flat))
        elif mode == PointwiseMode.MUL:
            a, b = self.squash(a), self.squash(b)
            self.add(Value(g.mul(a.t, b.t), a.bound * b.bound, flat=flat))
        else:
            self.add(Value(g.pointwise(a.t, b.t, mode=mode), a.bound + b.bound, flat=flat))

    def op_reduction(self) -> None:
        v = self.pick()
        assert v is not None
        rank = len(v.dims)
        if self.profile is not None and self.profile.trailing_rows and not self.odd():
            axes = list(range(self.draw(st.integers(min(1, rank - 1), rank - 1)), rank))  # a row kernel's columns
        else:
            axes = self.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        mode = self.draw(st.sampled_from(list(ReductionMode)))
        self.ops.append(f"reduce_{mode.value}")
        n = math.prod(v.dims[a] for a in axes)
        if mode == ReductionMode.MUL:
            v = self.squash(v, 1.0)
            bound = 1.0
            if n > 8:
                # Many factors of |x| <= 1 underflow: 81 tanh values multiplied to 4.8e-42
                # (seed 154), below f32's normal range, where no float type keeps a relative
                # precision and IREE's CPU runtime flushes to zero (docs/reliability.md).
                # exp(2x/n) keeps the product within [e^-2, e^2] for every io type.
                self.ops.append("exp(2x/n)")
                v = Value(self.g.exp(self.g.mul(v.t, self.g.scalar(2.0 / n))), math.exp(2.0 / n))
                bound = math.exp(2.0)
        elif mode in (ReductionMode.SUM, ReductionMode.NORM1, ReductionMode.NORM2):
            bound = v.bound * n
        else:
            bound = v.bound
        self.add(Value(self.g.reduction(v.t, mode, axes=sorted(axes)), bound))

    def op_softmax(self) -> None:
        v = self.pick()
        assert v is not None
        trailing = self.profile is not None and self.profile.trailing_rows and not self.odd()
        axis = -1 if trailing else self.draw(st.integers(-len(v.dims), len(v.dims) - 1))
        log = self.draw(st.booleans())
        self.ops.append("log_softmax" if log else "softmax")
        v = self.squash(v)
        self.add(Value(self.g.softmax(v.t, axis=axis, log=log), 2 * v.bound + math.log(max(v.dims)) + 1 if log else 1.0))

    def op_matmul(self) -> None:
        v = self.pick(lambda w: len(w.dims) >= 2)
        if v is None:
            v = self.add(self.input(self._dims(self.draw(st.integers(2, 4)))))
        v = self.squash(v)
        k = v.dims[-1]
        n = self.draw(st.sampled_from([1, 3, 4, 7, 8]))
        batch = v.dims[:-2]
        if batch and self.draw(st.booleans()):
            batch = [1] * len(batch)  # B broadcast over A's batch dims
        b = self.input([*batch, k, n], broadcast=False, role="matmul")
        a, bb = (v, b)
        self.ops.append("matmul")
        rows_equal = frozenset({len(v.dims) - 2}) & a.flat  # a broadcast row: every row of the product alike
        self.add(Value(self.g.matmul(a.t, bb.t), a.bound * b.bound * k, flat=rows_equal))

    def _image(self, spatial: int = 2) -> Value:
        v = self.pick(lambda w: len(w.dims) == 2 + spatial and all(x >= 1 for x in w.dims[2:]))
        fresh = not (self.profile is not None and self.profile.live_only) and self.draw(st.integers(0, 3)) == 0
        if v is None or fresh:
            dims = [self.draw(st.sampled_from([1, 2])), self.draw(st.sampled_from([1, 3, 4, 6]))]
            dims += [self.draw(st.sampled_from([1, 3, 5, 6, 8])) for _ in range(spatial)]
            v = self.add(self.input(dims, role="image"))
        return self.squash(v)

    def _conv_geometry(self, spatial: list[int], rs: list[int]) -> tuple[list[int], list[int], list[int], list[int]] | None:
        pad = [self.draw(st.integers(0, max(0, r - 1))) for r in rs]
        stride = [self.draw(st.sampled_from([1, 1, 2])) for _ in rs]
        dil = [self.draw(st.sampled_from([1, 1, 2])) for _ in rs]
        out = [(x + 2 * p - dl * (r - 1) - 1) // s + 1 for x, p, dl, r, s in zip(spatial, pad, dil, rs, stride, strict=True)]
        if any(o < 1 for o in out):
            return None
        return pad, stride, dil, out

    def op_conv(self) -> None:
        spatial = self.draw(st.sampled_from([1, 2, 2, 3])) if self.draw(st.integers(0, 3)) == 0 else 2
        x = self._image(spatial)
        c = x.dims[1]
        groups = self.draw(st.sampled_from([g for g in (1, 2, 3, c) if c % g == 0]))
        k = groups * self.draw(st.sampled_from([1, 2, 3]))
        rs = [self.draw(st.sampled_from([1, 2, 3])) for _ in range(spatial)]
        geo = self._conv_geometry(x.dims[2:], rs)
        if geo is None:
            return
        pad, stride, dil, _ = geo
        # one more row or column after than before, at times: TF-style "same" padding, as the
        # torch front door folds a pad into the convolution (fusegraph/torch/aten_pad.py)
        extra = [self.draw(st.sampled_from([0, 0, 0, 1])) for _ in rs]
        w = self.input([k, c // groups, *rs], broadcast=False, role="image")
        self.ops.append(f"conv{spatial}d_g{groups}" + ("_asym" if any(extra) else ""))
        y = self.g.conv_fprop(x.t, w.t, pre_padding=pad, post_padding=[p + e for p, e in zip(pad, extra, strict=True)],
                              stride=stride, dilation=dil)
        self.add(Value(y, x.bound * 1.5 * (c // groups) * math.prod(rs)))

    def op_dgrad(self) -> None:
        x = self._image()  # dy: [n, k, h', w']
        n, k, ho, wo = x.dims
        c = self.draw(st.sampled_from([1, 2, 3]))
        rs = [self.draw(st.sampled_from([1, 2, 3])) for _ in range(2)]
        pad = [self.draw(st.integers(0, r - 1)) for r in rs]
        stride = [self.draw(st.sampled_from([1, 2])) for _ in rs]
        spatial = [(o - 1) * s - 2 * p + (r - 1) + 1 for o, s, p, r in zip((ho, wo), stride, pad, rs, strict=True)]
        if any(s_ < 1 for s_ in spatial):
            return
        w = self.input([k, c, *rs], broadcast=False, role="image")
        self.ops.append("dgrad")
        dx = self.g.conv_dgrad(x.t, w.t, padding=pad, stride=stride, dilation=[1, 1]).set_dim([n, c, *spatial])
        dx.set_data_type(self.io)  # unset, it is inferred only at validate()
        self.add(Value(dx, x.bound * 1.5 * k * math.prod(rs)))

    def op_wgrad(self) -> None:
        x = self._image()
        n, c, h, w_ = x.dims
        k = self.draw(st.sampled_from([1, 2, 3]))
        rs = [self.draw(st.sampled_from([1, 2, 3])) for _ in range(2)]
        geo = self._conv_geometry([h, w_], rs)
        if geo is None:
            return
        pad, stride, dil, out = geo
        dy = self.input([n, k, *out], broadcast=False, role="image")
        self.ops.append("wgrad")
        dw = self.g.conv_wgrad(x.t, dy.t, padding=pad, stride=stride, dilation=dil).set_dim([k, c, *rs])
        dw.set_data_type(self.io)
        self.add(Value(dw, x.bound * 1.5 * n * math.prod(out)))

    def op_pool(self) -> None:
        x = self._image()
        mode = self.draw(st.sampled_from(list(PoolingMode)))
        win = [self.draw(st.sampled_from([1, 2, 3])) for _ in range(2)]
        stride = [self.draw(st.sampled_from([1, 2])) for _ in range(2)]
        pad = [self.draw(st.integers(0, w // 2)) for w in win]
        if any((s + 2 * p - w) // st_ + 1 < 1 for s, p, w, st_ in zip(x.dims[2:], pad, win, stride, strict=True)):
            return
        self.ops.append(f"pool_{mode.value}")
        self.add(Value(self.g.pooling(x.t, mode, window=win, stride=stride, padding=pad), x.bound))

    def op_pool_backward(self) -> None:
        x = self._image()
        mode = self.draw(st.sampled_from(list(PoolingMode)))
        win = [self.draw(st.sampled_from([1, 2, 3])) for _ in range(2)]
        stride = [self.draw(st.sampled_from([1, 2])) for _ in range(2)]
        pad = [self.draw(st.integers(0, w // 2)) for w in win]
        out = [(s + 2 * p - w) // st_ + 1 for s, p, w, st_ in zip(x.dims[2:], pad, win, stride, strict=True)]
        if any(o < 1 for o in out):
            return
        if mode == PoolingMode.MAX and not x.is_input:
            # the gradient goes to each window's first maximum: a computed x may tie (a relu's
            # zeros, a broadcast) where float rounding picks another element on each side
            return
        dy = self.input(x.dims[:2] + out, keep_dims=True)
        self.ops.append(f"pool_backward_{mode.value}")
        overlap = math.prod(-(-w // s) for w, s in zip(win, stride, strict=True))
        self.add(Value(self.g.pooling_backward(dy.t, x.t, mode, window=win, stride=stride, padding=pad),
                       dy.bound * overlap))

    def _ids(self, dims: list[int]) -> Value:
        it = self.draw(st.sampled_from([DataType.INT32, DataType.INT64]))
        return self.input(dims, broadcast=False, dtype=it)

    def op_gather(self) -> None:
        data = self.pick(lambda w: len(w.dims) >= 1) or self.add(self.input(self._dims(self.draw(st.integers(1, 3)))))
        axis = self.draw(st.integers(-len(data.dims), len(data.dims) - 1))
        ids = self._ids(self._dims(self.draw(st.integers(1, 2))))
        if len(data.dims) + len(ids.dims) - 1 > 5:
            return
        self.ops.append("gather")
        self.add(Value(self.g.gather(data.t, ids.t, axis=axis), data.bound, flat=frozenset()))

    def op_gather_backward(self) -> None:
        ids = self._ids(self._dims(self.draw(st.integers(1, 2))))
        dy = self.pick(lambda w: len(w.dims) == len(ids.dims) + 1 and w.dims[:-1] == ids.dims)
        if dy is None:
            dy = self.input([*ids.dims, self.draw(st.sampled_from([1, 3, 8]))], keep_dims=True)
        rows = self.draw(st.sampled_from([1, 2, 5, 9]))
        padding = self.draw(st.one_of(st.none(), st.integers(0, rows - 1)))
        self.ops.append("gather_backward")
        self.add(Value(self.g.gather_backward(dy.t, ids.t, rows, padding_idx=padding),
                       dy.bound * math.prod(ids.dims)))

    def _stat(self, dims: list[int], positive: bool = False) -> Value:
        v = self.input(dims, broadcast=False)
        return self.positive(v) if positive else v

    def op_batchnorm_inference(self) -> None:
        x = self.pick(lambda w: len(w.dims) >= 2) or self.add(self.input(self._dims(4)))
        x = self.squash(x)
        c = x.dims[1]
        shape = self.draw(st.sampled_from([[c], [1, c] + [1] * (len(x.dims) - 2)]))
        s, b, m = (self._stat(shape) for _ in range(3))
        var = self._stat(shape, positive=True)
        self.ops.append("batchnorm_inference")
        y = self.g.batchnorm_inference(x.t, s.t, b.t, m.t, var.t, epsilon=self.draw(st.sampled_from([1e-5, 1e-3])))
        self.add(Value(y, (x.bound + 1.5) * 1.5 * 2 + 1.5))

    def op_batchnorm(self) -> None:
        x = self.pick(lambda w: len(w.dims) >= 2 and (math.prod(w.dims) // w.dims[1]) >= 2
                      and _spread(w, [a for a in range(len(w.dims)) if a != 1]))
        if x is None:
            x = self.add(self.input([2, 3, 3, 2], broadcast=False))  # groups with spread (_spread)
        # Scaled, not tanh-squashed: tanh of values past ~9 is exactly +-1 in f32, so a group of
        # saturated values has mean ~0 by cancellation (seed 1112: tanh(wgrad) [2,1,1,1] is
        # [1, -0.99999957], mean 2.1e-7), and any f32 engine's mean then errs by its inputs'
        # rounding, u |x| / |mean| ~ 0.1-1 relative (docs/reliability.md). Norms are
        # scale-invariant, so a linear squash loses nothing and keeps the group's spread.
        x = self.squash(x, linear=True)
        c = x.dims[1]
        s, b = self._stat([c]), self._stat([c])
        self.ops.append("batchnorm")
        y, mean, inv_var = self.g.batchnorm(x.t, s.t, b.t, epsilon=1e-3)
        if (self.profile is not None and self.profile.live_only) or self.draw(st.booleans()):
            mean.set_output(True)
            inv_var.set_output(True)
            self.float_stats(mean, inv_var)
        n = math.prod(x.dims) // c
        self.add(Value(y, 1.5 * math.sqrt(n) + 1.5))

    def op_layernorm(self) -> None:
        x = self.pick(lambda w: len(w.dims) >= 2 and math.prod(w.dims[1:]) >= 2 and _spread(w, range(1, len(w.dims))))
        if x is None:
            x = self.add(self.input([3, 4, 5], broadcast=False))  # groups with spread (_spread)
        x = self.squash(x, linear=True)  # its mean may be read out too (see op_batchnorm)
        s, b = self._stat([1, *x.dims[1:]]), self._stat(x.dims[1:])
        phase = self.draw(st.sampled_from(list(NormFwdPhase)))
        self.ops.append(f"layernorm_{phase.value}")
        y, mean, inv_var = self.g.layernorm(x.t, s.t, b.t, epsilon=1e-5, phase=phase)
        live = self.profile is not None and self.profile.live_only
        if phase == NormFwdPhase.TRAINING and mean is not None and inv_var is not None and (live or self.draw(st.booleans())):
            mean.set_output(True)
            inv_var.set_output(True)
            self.float_stats(mean, inv_var)
        self.add(Value(y, 1.5 * math.sqrt(math.prod(x.dims[1:])) + 1.5))

    def op_rmsnorm(self) -> None:
        x = self.pick(lambda w: len(w.dims) >= 2)
        if x is None:
            x = self.add(self.input([3, 4, 8]))
        x = self.squash(x)
        full = self.profile is not None and self.profile.full_norm_params and not self.odd()
        s = self._stat([1, *x.dims[1:]] if full else [x.dims[-1]])
        bias = self._stat(x.dims[1:]) if self.draw(st.booleans()) else None
        phase = self.draw(st.sampled_from(list(NormFwdPhase)))
        self.ops.append(f"rmsnorm_{phase.value}")
        y, inv = self.g.rmsnorm(x.t, s.t, epsilon=1e-5, phase=phase, bias=bias.t if bias else None)
        if inv is not None and ((self.profile is not None and self.profile.live_only) or self.draw(st.booleans())):
            inv.set_output(True)
            self.float_stats(inv)
        self.add(Value(y, 1.5 * math.sqrt(math.prod(x.dims[1:])) + 1.5))

    def op_sdpa(self) -> None:
        q = self.pick(lambda w: len(w.dims) == 4)
        if q is None:
            q = self.add(self.input([self.draw(st.sampled_from([1, 2])), 2, self.draw(st.sampled_from([1, 3, 5])), 4], role="sdpa"))
        q = self.squash(q, 2.0)
        b, h, sq, d = q.dims
        hk = self.draw(st.sampled_from([x for x in (1, h) if h % x == 0]))
        skv = self.draw(st.sampled_from([1, 3, 4, sq]))
        dv = self.draw(st.sampled_from([2, d]))
        k = self.input([b, hk, skv, d], broadcast=False, role="sdpa")
        v = self.input([b, hk, skv, dv], broadcast=False, role="sdpa")
        causal = self.draw(st.booleans())
        mask = None
        if not causal and self.draw(st.booleans()):
            mask = self.input([1, 1, sq, skv], broadcast=False, role="sdpa")
        self.ops.append("sdpa" + ("_causal" if causal else "") + ("_mask" if mask else ""))
        scale = self.draw(st.sampled_from([None, 0.5]))
        o = self.g.sdpa(q.t, k.t, v.t, attn_scale=scale, causal=causal, mask=mask.t if mask else None)
        self.add(Value(o, 1.5))

    def op_reshape(self) -> None:
        v = self.pick()
        assert v is not None
        total = math.prod(v.dims)
        divisors = [x for x in range(1, total + 1) if total % x == 0]
        first = self.draw(st.sampled_from(divisors))
        dims = [first, total // first]
        if self.draw(st.booleans()):
            dims = [*dims, 1] if self.draw(st.booleans()) else [1, *dims]
        self.ops.append("reshape")
        self.add(Value(self.g.reshape(v.t, dims), v.bound))

    def op_transpose(self) -> None:
        v = self.pick(lambda w: len(w.dims) >= 2) or self.add(self.input(self._dims(3)))
        perm = self.draw(st.permutations(list(range(len(v.dims)))))
        self.ops.append("transpose")
        self.add(Value(self.g.transpose(v.t, list(perm)), v.bound))

    def op_concat(self) -> None:
        v = self.pick()
        assert v is not None
        axis = self.draw(st.integers(0, len(v.dims) - 1))
        others = []
        for _ in range(self.draw(st.integers(1, 2))):
            dims = list(v.dims)
            dims[axis] = self.draw(st.sampled_from([1, 2, 3]))
            cand = self.pick(lambda w, dims=dims: w.dims == dims and w is not v)  # type: ignore[misc]
            others.append(cand if cand is not None else self.input(dims, keep_dims=True))
        self.ops.append("concat")
        parts = [v, *others]
        self.add(Value(self.g.concatenate([p.t for p in parts], axis=axis), max(p.bound for p in parts)))

    def op_slice(self) -> None:
        v = self.pick(lambda w: max(w.dims) >= 2)
        if v is None:
            return
        axis = self.draw(st.sampled_from([i for i, x in enumerate(v.dims) if x >= 2]))
        size = v.dims[axis]
        start = self.draw(st.integers(0, size - 1))
        end = self.draw(st.integers(start + 1, size))
        step = self.draw(st.sampled_from([1, 1, 2, 3]))  # steps are >= 1 (validate says so)
        if self.draw(st.integers(0, 4)) == 0:  # negative (from the end) bounds
            start, end = start - size, end - size if end < size else end
        self.ops.append("slice")
        self.add(Value(self.g.slice(v.t, [start], [end], steps=[step], axes=[axis]), v.bound))

    def op_compare_select(self) -> None:
        v = self.pick()
        assert v is not None
        a = self.input(v.dims)
        b = self.input(v.dims)
        mode = self.draw(st.sampled_from([
            PointwiseMode.CMP_EQ, PointwiseMode.CMP_NEQ, PointwiseMode.CMP_GT, PointwiseMode.CMP_GE,
            PointwiseMode.CMP_LT, PointwiseMode.CMP_LE,
        ]))
        g = self.g
        cond = g.pointwise(a.t, b.t, mode=mode)
        logic = self.draw(st.sampled_from(["none", "not", "and", "or"]))
        if logic == "not":
            cond = g.logical_not(cond)
        elif logic in ("and", "or"):
            other = g.cmp_gt(a.t, g.scalar(0 if self.io.is_integer else 0.0))
            cond = g.logical_and(cond, other) if logic == "and" else g.logical_or(cond, other)
        self.ops.append(f"{mode.value}_{logic}_select")
        if self.draw(st.integers(0, 3)) == 0:
            cond.set_output(True)  # a boolean output
        w = self._partner(v)
        self.add(Value(g.binary_select(v.t, w.t, cond), max(v.bound, w.bound)))

    def op_discrete(self) -> None:
        v = self.pick(lambda w: w.is_input) or self.add(self.input(self._dims(self.draw(st.integers(1, 4)))))
        mode = self.draw(st.sampled_from([PointwiseMode.FLOOR, PointwiseMode.CEIL]))
        self.ops.append(mode.value)
        # scaled so that values span several integers, still exact in every io type
        y = self.g.pointwise(v.t, mode=mode)
        self.add(Value(y, v.bound + 1))

    def op_backward(self) -> None:
        x = self.pick()
        assert x is not None
        x = self.squash(x)
        dy = self._partner(x)
        mode = self.draw(st.sampled_from([
            PointwiseMode.RELU_BWD, PointwiseMode.GELU_BWD, PointwiseMode.TANH_BWD, PointwiseMode.SIGMOID_BWD,
        ]))
        if mode == PointwiseMode.RELU_BWD:
            x = self.pick(lambda w: w.is_input and w.dims == dy.dims) or x  # relu' is discontinuous at 0
            if not x.is_input:
                mode = PointwiseMode.SIGMOID_BWD
        self.ops.append(mode.value)
        self.add(Value(self.g.pointwise(dy.t, x.t, mode=mode), dy.bound * 1.5))

    def _dims(self, rank: int) -> list[int]:
        return [self.draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8])) for _ in range(rank)]


IO_TYPES = [DataType.FLOAT, DataType.FLOAT, DataType.HALF, DataType.BFLOAT16, DataType.DOUBLE, DataType.INT32]
# Known bugs kept out of the fuzz per engine so that it goes on finding others (each with a
# strict xfail in tests/test_fuzz_regressions.py, and a branch in Fuzz reading its name). None
# now: every bug the fuzzer found is fixed and drawn again.
KNOWN: dict[str, set[str]] = {}


def draw_graph(draw: Draw, engine: str = "", profile: Profile | None = None) -> tuple[fg.Graph, list[str]]:
    """A random valid graph (validated) and the ops it holds; under ``profile``, mostly one
    that the profiled engine claims (fuzz_profiles.py)."""
    known = KNOWN.get(engine, set())
    io = draw(st.sampled_from(profile.io_types if profile is not None else IO_TYPES))
    inter = DataType.INT32 if io.is_integer else DataType.FLOAT
    compute = {DataType.DOUBLE: DataType.DOUBLE, DataType.INT32: DataType.INT32}.get(io, DataType.FLOAT)
    g = fg.Graph(name="fuzz", io_data_type=io, intermediate_data_type=inter, compute_data_type=compute)
    f = Fuzz(draw, g, io, known=known, profile=profile)
    rank = draw(st.integers(1, 4))
    f.add(f.input(f._dims(rank), broadcast=False))
    for i in range(draw(st.integers(1, 6))):
        f.step(first=i == 0)
    last = f.pool[-1]
    if last.is_input:  # nothing computed: at least one op
        f.op_int_unary() if io.is_integer else f.op_unary()
        last = f.pool[-1]
    outs = [last]
    computed = [v for v in f.pool[:-1] if not v.is_input and not v.t.is_output]
    if computed and draw(st.booleans()):
        outs.append(draw(st.sampled_from(computed)))  # a DAG: an intermediate also read out
    if profile is not None and profile.live_only:
        read = {t.name for n in g.nodes for t in n.inputs.values()}
        outs += [v for v in computed if v.t.name not in read and v not in outs]
    for v in outs:
        v.t.set_output(True)
        if len(v.t.dim) > 1 and draw(st.booleans()):
            v.t.set_stride(list(f._strides(list(v.t.dim))))
    g.validate()
    return g, f.ops


# ---- running and comparing -------------------------------------------------------------------
@dataclass
class Stats:
    graphs: Counter[str] = field(default_factory=Counter)
    unsupported: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)


STATS = Stats()


def run_and_compare(g: fg.Graph, engine: str, seed: int, device: str | None = None) -> tuple[str, str]:
    """("ok" | "unsupported" | "mismatch", detail) of one graph on one engine."""
    rng = np.random.default_rng(seed)
    inputs = random_inputs(g, rng)
    answers = Answers(g, inputs, cast=True)  # as the reference engine returns them
    ref = answers.exact
    for name, arr in ref.items():
        if not np.all(np.isfinite(np.asarray(arr, dtype=np.float64))):
            raise AssertionError(f"the fuzzer drew a graph whose reference output '{name}' is not finite:\n{g.to_json(indent=1)}")
    base, knobs = VARIANTS.get(engine, (engine, {}))
    try:
        if knobs:  # refused where the knob is not offered (no float32 matmul): counted as a refusal
            handle = fg.Handle(device or "cpu")
            config = knobs(g, handle) if callable(knobs) else EngineConfig(base, tuple(knobs.items()))
            plan = REGISTRY.get(base).build(g, handle, config)
            got = plan.execute(dict(inputs))
        else:
            got = g.execute(dict(inputs), engine=engine, handle=device)
    except UnsupportedError as exc:
        return "unsupported", str(exc)
    tol = tolerance(g)
    err, why = answers.error(got, tol)
    if not err <= tol:
        return "mismatch", f"rel err {err:.3g} > tol {tol:g} {why}"
    return "ok", ""


def _check(engine: str, data: st.DataObject, seed: int, device: str | None = None) -> None:
    keep = os.environ.get("FUSEGRAPH_FUZZ_KEEP_GOING")
    try:
        g, ops = draw_graph(data.draw, engine, PROFILES.get(engine) if device else None)
    except fg.ValidationError as exc:  # the generator or validate() is wrong: a finding too
        if not keep:
            raise
        STATS.mismatches[f"{engine}:invalid"] += 1
        with open(keep, "a") as fh:
            fh.write(json.dumps({"engine": engine, "invalid_graph": str(exc)}) + "\n")
        return
    if keep:  # the graph being run, left behind should an engine take the process down
        Path(keep + ".current.json").write_text(json.dumps({"engine": engine, "seed": seed, "graph": json.loads(g.to_json())}))
    try:
        status, detail = run_and_compare(g, engine, seed, device)
    except Exception as exc:  # an engine that crashes on a valid graph is a finding too
        typed = "" if isinstance(exc, fg.FusegraphError) else "untyped "
        status, detail = "mismatch", f"raised {typed}{type(exc).__name__}: {str(exc)[:500]}"
    STATS.graphs[engine] += 1
    STATS.ops.update(ops)
    if keep:  # one line per graph: a long run's count survives the process being killed
        with open(keep + ".log", "a") as fh:
            why = " " + " ".join(detail.split())[:200] if status == "unsupported" else ""
            fh.write(f"{engine} {status} {seed} {'+'.join(ops)}{why}\n")
    if STATS.graphs[engine] % 250 == 0:  # progress of a long run (visible with -s)
        print(f"fuzz {engine}: {STATS.graphs[engine]} graphs, {STATS.unsupported[engine]} unsupported, "
              f"{STATS.mismatches[engine]} mismatches", flush=True)
    if status == "unsupported":
        STATS.unsupported[engine] += 1
        return
    if status == "mismatch":
        STATS.mismatches[engine] += 1
        record = {"engine": engine, "seed": seed, "ops": ops, "detail": detail, "graph": json.loads(g.to_json())}
        if keep:
            with open(keep, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if device and "CUDA error" in detail:  # a sticky error: every later call fails too
                os._exit(POISONED)  # tests/fuzz_farm.py starts a fresh worker
            return
        raise AssertionError(
            f"{engine} disagrees with the reference on fuzzed graph (input seed {seed}, ops {ops}): "
            f"{detail}\n{g.to_json(indent=1)}"
        )


@pytest.fixture(scope="module", autouse=True)
def _cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path_factory.mktemp("fuzz-cache")))
    mp.delenv("FUSEGRAPH_CACHE", raising=False)
    yield
    mp.undo()
    if STATS.graphs:
        print(f"\nfuzz: graphs {dict(STATS.graphs)} unsupported {dict(STATS.unsupported)} "
              f"mismatches {dict(STATS.mismatches)}\nfuzz ops: {dict(STATS.ops.most_common())}")


def _examples(engine: str) -> int:
    env = os.environ.get("FUSEGRAPH_FUZZ_EXAMPLES")
    return int(env) if env else SHORT_EXAMPLES[engine]


def _fuzz_test(engine: str, examples: int, derandomize: bool = False, device: str | None = None) -> Callable[[], None]:
    @settings(max_examples=examples, deadline=None, print_blob=True, derandomize=derandomize,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def test(data: st.DataObject, seed: int) -> None:
        _check(engine, data, seed, device)

    return test  # type: ignore[no-any-return]


@pytest.mark.parametrize("engine", ENGINES)
def test_fuzz_short(engine: str) -> None:
    """CI: a few dozen random graphs per engine vs the reference (derandomized: a CI failure is
    reproducible; the long run draws fresh graphs every time)."""
    if os.environ.get("FUSEGRAPH_FUZZ_EXAMPLES"):
        pytest.skip("FUSEGRAPH_FUZZ_EXAMPLES is set: the long run is test_fuzz_long (pytest -m fuzz)")
    _fuzz_test(engine, SHORT_EXAMPLES[engine], derandomize=True)()  # the same graphs every CI run


@pytest.mark.fuzz
@pytest.mark.parametrize("engine", ENGINES)
def test_fuzz_long(engine: str, request: pytest.FixtureRequest) -> None:
    """``pytest -m fuzz``: FUSEGRAPH_FUZZ_EXAMPLES graphs (default 2000) per engine."""
    if "fuzz" not in (request.config.getoption("-m") or ""):
        pytest.skip("the long fuzz runs only when selected: pytest -m fuzz")
    _fuzz_test(engine, int(os.environ.get("FUSEGRAPH_FUZZ_EXAMPLES", "2000")), device=DEVICE)()


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
def test_fuzz_gpu_short(engine: str) -> None:
    """On the GPU machine (pytest -m gpu): a few dozen graphs each GPU engine claims
    (fuzz_profiles.py), on cuda:0, vs the reference; derandomized like the CPU short run."""
    base = VARIANTS.get(engine, (engine,))[0]
    if base not in _AVAILABLE:
        pytest.fail(f"the {base} engine is not available on this GPU machine: "
                    f"{REGISTRY.get(base).available().reason}")
    _fuzz_test(engine, GPU_SHORT_EXAMPLES[engine], derandomize=True, device="cuda:0")()


def test_engines_to_fuzz_are_present() -> None:
    """The fuzz runs on every CPU engine installed here; a missing one is a missing observation."""
    assert ENGINES, "no engine other than the reference is available to fuzz"


def test_norms_are_fed_groups_with_spread() -> None:
    """A layer/batch norm is never drawn over groups of one repeated value (seed 173: see _spread)."""
    g = fg.Graph(name="spread")
    const = Value(g.tensor("c", [3, 4, 5], [0, 0, 0]), 1.5, is_input=True, flat=frozenset({0, 1, 2}))
    rows = Value(g.tensor("r", [3, 4, 5], [0, 5, 1]), 1.5, is_input=True, flat=frozenset({0}))
    assert not _spread(const, range(1, 3)) and not _spread(const, [0, 2, 3][:2])
    assert _spread(rows, range(1, 3)) and not _spread(rows, [0])


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_the_untimed_profile_draws_convolution_graphs(data: st.DataObject, seed: int) -> None:
    """The GPU variant's profile draws graphs with a convolution (depthwise among them), its
    configuration on a GPU handle turns cuDNN's timing off -- and its depthwise
    kernels where the graph has a depthwise convolution -- and off a GPU it runs as the
    torch engine does, against the float64 reference."""
    g, ops = draw_graph(data.draw, "untimed", PROFILES["untimed"])
    # a convolution is drawn first; one whose geometry does not fit its image is skipped
    assume(any(n.kind.value == "conv_fprop" for n in g.nodes))
    knobs = dict(VARIANTS["untimed"][1](g, fg.Handle("cuda:0")).knobs)  # type: ignore[operator]
    assert knobs.get("cudnn_benchmark") is False and knobs.get("cuda_graph") is False, knobs
    assert knobs.get("compile", False) is False, knobs  # offered where Inductor can work (Triton)
    depthwise = any(n.kind.value == "conv_fprop" and n.inputs["w"].shape[1] == 1 and n.inputs["x"].shape[1] > 1
                    for n in g.nodes)
    assert ("cudnn_depthwise" in knobs) == depthwise, (knobs, ops)
    status, detail = run_and_compare(g, "untimed", seed)
    assert status in ("ok", "unsupported"), (status, detail)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_the_bf16x3_profile_draws_float32_matmul_graphs(data: st.DataObject, seed: int) -> None:
    """The GPU variant's profile draws what it is for -- valid float32 graphs that start with a
    matmul -- and off a GPU the variant is a refusal naming the knob, never a run on float32."""
    g, ops = draw_graph(data.draw, "bf16x3", PROFILES["bf16x3"])
    assert g.nodes[0].kind.value == "matmul", ops
    assert all(t.dtype == DataType.FLOAT for t in g.tensors if t.data_type is not None and t.dtype.is_float)
    status, detail = run_and_compare(g, "bf16x3", seed)
    assert status == "unsupported" and "fp32_matmul" in detail, (status, detail)

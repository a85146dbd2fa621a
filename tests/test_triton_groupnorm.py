"""Group norm on the Triton row kernel: a layer norm over [N*G, K] rows reshaped back to
[N, C, *spatial], then the per-channel weight and bias and SiLU, one kernel
(engines/triton/rows.py, "graphs with reshapes").

The ONNX door presents torch's GroupNorm export (Reshape [N, G, -1] -> InstanceNormalization
-> Reshape -> Mul -> Add -> SiLU) as a region graph: reshape to rows, layer norm (unit
scale), reshape to [N, G, K], the instance norm's [1, G, 1] scale and bias, reshape to
[N, C, H, W], the [C, 1, 1] weight and bias, sigmoid and mul, written channels-last where the
partition is; on a GPU it is first tried with its border reshapes folded into views
(regions/views.py). The torch door's ``native_group_norm`` converts to the same rows with a
[1, C, 1] weight reshaped from [C] (torch/aten_norms.py), which folding makes an input.

Triton is not installed on the CPU machine, so the CPU tests check the claim rule (the
UNet's real region graphs, built shapes, refusals with reasons) and run the generated
kernel text itself under a NumPy stand-in for ``triton.language`` (``emulate``: each
program's tile as NumPy arrays, loads and stores through the addresses the text computes,
every address range-checked, no element stored twice), against the float64 reference.
The GPU tests run the same graphs on Triton and the bench's UNet export on cuda:0:

    python3 -m pytest -m gpu -q -s tests/test_triton_groupnorm.py
"""

from __future__ import annotations

import collections
import math
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import scipy.special
from bench_modules import load_bench

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.triton.codegen import kernel_source
from fusegraph.engines.triton.engine import default_tiling
from fusegraph.engines.triton.rows import MAX_COLS, Access, Refusal, RowGraph, Term, analyze
from fusegraph.graph.layout import packed_strides
from fusegraph.graph.ops import OpKind, ReductionMode
from fusegraph.regions.views import fold_border_reshapes

TOL = {DT.FLOAT: 1e-4, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}  # norms: 1e-4 in f32
DTYPES = (DT.FLOAT, DT.HALF, DT.BFLOAT16)


# ---- the graphs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GN:
    """One group norm: sizes, the SiLU after it, and the output's layout."""

    n: int
    c: int
    groups: int
    spatial: tuple[int, ...]
    silu: bool = True
    nhwc: bool = False  # the output channels-last, as a partition with convolutions writes it

    @property
    def k(self) -> int:
        return self.c // self.groups * math.prod(self.spatial)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n, self.c, *self.spatial)

    def __str__(self) -> str:
        return (f"N{self.n}_C{self.c}_G{self.groups}_{'x'.join(map(str, self.spatial))}"
                f"{'_silu' if self.silu else ''}{'_nhwc' if self.nhwc else ''}")


CASES = (
    GN(2, 64, 32, (16, 16), nhwc=True),  # the UNet's, two images
    GN(1, 32, 1, (7, 5), silu=False),  # G = 1: one row per image, odd spatial
    GN(3, 12, 12, (9, 11), nhwc=True),  # G = C: instance norm
    GN(2, 96, 32, (13, 13)),  # K = 507, not a power of two
    GN(4, 8, 4, (50,), silu=False, nhwc=True),  # [N, C, L]
    GN(2, 6, 3, (3, 4, 5), nhwc=True),  # [N, C, D, H, W]
    GN(1, 128, 32, (64, 64), nhwc=True),  # K = 16384, MAX_COLS
)


def _out_strides(shape: tuple[int, ...], nhwc: bool) -> tuple[int, ...]:
    if not nhwc:
        return packed_strides(shape)
    n, c, *sp = shape
    inner = packed_strides((n, *sp, c))  # N, spatial..., C
    return (inner[0], inner[-1], *inner[1:-1])


def onnx_group_norm(gn: GN, dt: DT, name: str = "gn_onnx") -> fg.Graph:
    """The ONNX door's region graph of Reshape -> InstanceNormalization -> Reshape -> Mul ->
    Add (-> Sigmoid -> Mul), as bench_onnx_gpu's UNet gives it (in3 / in4 with the strides
    the importer lays them out in)."""
    n, c, g_, k = gn.n, gn.c, gn.groups, gn.k
    g = fg.Graph(f"{name}_{gn}_{dt.value}")
    x = g.tensor("x", [n, g_, k], data_type=dt)
    y, _, _ = g.layernorm(g.reshape(x, [n * g_, k]), g.tensor("ln_scale", [1, k], data_type=dt),
                          g.tensor("ln_bias", [1, k], data_type=dt), 1e-5)
    y = g.reshape(y, [n, g_, k])
    y = g.mul(y, g.tensor("in_scale", [1, g_, 1], [g_, 1, g_], data_type=dt))
    y = g.add(y, g.tensor("in_bias", [1, g_, 1], [g_, 1, g_], data_type=dt))
    y = g.reshape(y, list(gn.shape))
    ch = [c] + [1] * len(gn.spatial)
    y = g.add(g.mul(y, g.tensor("gamma", ch, data_type=dt)), g.tensor("beta", ch, data_type=dt))
    if gn.silu:
        y = g.mul(y, g.sigmoid(y))
    y.set_output(True).set_name("out").set_stride(list(_out_strides(gn.shape, gn.nhwc)))
    return g.validate()


def torch_group_norm(gn: GN, dt: DT) -> fg.Graph:
    """The torch door's conversion of ``aten.native_group_norm`` (torch/aten_norms.py): rows
    of x, a unit-scale layer norm (scalars), [N, C, HxW] times the weight reshaped from [C]
    to [1, C, 1], plus the bias, reshaped to x's shape (SiLU after it where asked)."""
    n, c, g_, k = gn.n, gn.c, gn.groups, gn.k
    hw = math.prod(gn.spatial)
    g = fg.Graph(f"gn_torch_{gn}_{dt.value}", io_data_type=dt, intermediate_data_type=dt,
                 compute_data_type=DT.FLOAT if dt != DT.FLOAT else None)
    x = g.tensor("x", list(gn.shape), data_type=dt)
    y, _, _ = g.layernorm(g.reshape(x, [n * g_, k]), g.scalar(1.0, DT.FLOAT), g.scalar(0.0, DT.FLOAT),
                          g.scalar(1e-5, DT.FLOAT))
    y = g.reshape(y, [n, c, hw])
    y = g.mul(y, g.reshape(g.tensor("w", [c], data_type=dt), [1, c, 1]))
    y = g.add(y, g.reshape(g.tensor("b", [c], data_type=dt), [1, c, 1]))
    y = g.reshape(y, list(gn.shape))
    if gn.silu:
        y = g.swish(y)
    y.set_output(True).set_name("out")
    return g.validate()


def folded(g: fg.Graph) -> fg.Graph:
    """The graph as the GPU front doors hand it to a kernel engine (views.py, output transposes too)."""
    f = fold_border_reshapes(g, transposes=True)
    assert f is not None, g.name
    return f.graph


# ---- the kernel text run under NumPy ------------------------------------------------------------------
class _Arr(np.ndarray):
    """A register tile: NumPy with Triton's ``.to(dtype)``."""

    def to(self, dtype: Any) -> _Arr:
        return np.asarray(self).astype(dtype).view(_Arr)


def _a(x: Any) -> _Arr:
    return np.asarray(x).view(_Arr)


class _Ptr:
    """A pointer (tensor of pointers): one flat buffer and element offsets into it."""

    def __init__(self, buf: np.ndarray, off: Any = 0) -> None:
        self.buf, self.off = buf, off

    def __add__(self, k: Any) -> _Ptr:
        return _Ptr(self.buf, self.off + np.asarray(k))

    __radd__ = __add__


def _where(ptr: _Ptr, mask: Any, shape: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and mask broadcast together; every offset a live lane touches in range."""
    off = np.asarray(ptr.off, np.int64)
    m = np.ones((), bool) if mask is None else np.asarray(mask, bool)
    full = np.broadcast_shapes(off.shape, m.shape, shape)
    off, m = np.broadcast_to(off, full), np.broadcast_to(m, full)
    live = off[m]
    if live.size and (live.min() < 0 or live.max() >= ptr.buf.size):
        raise IndexError(f"offset {int(live.min())}..{int(live.max())} outside a buffer of {ptr.buf.size} elements")
    return off, m


class _Emulator:
    """``triton``, ``triton.language`` and ``libdevice`` as NumPy, for the few names a row kernel uses."""

    def __init__(self) -> None:
        self.pid = 0
        self.stored: list[np.ndarray] = []
        tl = types.ModuleType("triton.language")
        f32, np_ = np.float32, np
        names: dict[str, Any] = {
            "constexpr": lambda v: v, "program_id": lambda axis: self.pid,
            "arange": lambda lo, hi: _a(np.arange(lo, hi, dtype=np.int32)),
            "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": f32, "int64": np.int64,
            "load": self.load, "store": self.store,
            "sum": lambda x, axis: _a(np_.sum(x, axis=axis)), "max": lambda x, axis: _a(np_.max(x, axis=axis)),
            "min": lambda x, axis: _a(np_.min(x, axis=axis)),
            "reduce": lambda x, axis, fn: _a(np_.prod(x, axis=axis)),
            "where": lambda c, a, b: _a(np_.where(c, a, b)),
            "exp": lambda x: _a(np_.exp(x)), "exp2": lambda x: _a(np_.exp2(x)), "log": lambda x: _a(np_.log(x)),
            "sqrt_rn": lambda x: _a(np_.sqrt(x)), "abs": lambda x: _a(np_.abs(x)),
            "erf": lambda x: _a(scipy.special.erf(x)), "sin": lambda x: _a(np_.sin(x)), "cos": lambda x: _a(np_.cos(x)),
            "floor": lambda x: _a(np_.floor(x)), "ceil": lambda x: _a(np_.ceil(x)),
            "maximum": lambda a, b, propagate_nan=None: _a(np_.maximum(a, b)),
            "minimum": lambda a, b, propagate_nan=None: _a(np_.minimum(a, b)),
            "broadcast_to": lambda x, shape: _a(np_.broadcast_to(x, tuple(shape))),
            "PropagateNan": types.SimpleNamespace(ALL=None),
        }
        for k, v in names.items():
            setattr(tl, k, v)
        libdevice = types.ModuleType("triton.language.extra.libdevice")
        for k, fn in {"tanh": np.tanh, "pow": np.power, "expm1": np.expm1, "log1p": np.log1p}.items():
            setattr(libdevice, k, lambda *a, fn=fn: _a(fn(*a)))
        extra = types.ModuleType("triton.language.extra")
        extra.libdevice = libdevice  # type: ignore[attr-defined]
        tl.extra = extra  # type: ignore[attr-defined]
        triton = types.ModuleType("triton")
        triton.jit = lambda fn: fn  # type: ignore[attr-defined]
        triton.language = tl  # type: ignore[attr-defined]
        self.modules = {"triton": triton, "triton.language": tl, "triton.language.extra": extra,
                        "triton.language.extra.libdevice": libdevice}

    def load(self, ptr: _Ptr, mask: Any = None, other: float = 0.0) -> _Arr:
        off, m = _where(ptr, mask)
        got = ptr.buf[np.where(m, off, 0)]
        return _a(np.where(m, got, np.asarray(other).astype(ptr.buf.dtype)).astype(ptr.buf.dtype))

    def store(self, ptr: _Ptr, value: Any, mask: Any = None) -> None:
        value = np.asarray(value)
        off, m = _where(ptr, mask, value.shape)
        live = off[m]
        if np.unique(live).size != live.size:
            raise AssertionError("one store writes an element twice")
        ptr.buf[live] = np.broadcast_to(value, off.shape)[m].astype(ptr.buf.dtype)
        self.stored.append(live)

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved = {k: sys.modules.get(k) for k in self.modules}
        sys.modules.update(self.modules)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


def _buffer(shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A flat buffer for a tensor of these strides, and the strided view of it."""
    size = 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
    buf = np.zeros(size, dtype)
    item = buf.itemsize
    view = np.lib.stride_tricks.as_strided(buf, shape, tuple(s * item for s in strides))
    return buf, view


def emulate(graph: fg.Graph, text: str, rows_per_program: int, rg: RowGraph,
            inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The kernel ``text`` run program by program under NumPy on ``inputs`` (laid out as the
    graph declares); each output read back from its declared strides (NaN where unwritten)."""
    emu = _Emulator()
    ptrs, views = [], {}
    for t in graph.inputs():
        buf, view = _buffer(t.shape, t.strides, t.dtype.numpy)
        view[...] = inputs[t.name]
        ptrs.append(_Ptr(buf))
    for t in graph.outputs():
        buf, view = _buffer(t.shape, t.strides, t.dtype.numpy)
        buf[...] = np.nan
        ptrs.append(_Ptr(buf))
        views[t.name] = view
    module: dict[str, Any] = {}
    with emu.installed(), np.errstate(all="ignore"):
        exec(compile(text, f"<triton kernel of {graph.name}>", "exec"), module)
        for pid in range(-(-rg.rows // rows_per_program)):
            emu.pid = pid
            module["fg_row_kernel"](*ptrs)
    return {name: np.array(v) for name, v in views.items()}


def source_of(g: fg.Graph) -> tuple[RowGraph, int, str]:
    rg = analyze(g)
    per = default_tiling(rg.rows, rg.cols)[0]
    text = kernel_source(g, rg, per)
    compile(text, f"<triton kernel of {g.name}>", "exec")  # Python before Triton sees it
    return rg, per, text


# ---- inputs and the comparison -------------------------------------------------------------------------
def draw_inputs(g: fg.Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random inputs laid out as declared: x a few deviations off zero (the variance
    must be taken around the mean), the rest standard normal."""
    out = {}
    for t in g.inputs():
        v = rng.standard_normal(t.shape)
        if t.name in ("x", "in0"):
            v = v * 2.0 + 3.0
        _, view = _buffer(t.shape, t.strides, t.dtype.numpy)
        view[...] = v.astype(t.dtype.numpy)
        out[t.name] = view
    return out


def _catch_norm_regions(monkeypatch: pytest.MonkeyPatch) -> dict[str, fg.Graph]:
    """The region graphs holding a norm that the region layer is asked to choose among, by key."""
    from fusegraph.regions import choose

    seen: dict[str, fg.Graph] = {}
    original = choose.Chooser.choose_all

    def catch(self: Any, regions: Any, inputs: Any = None, **kw: Any) -> Any:
        for r in regions:
            if any(n.kind == OpKind.LAYERNORM for n in r.graph.nodes):
                seen.setdefault(r.key, r.graph)
        return original(self, regions, inputs, **kw)

    monkeypatch.setattr(choose.Chooser, "choose_all", catch)
    return seen


def compare(got: Mapping[str, Any], ref: Mapping[str, Any], g: fg.Graph, dt: DT, what: str) -> str:
    """||got - ref|| / ||ref|| within TOL[dt] for every output (NaN fails; an all-zero
    reference is refused as a test that checks nothing); the errors as text."""
    lines = []
    for t in g.outputs():
        o = np.asarray(got[t.name], np.float64)
        r = np.asarray(ref[t.name], np.float64)
        assert o.shape == r.shape, (what, t.name, o.shape, r.shape)
        assert np.linalg.norm(r) > 0, f"{what}: the reference output '{t.name}' is all zero"
        assert np.isfinite(o).all(), f"{what}: output '{t.name}' has NaN or inf (unwritten elements are NaN)"
        rel = float(np.linalg.norm(o - r) / np.linalg.norm(r))
        mx = float(np.abs(o - r).max())
        assert rel <= TOL[dt], f"{what}: output '{t.name}' rel err {rel:.3g} > {TOL[dt]:g} (max abs {mx:.3g})"
        lines.append(f"{t.name}: rel {rel:.2e} max abs {mx:.2e}")
    return "; ".join(lines)


def reference(g: fg.Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return dict(g.execute(dict(inputs), engine="reference"))


# ---- CPU: the claim rule ----------------------------------------------------------------------------------
def test_the_onnx_group_norm_is_one_row_kernel_with_split_addresses() -> None:
    """UNet's group norm (two images, 64 channels in 32 groups, 16x16, channels-last out):
    rows are (image, group), columns (channel in group, pixel); the per-channel weight reads
    channel ``(row % 32) * 2 + col // 256`` -- with one image ``row * 2`` -- and the
    channels-last output adds ``(col % 256) * 64``."""
    gn = GN(2, 64, 32, (16, 16), nhwc=True)
    g0 = onnx_group_norm(gn, DT.FLOAT)
    f = fold_border_reshapes(g0, transposes=True)
    assert f is not None
    names = {src: to for to, src, _ in f.feeds} | {orig: to for orig, to, _ in f.results}  # the folded graph's
    for g, name in ((g0, lambda n: n), (f.graph, names.__getitem__)):
        rg = analyze(g)
        assert (rg.rows, rg.cols) == (64, 512)
        a = {k: rg.access[name(k)] for k in ("gamma", "in_scale", "out", "x")}
        assert a["gamma"] == Access("full", terms=(Term("r", 1, 32, 2), Term("c", 256, 0, 1)))
        assert a["in_scale"] == Access("row", terms=(Term("r", 1, 32, 1),))  # the group, per image
        assert a["out"] == Access("full", terms=(Term("r", 32, 0, 16384), Term("r", 1, 32, 2), Term("c", 256, 0, 1),
                                                 Term("c", 1, 256, 64)))
        assert rg.access[g.inputs()[0].name] == Access("full", 512, 1)  # the rows: plain strides
    one = analyze(onnx_group_norm(GN(1, 64, 32, (16, 16), nhwc=True), DT.FLOAT)).access
    assert one["gamma"] == Access("full", terms=(Term("r", 1, 0, 2), Term("c", 256, 0, 1)))
    assert one["in_scale"] == Access("row", 1, 0)
    # packed NCHW output of the same rows: plain row and column strides, as a plain row kernel
    assert analyze(onnx_group_norm(GN(2, 64, 32, (16, 16)), DT.FLOAT)).access["out"] == Access("full", 512, 1)


@pytest.mark.parametrize("gn", CASES, ids=str)
def test_claimed_in_both_doors_forms(gn: GN) -> None:
    """The ONNX region graph as is and folded, and the torch door's once folded: one row
    kernel each, whose text is Python; the torch door's own graph (reshapes of the [C]
    weight) is refused with the reason, and folding takes those reshapes out."""
    from fusegraph.engines.unsupported import declared_unsupported

    for g in (onnx_group_norm(gn, DT.HALF), folded(onnx_group_norm(gn, DT.HALF)), folded(torch_group_norm(gn, DT.HALF))):
        rg, _, _ = source_of(g)
        assert (rg.rows, rg.cols) == (gn.n * gn.groups, gn.k), g.name
        # selection asks the op table's declared refusals before the engine's own rule
        assert declared_unsupported("triton", g) is None, g.name
    with pytest.raises(Refusal, match="only reshapes of whole frames"):
        analyze(torch_group_norm(gn, DT.HALF))


def test_offsets_past_int32_are_64_bit_in_the_text() -> None:
    """2**31 elements (never run here): the row index and the split column terms in int64."""
    gn = GN(8192, 64, 32, (64, 64), nhwc=True)
    rg, _, text = source_of(folded(onnx_group_norm(gn, DT.HALF)))
    assert max(a.max_offset(rg.rows, rg.cols) for a in rg.access.values()) == 2**31 - 1
    assert "[:, None].to(tl.int64)" in text and "(c.to(tl.int64) % 4096) * 64" in text
    rg, _, text = source_of(folded(onnx_group_norm(GN(8191, 64, 32, (64, 64), nhwc=True), DT.HALF)))
    assert "int64" not in text


def test_refusals_say_why() -> None:
    wide = GN(1, 64, 2, (32, 32))  # K = 32768
    with pytest.raises(Refusal, match=f"up to {MAX_COLS}"):
        analyze(folded(onnx_group_norm(wide, DT.FLOAT)))
    # a reshape that moves elements across dims: [6, 4] rows viewed as [4, 6]
    g = fg.Graph("crossing", io_data_type=DT.FLOAT)
    y, _, _ = g.layernorm(g.tensor("x", [6, 4]), g.tensor("s", [1, 4]), g.tensor("b", [1, 4]), 1e-5)
    g.add(g.reshape(y, [4, 6]), g.tensor("v", [4, 1])).set_output(True)
    with pytest.raises(Refusal, match="across each other's dims"):
        analyze(g.validate())
    # a row statistic [4, 1] read against the rows reshaped to [4, 4, 1]: there it would be one value per column
    g = fg.Graph("stat", io_data_type=DT.FLOAT)
    y, mean, _ = g.layernorm(g.tensor("x", [4, 4]), g.tensor("s", [1, 4]), g.tensor("b", [1, 4]), 1e-5,
                             fg.NormFwdPhase.TRAINING)
    assert mean is not None
    g.add(g.reshape(y, [4, 4, 1]), mean).set_output(True)
    with pytest.raises(Refusal, match="as other elements of the frame"):
        analyze(g.validate())
    # a transpose inside: not a view of the frame
    g = fg.Graph("transposed", io_data_type=DT.FLOAT)
    y, _, _ = g.layernorm(g.reshape(g.tensor("x", [2, 4, 12]), [8, 12]), g.tensor("s", [1, 12]),
                          g.tensor("b", [1, 12]), 1e-5)
    g.transpose(g.reshape(y, [2, 4, 12]), [0, 2, 1]).set_output(True)
    with pytest.raises(Refusal, match="transpose"):
        analyze(g.validate())


# ---- CPU: the generated kernels run under NumPy ------------------------------------------------------------
def test_the_emulator_runs_a_plain_row_kernel_and_catches_a_wrong_address(rng: np.random.Generator) -> None:
    """The stand-in is no formality: a plain layer norm + GELU kernel agrees with the
    reference under it, and the group-norm kernel with one modulus off fails the comparison."""
    g = fg.Graph("ln_gelu", io_data_type=DT.FLOAT)
    y, _, _ = g.layernorm(g.tensor("x", [37, 96]), g.tensor("s", [1, 96]), g.tensor("b", [1, 96]), 1e-5)
    g.gelu(y).set_output(True).set_name("out")
    g.validate()
    rg, per, text = source_of(g)
    inputs = draw_inputs(g, rng)
    compare(emulate(g, text, per, rg, inputs), reference(g, inputs), g, DT.FLOAT, g.name)
    g = folded(onnx_group_norm(GN(2, 64, 32, (16, 16), nhwc=True), DT.FLOAT))
    rg, per, text = source_of(g)
    inputs = draw_inputs(g, rng)
    want = reference(g, inputs)
    compare(emulate(g, text, per, rg, inputs), want, g, DT.FLOAT, g.name)
    assert "(r % 32) * 2" in text and "(c % 256) * 64" in text
    with pytest.raises(AssertionError, match="rel err"):
        compare(emulate(g, text.replace("(r % 32) * 2", "(r % 16) * 2", 1), per, rg, inputs), want, g, DT.FLOAT, "wrong")


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("gn", CASES, ids=str)
def test_group_norm_kernels_under_numpy_match_the_reference(gn: GN, dt: DT, rng: np.random.Generator) -> None:
    """Each form's kernel text, run under NumPy on fresh random data, against float64."""
    forms = [onnx_group_norm(gn, dt), folded(onnx_group_norm(gn, dt)), folded(torch_group_norm(gn, dt))]
    if gn.k == MAX_COLS and dt != DT.FLOAT:
        forms = forms[1:2]  # the widest rows once per type (the reference's time)
    for g in forms:
        rg, per, text = source_of(g)
        inputs = draw_inputs(g, rng)
        compare(emulate(g, text, per, rg, inputs), reference(g, inputs), g, dt, g.name)


# ---- CPU: random row graphs with reshapes ---------------------------------------------------------------
def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _grouping(parts: list[int], rng: np.random.Generator) -> list[int]:
    """``parts`` (in order) multiplied in random consecutive groups, with unit dims here and there."""
    dims, cur = [], 1
    for k, f in enumerate(parts):
        cur *= f
        if k == len(parts) - 1 or rng.random() < 0.5:
            dims.append(cur)
            cur = 1
    if rng.random() < 0.2:
        dims.insert(int(rng.integers(len(dims) + 1)), 1)
    return dims or [1]


def _layout(shape: list[int], rng: np.random.Generator) -> list[int]:
    """Packed strides in a random memory order (now and then), with padding after the innermost dim (rarely)."""
    order = list(range(len(shape)))
    if rng.random() < 0.5:
        rng.shuffle(order)
    strides, step = [0] * len(shape), 1
    for k in reversed(order):
        strides[k] = step
        step *= shape[k] + (1 if rng.random() < 0.1 else 0)
    return strides


def random_reshaped_row_graph(rng: np.random.Generator, index: int) -> fg.Graph:
    """A row op over a frame of random rows and columns, fed as a reshape of an input of
    another shape (at times), then a chain of reshapes (mostly groupings of the frame's
    prime factors in order, at times any factorization: refused), broadcast operands with
    random unit dims and memory orders, unary ops and the row statistic; outputs in random
    memory orders."""
    dt = DTYPES[int(rng.integers(3))]
    g = fg.Graph(f"rand{index}_{dt.value}", io_data_type=dt)
    rows = [int(rng.choice([1, 2, 3, 4, 6])) for _ in range(int(rng.integers(1, 3)))]
    cols = [int(rng.choice([2, 3, 5, 8, 12, 16])) for _ in range(int(rng.integers(1, 3)))]
    frame = rows + cols
    atoms = [f for d in frame for f in (_factors(d) or [1])]
    total = math.prod(frame)
    shape_in = _grouping(atoms, rng) if rng.random() < 0.5 else frame
    x = g.tensor("x", shape_in, _layout(shape_in, rng))
    x = g.reshape(x, frame) if shape_in != frame else x
    op = str(rng.choice(["layernorm", "rmsnorm", "softmax", "sum"]))
    stat = None
    if op in ("layernorm", "rmsnorm"):
        x2 = g.reshape(x, [math.prod(rows), math.prod(cols)]) if len(frame) != 2 else x
        scale = g.tensor("scale", [1, math.prod(cols)])
        if op == "layernorm":
            y, stat, _ = g.layernorm(x2, scale, g.tensor("bias", [1, math.prod(cols)]), 1e-5, fg.NormFwdPhase.TRAINING)
        else:
            y, stat = g.rmsnorm(x2, scale, 1e-5, fg.NormFwdPhase.TRAINING)
    elif op == "softmax":
        flat = g.reshape(x, [*rows, math.prod(cols)]) if len(cols) > 1 else x
        y = g.softmax(flat, -1)
    else:
        y = g.reduction(x, ReductionMode.SUM, rows + [1] * len(cols))
        y = g.add(g.reshape(g.reshape(x, [total]), frame) if rng.random() < 0.3 else x, y)
    cur = y
    for _ in range(int(rng.integers(1, 5))):
        step = rng.random()
        if step < 0.35:
            shape = _grouping(atoms, rng) if rng.random() < 0.85 else _grouping(_factors(total)[::-1], rng)
            cur = g.reshape(cur, shape)
        elif step < 0.75:
            shape = [d if rng.random() < 0.5 else 1 for d in cur.shape]
            cur = (g.mul if rng.random() < 0.5 else g.add)(cur, g.tensor(f"w{len(g.nodes)}", shape, _layout(shape, rng)))
        elif step < 0.9:
            cur = g.sigmoid(cur) if rng.random() < 0.5 else g.tanh(cur)
        elif stat is not None and tuple(cur.shape) == tuple(y.shape):
            cur = g.sub(cur, stat)
    cur.set_output(True).set_name("out").set_stride(_layout(list(cur.shape), rng))
    if stat is not None and rng.random() < 0.3:
        stat.set_output(True).set_name("stat").set_data_type(DT.FLOAT)
    return g.validate()


RANDOM_GRAPHS = 80


def test_random_reshaped_row_graphs_under_numpy_match_the_reference() -> None:
    """Each random graph the rule takes runs under NumPy as the reference computes it (every
    address in range, no element written twice, none left unwritten); most are taken, and
    every refusal is one of the rule's reasons."""
    rng = np.random.default_rng(20261127)
    taken, degenerate, refused = 0, 0, collections.Counter[str]()
    for i in range(RANDOM_GRAPHS):
        g = random_reshaped_row_graph(rng, i)
        try:
            rg, per, text = source_of(g)
        except Refusal as why:
            refused[str(why).split(":")[-1][:70]] += 1
            continue
        taken += 1
        inputs = draw_inputs(g, rng)
        want = reference(g, inputs)
        if any(not np.linalg.norm(np.asarray(v, np.float64)) for v in want.values()):
            degenerate += 1  # e.g. a sigmoid saturated to 0 in half precision: nothing to compare
            continue
        dt = g.inputs()[0].dtype
        compare(emulate(g, text, per, rg, inputs), want, g, dt, f"{g.name}: {g.to_json()}")
    print(f"random reshaped row graphs: {taken} taken ({degenerate} with an all-zero reference), refused {dict(refused)}")
    assert taken >= RANDOM_GRAPHS // 2 and degenerate <= 2, (taken, degenerate, refused)


# ---- CPU: the bench's UNet, its real region graphs ----------------------------------------------------------
def _bench() -> Any:
    return load_bench("bench_onnx_gpu", "bench_onnx_gpu_for_groupnorm")


def export_unet(tmp: Path, batch: int, seed: int) -> tuple[Path, Any, Any]:
    """bench_onnx_gpu's ``unet`` (its export, random nonzero parameters): path, module, input."""
    torch = pytest.importorskip("torch", reason="the bench's UNet is a torch module exported to ONNX")
    bench = _bench()
    torch.manual_seed(seed)
    module, inputs, names = bench.MODELS["unet"][1](batch)
    bench._no_zero_parameters(module)
    module = module.eval()
    path = tmp / f"unet_b{batch}.onnx"
    with torch.no_grad():
        bench.export(module, inputs, names, path)
    return path, module, inputs[0]


def unet_group_norm_regions(path: Path, monkeypatch: pytest.MonkeyPatch, x: np.ndarray) -> list[fg.Graph]:
    """The region graphs of the UNet's GroupNorms as the ONNX door builds them (the CPU
    smoke run's options: regions on, torch pinned), caught where the regions are chosen."""
    import fusegraph.onnx as fgo
    seen = _catch_norm_regions(monkeypatch)
    sess = fgo.InferenceSession(str(path), providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                provider_options=[{"regions": "on", "engine": "torch", "runners": "off",
                                                   "floor_mode": "inline"}, {}])
    sess.run(None, {"x": x})
    return list(seen.values())


def test_the_bench_unets_group_norm_regions_are_claimed_and_run_under_numpy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """Every distinct GroupNorm region of bench_onnx_gpu's UNet (two images): folded as the
    GPU path folds it, one row kernel, which under NumPy gives the reference's answer on fresh
    data; as the region comes (not folded) claimed too, but for the norm before the attention,
    whose transpose for it is only folded (a reason given)."""
    path, _, x = export_unet(tmp_path, 2, int(rng.integers(1 << 31)))
    graphs = unet_group_norm_regions(path, monkeypatch, x.numpy())
    assert len(graphs) >= 8, [g.name for g in graphs]  # nine distinct group norms in this UNet
    refused = []
    for g in graphs:
        try:
            analyze(g)
        except Refusal as why:
            refused.append(str(why))
        f = folded(g)
        rg, per, text = source_of(f)
        assert rg.cols <= MAX_COLS
        assert any(a.terms for a in rg.access.values()), "the per-channel affine reads split addresses"
        inputs = draw_inputs(f, rng)
        print(f.name, f"{rg.rows}x{rg.cols}", compare(emulate(f, text, per, rg, inputs), reference(f, inputs),
                                                      f, DT.FLOAT, f.name))
    assert len(refused) <= 1 and all("transpose" in r for r in refused), refused


# ---- CPU: the torch door's own region graph ---------------------------------------------------------------
def torch_door_norm_regions(model: Any, x: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[fg.Graph]]:
    """``fusegraph.torch.explain``'s report (rest eager) and the region graphs with a norm it chose among."""
    from fusegraph.torch.explainer import explain

    seen = _catch_norm_regions(monkeypatch)
    report = explain(model, x, options={"rest": "eager"})
    return report, list(seen.values())


def _gn_silu_net() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(32, 64), nn.SiLU(), nn.Conv2d(64, 8, 3, padding=1))


def test_the_torch_doors_group_norm_is_claimed_once_folded(monkeypatch: pytest.MonkeyPatch,
                                                          rng: np.random.Generator) -> None:
    """``aten.native_group_norm`` + SiLU as the torch door converts it (its [C] weight
    reshaped to [1, C, 1] inside the graph: refused with the reason), folded as its GPU path
    folds it (plans._kernel_build): one row kernel, which under NumPy gives the reference's
    answer."""
    torch = pytest.importorskip("torch", reason="the torch door needs torch")
    torch.manual_seed(int(rng.integers(1 << 31)))
    with torch.no_grad():
        _, graphs = torch_door_norm_regions(_gn_silu_net().eval(), torch.randn(2, 3, 16, 16), monkeypatch)
    assert len(graphs) == 1, [g.name for g in graphs]
    (g,) = graphs
    with pytest.raises(Refusal, match="only reshapes of whole frames"):
        analyze(g)
    f = folded(g)
    rg, per, text = source_of(f)
    assert (rg.rows, rg.cols) == (64, 512)
    inputs = draw_inputs(f, rng)
    compare(emulate(f, text, per, rg, inputs), reference(f, inputs), f, DT.FLOAT, f.name)


# ---- GPU ----------------------------------------------------------------------------------------------------
DEVICE = "cuda:0"


def _triton() -> Any:
    from fusegraph.engines.triton import TritonEngine

    engine = TritonEngine()
    state = engine.available()
    if not state:
        pytest.fail(f"GPU test without a usable Triton engine: {state.reason}")
    return engine


def _on_gpu(build: Callable[[fg.Graph], Any], g: fg.Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    from fusegraph.select.partition import to_host

    plan = build(g)
    got = plan.execute(dict(inputs))
    return {t.name: to_host(got[t.name]) for t in g.outputs()}


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("gn", CASES, ids=str)
def test_group_norm_on_triton(gn: GN, dt: DT, rng: np.random.Generator) -> None:
    """The ONNX region graph built on Triton as it comes, and through folded_kernel_plan as
    the GPU doors take it (torch door's graph too), against float64 on fresh random data."""
    from fusegraph.regions.views import folded_kernel_plan
    from fusegraph.runtime.handle import as_handle

    engine = _triton()
    handle = as_handle(DEVICE)
    direct = lambda g: engine.build(g, handle)  # noqa: E731
    via_views = lambda g: folded_kernel_plan(g, handle, engines=("triton",), transposes=True)  # noqa: E731
    for g, build in ((onnx_group_norm(gn, dt), direct), (onnx_group_norm(gn, dt), via_views),
                     (torch_group_norm(gn, dt), via_views)):
        inputs = draw_inputs(g, rng)
        print(g.name, "direct" if build is direct else "folded",
              compare(_on_gpu(build, g, inputs), reference(g, inputs), g, dt, g.name))


@pytest.mark.gpu
def test_random_reshaped_row_graphs_on_triton() -> None:
    """The first 30 random graphs the CPU test runs under NumPy, built on Triton, against float64."""
    from fusegraph.runtime.handle import as_handle

    engine = _triton()
    handle = as_handle(DEVICE)
    rng = np.random.default_rng(20261127)
    done = 0
    for i in range(RANDOM_GRAPHS):
        g = random_reshaped_row_graph(rng, i)
        try:
            analyze(g)
        except Refusal:
            continue
        inputs = draw_inputs(g, rng)
        want = reference(g, inputs)
        if any(not np.linalg.norm(np.asarray(v, np.float64)) for v in want.values()):
            continue
        compare(_on_gpu(lambda g: engine.build(g, handle), g, inputs), want, g, g.inputs()[0].dtype,
                f"{g.name}: {g.to_json()}")
        done += 1
        if done == 30:
            break
    assert done == 30, done


@pytest.mark.gpu
def test_group_norm_wider_than_a_row_kernel_is_refused_on_the_gpu() -> None:
    from fusegraph.runtime.handle import as_handle

    engine = _triton()
    s = engine.supports(folded(onnx_group_norm(GN(1, 64, 2, (32, 32)), DT.FLOAT)), as_handle(DEVICE))
    assert not s and f"up to {MAX_COLS}" in s.reason, s.reason


@pytest.mark.gpu
def test_the_torch_doors_group_norm_region_on_triton(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """The torch door's own GroupNorm + SiLU region graph (converted on the CPU, as on any
    device), built as its GPU path builds a region (plans._kernel_build: a kernel engine,
    else folded), on Triton, against float64."""
    import torch

    from fusegraph.runtime.handle import as_handle
    from fusegraph.torch.plans import _kernel_build

    _triton()
    torch.manual_seed(int(rng.integers(1 << 31)))
    with torch.no_grad():
        _, graphs = torch_door_norm_regions(_gn_silu_net().eval(), torch.randn(2, 3, 16, 16), monkeypatch)
    assert len(graphs) == 1
    (g,) = graphs
    plan = _kernel_build(g, as_handle(DEVICE))
    assert plan.config.engine == "triton", plan.config
    inputs = draw_inputs(g, rng)
    print(g.name, compare(_on_gpu(lambda _: plan, g, inputs), reference(g, inputs), g, DT.FLOAT, g.name))


@pytest.mark.gpu
def test_the_bench_unet_runs_its_group_norms_on_triton(tmp_path: Path, rng: np.random.Generator) -> None:
    """bench_onnx_gpu's UNet (two images, fp32) on cuda:0 with the provider's defaults: the
    regions report shows its GroupNorm regions on fusegraph:triton (any elsewhere with the
    reason), and the output agrees with PyTorch's fp32 CPU forward within 1e-3 relative."""
    import torch

    import fusegraph.onnx as fgo

    _triton()
    path, module, x = export_unet(tmp_path, 2, int(rng.integers(1 << 31)))
    with torch.no_grad():
        want = module(x).numpy().astype(np.float64)
    sess = fgo.InferenceSession(str(path), providers=["FusegraphExecutionProvider", "CPUExecutionProvider"],
                                provider_options=[{"device": DEVICE, "cache_dir": str(tmp_path / "cache")}, {}])
    got = np.asarray(sess.run(None, {"x": x.numpy()})[0], np.float64)
    report = sess.partition_report()
    norms = [r for s in report.subgraphs for r in s.regions if "InstanceNormalization" in r.op_types]
    for r in norms:
        print(f"r{r.index} {r.pattern}: {r.where} ({r.source}; {r.why[:300]})")
    assert norms, str(report)
    on_triton = [r for r in norms if r.where.startswith("fusegraph:triton")]
    assert on_triton, str(report)
    for r in norms:
        assert r.where.startswith("fusegraph:triton") or r.why, (r.index, r.where)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"UNet b2 fp32: rel err vs PyTorch {rel:.2e}; group norms on triton {len(on_triton)} of {len(norms)}")
    assert np.isfinite(got).all() and rel <= 1e-3, rel


@pytest.mark.parametrize("wrong", [False, True], ids=["agrees", "one_row_off"])
def test_the_first_build_of_a_reshaped_row_kernel_is_checked_against_the_torch_engine(wrong: bool) -> None:
    """Until row kernels through reshapes have run on a GPU, each one's first build is run
    once against the torch engine's op-by-op run of the same graph; a plan that disagrees is
    refused with the error and its reproducer, one that agrees is not checked again. A
    stand-in for the Triton plan on the CPU: the torch engine's own result, one row scaled
    where ``wrong``."""
    torch = pytest.importorskip("torch", reason="the self-check compares with the torch engine")
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.registry import REGISTRY
    from fusegraph.engines.triton.engine import TritonEngine
    from fusegraph.errors import UnsupportedError
    from fusegraph.runtime.handle import as_handle

    g = onnx_group_norm(GN(2, 8, 4, (3, 5), silu=True), DT.FLOAT)
    handle = as_handle("cpu")
    eager = REGISTRY.get("torch").build(g, handle, EngineConfig("torch"))
    runs = []

    class StandIn:
        def __init__(self) -> None:
            self.device = torch.device("cpu")
            self._tdt = {t.name: torch.float32 for t in g.inputs()}

        def execute(self, pack: Mapping[str, Any]) -> dict[str, Any]:
            runs.append(1)
            out = {k: torch.as_tensor(v).clone() for k, v in eager.execute(pack).items()}
            if wrong:
                out["out"].view(-1)[:15] *= 1.5  # a few elements on one row, as a wrong address would
            return out

    engine = TritonEngine()
    if wrong:
        with pytest.raises(UnsupportedError, match=r"disagrees with the torch engine.*relative error .*reproducer"):
            engine._self_check(StandIn(), g, handle, "# kernel text", "k" * 24)
    else:
        engine._self_check(StandIn(), g, handle, "# kernel text", "k" * 24)
        engine._self_check(StandIn(), g, handle, "# kernel text", "k" * 24)
        assert len(runs) == 1  # checked once per kernel

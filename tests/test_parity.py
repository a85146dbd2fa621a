"""cuDNN-frontend parity where users rely on it (issue 16 item 2), on every CPU engine.

Each case is a graph and pack as a cuDNN user writes them: input views that read memory more
than once (broadcast and sliding-window strides), integer select conditions, attention with
h_k != h_v, outputs written through the strides of a larger buffer (rotary embedding into a
slice of a packed QKV tensor, a convolution into a channel slice), and int8 convolution
accumulating in INT32. Every case runs on the reference engine, then on each engine that is
available here: the engine either returns the reference's numbers (float64 reference,
per-dtype tolerance from fusegraph.select.autotune) or refuses at selection with an
UnsupportedError whose reason names the node -- never a CompileError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.engines.base import EngineConfig
from fusegraph.errors import CompileError, UnsupportedError, ValidationError, VariantPackError
from fusegraph.reference.executor import run_reference
from fusegraph.runtime.variant_pack import resolve_pack
from fusegraph.select.autotune import compare, tolerance
from fusegraph.select.partition import to_host

F32, F16, BF16 = DataType.FLOAT, DataType.HALF, DataType.BFLOAT16
I8, U8, I32, I64 = DataType.INT8, DataType.UINT8, DataType.INT32, DataType.INT64
ENGINES = ("reference", "iree", "torch")
Rng = np.random.Generator


@dataclass
class Built:
    graph: fg.Graph
    pack: dict[str, Any]
    # outputs given in the pack: name -> (the whole buffer, its contents before the run)
    buffers: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Rng], Built]


CASES: list[Case] = []


def case(name: str) -> Callable[[Callable[[Rng], Built]], Callable[[Rng], Built]]:
    def deco(fn: Callable[[Rng], Built]) -> Callable[[Rng], Built]:
        CASES.append(Case(name, fn))
        return fn

    return deco


def _rand(rng: Rng, shape: tuple[int, ...] | list[int], dt: DataType) -> np.ndarray:
    if dt == DataType.BOOLEAN:
        return rng.random(tuple(shape)) > 0.3
    if dt.is_integer:
        lo, hi = (0, 8) if dt == U8 else (-8, 8)
        return rng.integers(lo, hi, tuple(shape)).astype(dt.numpy)
    return rng.standard_normal(tuple(shape)).astype(dt.numpy)


def _strides_of(a: np.ndarray) -> list[int]:
    return [s // a.itemsize for s in a.strides]


# =============================================================================================
# (a) inputs whose strides broadcast or overlap
# =============================================================================================
@case("input_sliding_window")
def _(rng: Rng) -> Built:
    """A Hankel (sliding-window) view: row i is buf[i:i+6]; strides (1, 1) overlap."""
    buf = _rand(rng, [9], F32)
    win = np.lib.stride_tricks.as_strided(buf, (4, 6), (4, 4), writeable=False)
    g = fg.Graph(name="sliding", io_data_type=F32)
    x = g.tensor("x", [4, 6], [1, 1])
    w = g.tensor("w", [6, 3])
    s = g.tensor("s", [4, 6])
    y = g.matmul(g.relu(g.mul(x, s, name="scale"), name="act"), w, name="proj")
    y.set_name("y").set_output(True)
    return Built(g, {"x": win, "w": _rand(rng, [6, 3], F32), "s": _rand(rng, [4, 6], F32)})


@case("input_sliding_window_conv_nchw")
def _(rng: Rng) -> Built:
    """Overlapping strides on a conv image: every row of the image is a window of one signal."""
    sig = _rand(rng, [2 * 3 * 16 + 8], F16)
    x = np.lib.stride_tricks.as_strided(sig, (2, 3, 8, 8), (3 * 16 * 2, 16 * 2, 2, 2), writeable=False)
    g = fg.Graph(name="window_conv", io_data_type=F16, compute_data_type=F32)
    xt = g.tensor("x", [2, 3, 8, 8], _strides_of(x))
    wt = g.tensor("w", [4, 3, 3, 3])
    g.conv_fprop(xt, wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv").set_name("y").set_output(True)
    return Built(g, {"x": x, "w": _rand(rng, [4, 3, 3, 3], F16)})


@case("input_broadcast_matmul_batch")
def _(rng: Rng) -> Built:
    """One weight shared by every batch: np.broadcast_to, stride 0 on the batch axis."""
    a = _rand(rng, [3, 5, 4], F32)
    wrow = _rand(rng, [4, 6], F32)
    wb = np.broadcast_to(wrow, (3, 4, 6))
    g = fg.Graph(name="bcast_mm", io_data_type=F32)
    at = g.tensor("a", [3, 5, 4])
    wt = g.tensor("w", [3, 4, 6], _strides_of(wb))
    g.matmul(at, wt, name="mm").set_name("y").set_output(True)
    return Built(g, {"a": a, "w": wb})


@case("input_broadcast_bias_nhwc")
def _(rng: Rng) -> Built:
    """A bias broadcast over N, H, W of an NHWC activation, passed as a broadcast view."""
    n, c, h, w = 2, 8, 4, 4
    x = np.ascontiguousarray(_rand(rng, [n, h, w, c], F32)).transpose(0, 3, 1, 2)
    b = np.broadcast_to(_rand(rng, [1, c, 1, 1], F32), (n, c, h, w))
    g = fg.Graph(name="bcast_bias", io_data_type=F32)
    xt = g.tensor("x", [n, c, h, w], _strides_of(x))
    bt = g.tensor("b", [n, c, h, w], _strides_of(b))
    g.gelu(g.add(xt, bt, name="bias"), name="act").set_name("y").set_output(True)
    return Built(g, {"x": x, "b": b})


@case("input_torch_expand")
def _(rng: Rng) -> Built:
    """torch tensors in, as a torch user writes the broadcast: expand (stride 0) and a
    transposed weight; torch tensors come back."""
    torch = pytest.importorskip("torch", reason="torch is optional; this case passes torch tensors")
    x = torch.from_numpy(_rand(rng, [4, 1, 6], F32)).expand(4, 5, 6)
    w = torch.from_numpy(_rand(rng, [3, 6], F32)).t()
    g = fg.Graph(name="torch_expand", io_data_type=F32)
    xt = g.tensor("x", [4, 5, 6], list(x.stride()))
    wt = g.tensor("w", [6, 3], list(w.stride()))
    g.matmul(g.sigmoid(xt, name="sig"), wt, name="mm").set_name("y").set_output(True)
    return Built(g, {"x": x, "w": w})


@case("input_overlap_given_dense_consistent")
def _(rng: Rng) -> Built:
    """A tensor declared overlapping, passed as a dense array whose values agree with the
    declared layout: laid out as declared (the consistency is checked)."""
    buf = _rand(rng, [9], F32)
    dense = np.ascontiguousarray(np.lib.stride_tricks.as_strided(buf, (4, 6), (4, 4)))
    g = fg.Graph(name="overlap_dense", io_data_type=F32)
    x = g.tensor("x", [4, 6], [1, 1])
    g.exp(x, name="e").set_name("y").set_output(True)
    return Built(g, {"x": dense})


# =============================================================================================
# (b) integer select conditions
# =============================================================================================
def _select(rng: Rng, cdt: DataType, cshape: list[int], dt: DataType = F32) -> Built:
    g = fg.Graph(name=f"select_{cdt.value}", io_data_type=dt)
    a, b = g.tensor("a", [4, 6]), g.tensor("b", [4, 6])
    c = g.tensor("cond", cshape, data_type=cdt)
    g.binary_select(a, b, c, name="sel").set_name("y").set_output(True)
    cond = _rand(rng, cshape, cdt)
    return Built(g, {"a": _rand(rng, [4, 6], dt), "b": _rand(rng, [4, 6], dt), "cond": cond})


for _cdt in (I32, I8, U8, I64):
    case(f"select_cond_{_cdt.value}")(lambda rng, cdt=_cdt: _select(rng, cdt, [4, 6]))
case("select_cond_int32_broadcast")(lambda rng: _select(rng, I32, [1, 6]))
case("select_cond_int8_half")(lambda rng: _select(rng, I8, [4, 1], F16))


@case("select_cond_int32_of_matmul")
def _(rng: Rng) -> Built:
    """An INT32 mask on a matmul result, as cuDNN's masked-fill tests write it."""
    g = fg.Graph(name="masked_mm", io_data_type=F32)
    a, b = g.tensor("a", [2, 5, 8]), g.tensor("b", [2, 8, 5])
    c = g.tensor("mask", [1, 5, 5], data_type=I32)
    s = g.matmul(a, b, name="mm")
    g.binary_select(s, g.scalar(-1e4), c, name="fill").set_name("y").set_output(True)
    return Built(g, {"a": _rand(rng, [2, 5, 8], F32), "b": _rand(rng, [2, 8, 5], F32),
                     "mask": rng.integers(0, 2, (1, 5, 5)).astype(np.int32)})


@case("select_cond_bool_of_matmul_batched")
def _(rng: Rng) -> Built:
    """A BOOLEAN condition tensor read by a matmul's consumer (IREE 3.13 failed to compile
    this with data tiling: 'linalg.pack' expected an i8 padding value, got i1)."""
    g = fg.Graph(name="bool_masked_mm", io_data_type=F32)
    a, b = g.tensor("a", [2, 4, 5, 8]), g.tensor("b", [2, 4, 8, 5])
    c = g.tensor("mask", [5, 5], data_type=DataType.BOOLEAN)
    g.binary_select(g.matmul(a, b, name="mm"), g.scalar(-1e4), c, name="fill").set_name("y").set_output(True)
    return Built(g, {"a": _rand(rng, [2, 4, 5, 8], F32), "b": _rand(rng, [2, 4, 8, 5], F32),
                     "mask": _rand(rng, [5, 5], DataType.BOOLEAN)})


# =============================================================================================
# (c) attention with h_k != h_v, and causal variants
# =============================================================================================
def _sdpa(rng: Rng, dt: DataType, hk: int, hv: int, *, causal: bool = False, mask: DataType | None = None,
          b: int = 2, sq: int = 5, skv: int = 7, dv: int = 8, mshape: list[int] | None = None) -> Built:
    g = fg.Graph(name="attn", io_data_type=dt)
    q = g.tensor("q", [b, 4, sq, 8])
    k = g.tensor("k", [b, hk, skv, 8])
    v = g.tensor("v", [b, hv, skv, dv])
    pack = {"q": _rand(rng, [b, 4, sq, 8], dt), "k": _rand(rng, [b, hk, skv, 8], dt),
            "v": _rand(rng, [b, hv, skv, dv], dt)}
    m = None
    if mask is not None:
        shape = mshape or [1, 1, sq, skv]
        m = g.tensor("mask", shape, data_type=mask)
        arr = _rand(rng, shape, mask)
        if mask == DataType.BOOLEAN:
            arr[..., 0] = True  # every row keeps a key: no all-masked row (NaN by definition)
        pack["mask"] = arr
    g.sdpa(q, k, v, causal=causal, mask=m, name="attn").set_name("o").set_output(True)
    return Built(g, pack)


case("sdpa_hk2_hv1")(lambda rng: _sdpa(rng, F32, 2, 1))
case("sdpa_hk1_hv4_dv6")(lambda rng: _sdpa(rng, F32, 1, 4, dv=6))
case("sdpa_hk4_hv2_causal_half")(lambda rng: _sdpa(rng, F16, 4, 2, causal=True))
case("sdpa_hk2_hv1_bool_mask_bf16")(lambda rng: _sdpa(rng, BF16, 2, 1, mask=DataType.BOOLEAN))
for _ms in ([7, 7], [1, 4, 7, 7], [2, 1, 1, 7]):
    case(f"sdpa_causal_bool_mask_{'x'.join(map(str, _ms))}")(
        lambda rng, ms=_ms: _sdpa(rng, F32, 2, 2, causal=True, mask=DataType.BOOLEAN, sq=7, mshape=ms)
    )
case("sdpa_causal_float_mask_half")(lambda rng: _sdpa(rng, F16, 2, 2, causal=True, mask=F16, sq=7))
case("sdpa_causal_sq_gt_skv")(lambda rng: _sdpa(rng, F32, 2, 1, causal=True, mask=DataType.BOOLEAN, sq=7, skv=5))


# =============================================================================================
# (d) outputs that are strided views into a larger buffer
# =============================================================================================
def _sentinel(shape: tuple[int, ...], dt: np.dtype[Any]) -> np.ndarray:
    return np.full(shape, 1234.5, dt)


def _rotary(rng: Rng, dt: DataType, given: bool) -> Built:
    """Rotary embedding of q written in place into the q slice of a packed QKV buffer
    [B, S, 3*D]: y = x * cos + rotate_half(x) * sin, y's strides those of qkv[..., :D]."""
    bsz, s, d = 2, 5, 16
    qkv = _sentinel((bsz, s, 3 * d), dt.numpy)
    ys = qkv[..., :d]
    g = fg.Graph(name="rope", io_data_type=dt, compute_data_type=F32)
    x = g.tensor("x", [bsz, s, d])
    cos, sin = g.tensor("cos", [1, s, d]), g.tensor("sin", [1, s, d])
    lo = g.slice(x, [0, 0, 0], [bsz, s, d // 2], name="lo")
    hi = g.slice(x, [0, 0, d // 2], [bsz, s, d], name="hi")
    rot = g.concatenate([g.neg(hi, name="neg"), lo], axis=2, name="rot")
    y = g.add(g.mul(x, cos, name="xc"), g.mul(rot, sin, name="rs"), name="rope")
    y.set_name("y").set_stride(_strides_of(ys)).set_output(True)
    pack: dict[str, Any] = {"x": _rand(rng, [bsz, s, d], dt), "cos": _rand(rng, [1, s, d], dt),
                            "sin": _rand(rng, [1, s, d], dt)}
    if not given:
        return Built(g, pack)
    pack["y"] = ys
    return Built(g, pack, {"y": (qkv, qkv.copy())})


case("output_rotary_into_packed_qkv")(lambda rng: _rotary(rng, F32, True))
case("output_rotary_into_packed_qkv_half")(lambda rng: _rotary(rng, F16, True))
case("output_rotary_strided_returned")(lambda rng: _rotary(rng, F32, False))


@case("output_conv_into_channel_slice_nhwc")
def _(rng: Rng) -> Built:
    """A convolution writing channels 8..15 of a 24-channel NHWC buffer (concat in place)."""
    n, c, h, w, k = 2, 4, 6, 6, 8
    big = _sentinel((n, h, w, 3 * k), np.float32)
    ys = big[..., k:2 * k].transpose(0, 3, 1, 2)
    x = np.ascontiguousarray(_rand(rng, [n, h, w, c], F32)).transpose(0, 3, 1, 2)
    g = fg.Graph(name="conv_slice", io_data_type=F32)
    xt = g.tensor("x", [n, c, h, w], _strides_of(x))
    wt = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    wa = np.ascontiguousarray(_rand(rng, [k, 3, 3, c], F32)).transpose(0, 3, 1, 2)
    y = g.relu(g.conv_fprop(xt, wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv"), name="act")
    y.set_name("y").set_stride(_strides_of(ys)).set_output(True)
    return Built(g, {"x": x, "w": wa, "y": ys}, {"y": (big, big.copy())})


@case("output_two_slices_of_one_buffer")
def _(rng: Rng) -> Built:
    """Two outputs interleaved in one buffer (even and odd columns): no overlap, one buffer."""
    buf = _sentinel((4, 12), np.float32)
    g = fg.Graph(name="two_slices", io_data_type=F32)
    x = g.tensor("x", [4, 6])
    g.exp(x, name="e").set_name("even").set_stride([12, 2]).set_output(True)
    g.tanh(x, name="t").set_name("odd").set_stride([12, 2]).set_output(True)
    return Built(g, {"x": _rand(rng, [4, 6], F32), "even": buf[:, 0::2], "odd": buf[:, 1::2]},
                 {"even": (buf, buf.copy())})


# =============================================================================================
# (e) int8 convolution accumulating in INT32
# =============================================================================================
def _int8_conv(rng: Rng, xdt: DataType, out: DataType | None, *, groups: int = 1, nhwc: bool = False) -> Built:
    n, c, h, w, k = 2, 8, 7, 7, 8
    g = fg.Graph(name="int8_conv", io_data_type=xdt)
    xs = fg.strides_for([n, c, h, w], "NHWC") if nhwc else None
    x = g.tensor("x", [n, c, h, w], xs, data_type=xdt)
    wt = g.tensor("w", [k, c // groups, 3, 3], data_type=I8)
    y = g.conv_fprop(x, wt, padding=[1, 1], stride=[2, 2], dilation=[1, 1], compute_data_type=I32, name="conv")
    if out is not None:
        y.set_data_type(out)
    y.set_name("y").set_output(True)
    xa = _rand(rng, [n, h, w, c], xdt).transpose(0, 3, 1, 2) if nhwc else _rand(rng, [n, c, h, w], xdt)
    return Built(g, {"x": np.ascontiguousarray(xa) if not nhwc else xa, "w": _rand(rng, [k, c // groups, 3, 3], I8)})


case("int8_conv_int32_out")(lambda rng: _int8_conv(rng, I8, None))
case("int8_conv_float_out")(lambda rng: _int8_conv(rng, I8, F32))
case("uint8_x_int8_conv_int32_out_nhwc")(lambda rng: _int8_conv(rng, U8, None, nhwc=True))
case("int8_conv_grouped_int32_out")(lambda rng: _int8_conv(rng, I8, None, groups=2))


@case("int8_conv_dequant_half")
def _(rng: Rng) -> Built:
    """int8 conv -> INT32 -> cast to FLOAT -> * scale + bias -> HALF: a quantized layer."""
    g = fg.Graph(name="int8_dequant", io_data_type=F16, intermediate_data_type=F32)
    x = g.tensor("x", [2, 8, 6, 6], data_type=I8)
    wt = g.tensor("w", [16, 8, 3, 3], data_type=I8)
    scale, bias = g.tensor("scale", [1, 16, 1, 1], data_type=F32), g.tensor("bias", [1, 16, 1, 1], data_type=F32)
    acc = g.conv_fprop(x, wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv")
    f = g.identity(acc, name="to_float").set_data_type(F32)
    y = g.relu(g.add(g.mul(f, scale, name="dq"), bias, name="b"), name="act")
    y.set_name("y").set_output(True)
    return Built(g, {"x": _rand(rng, [2, 8, 6, 6], I8), "w": _rand(rng, [16, 8, 3, 3], I8),
                     "scale": (np.abs(_rand(rng, [1, 16, 1, 1], F32)) * 1e-2).astype(np.float32),
                     "bias": _rand(rng, [1, 16, 1, 1], F32)})


# =============================================================================================
# the harness
# =============================================================================================
def _build(g: fg.Graph, engine: str, config: EngineConfig | None = None) -> Any:
    """The engine's plan, or a skip when the engine is not installed here; a refusal must
    be an UnsupportedError naming a node of the graph (never a CompileError)."""
    try:
        return g.build(engine=engine, config=config) if config is not None else g.build(engine=engine)
    except UnsupportedError as exc:
        msg = str(exc)
        if f"{engine}: not available here" in msg:
            pytest.skip(f"engine {engine} is not available on this machine: {msg[-200:]}")
        named = [n.name for n in g.nodes if f"'{n.name}'" in msg]
        assert named, f"{engine} refused without naming a node: {msg}"
        return None


def _check(b: Built, plan: Any, engine: str) -> None:
    g = b.graph
    ref = run_reference(g, resolve_pack(g, b.pack).inputs)
    returned = plan.execute(b.pack)
    outs = {t.name: (b.pack[t.name] if t.name in b.pack else to_host(returned[t.name])) for t in g.outputs()}
    err, why = compare(g, outs, ref)
    ints = all(not t.dtype.is_float for t in g.outputs())
    tol = 0.0 if ints else tolerance(g)
    assert err <= tol, f"{engine}: rel err {err:.3g} > {tol:g} {why}"
    for t in g.outputs():
        got = np.asarray(outs[t.name])
        assert not np.isnan(got.astype(np.float64)).any() or np.isnan(ref[t.name]).any(), f"{engine}: NaN in {t.name}"
        if t.name not in b.pack:  # returned in its declared layout
            assert _strides_of(got) == t.stride or all(d == 1 for d in t.dim), (engine, t.name, got.strides)
    for name, (whole, before) in b.buffers.items():
        mask = _written_mask(whole, [b.pack[t.name] for t in g.outputs() if t.name in b.pack])
        assert np.array_equal(whole[~mask], before[~mask]), f"{engine}: wrote outside the output views of '{name}'"


def _written_mask(whole: np.ndarray, views: list[np.ndarray]) -> np.ndarray:
    """Which elements of ``whole`` the output views address."""
    mask = np.zeros(whole.size, bool)
    base = whole.__array_interface__["data"][0]
    for v in views:
        if not np.shares_memory(v, whole):
            continue
        idx = np.indices(v.shape).reshape(v.ndim, -1)
        offsets = (v.__array_interface__["data"][0] - base + (np.array(v.strides)[:, None] * idx).sum(0)) // whole.itemsize
        mask[offsets] = True
    return mask.reshape(whole.shape)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_parity(c: Case, engine: str, rng: Rng) -> None:
    b = c.build(rng)
    b.graph.validate()
    plan = _build(b.graph, engine)
    if plan is None:
        assert engine != "reference", "the reference engine runs every valid graph"
        return
    _check(b, plan, engine)


# ---- IREE's attention variants and the i1 data-tiling bug ----------------------------------
IREE_ATTENTION = [
    ("decomposed_causal_bool_mask_b2", lambda rng: _sdpa(rng, F32, 2, 2, causal=True, mask=DataType.BOOLEAN, sq=7, mshape=[7, 7])),
    ("decomposed_causal_bool_mask_full", lambda rng: _sdpa(rng, F16, 2, 1, causal=True, mask=DataType.BOOLEAN, sq=7, mshape=[2, 4, 7, 7])),
    ("decomposed_causal_float_mask", lambda rng: _sdpa(rng, F32, 1, 2, causal=True, mask=F32, sq=7)),
    ("decomposed_hk_ne_hv", lambda rng: _sdpa(rng, F32, 2, 1, dv=6)),
]


@pytest.mark.parametrize("name,build", IREE_ATTENTION, ids=[n for n, _ in IREE_ATTENTION])
def test_iree_decomposed_attention(name: str, build: Callable[[Rng], Built], rng: Rng) -> None:
    """IREE's decomposed attention (matmul, mask, softmax, matmul) with a boolean mask and
    batch > 1 failed to compile with data tiling on (an i1 tensor packed with an i8 pad)."""
    b = build(rng)
    b.graph.validate()
    plan = _build(b.graph, "iree", EngineConfig("iree", (("attention", "decomposed"),)))
    assert plan is not None
    _check(b, plan, "iree")


def test_iree_pinned_data_tiling_with_bool_is_refused_before_compiling(rng: Rng) -> None:
    from fusegraph.engines.iree.engine import IreeEngine
    from fusegraph.engines.iree.targets import target_for_device
    from fusegraph.runtime.handle import as_handle

    pytest.importorskip("iree.runtime", reason="the IREE runtime is not installed")
    b = _sdpa(rng, F32, 2, 2, causal=True, mask=DataType.BOOLEAN, sq=7, mshape=[7, 7])
    b.graph.validate()
    e = IreeEngine()
    with pytest.raises(UnsupportedError, match="data_tiling"):
        e.compile_entry(b.graph, target_for_device(as_handle("cpu").device), {"data_tiling": True, "attention": "decomposed"})


# ---- what stays refused ------------------------------------------------------------------------
def test_overlap_given_dense_inconsistent_is_refused(rng: Rng) -> None:
    """A tensor declared overlapping, passed as a dense array whose values disagree where
    the declared strides meet: no engine can honour both, so the pack is refused."""
    g = fg.Graph(name="overlap_bad", io_data_type=F32)
    x = g.tensor("x", [4, 6], [1, 1])
    g.exp(x).set_name("y").set_output(True)
    g.validate()
    for engine in ENGINES:
        plan = _build(g, engine)
        with pytest.raises(VariantPackError, match="'x'"):
            plan.execute({"x": _rand(rng, [4, 6], F32)})


def test_overlapping_output_strides_are_refused() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4, 6], [1, 1])  # an overlapping input: valid
    g.exp(x, name="e").set_stride([1, 1]).set_output(True)  # an overlapping output: never
    with pytest.raises(ValidationError, match="overlap"):
        g.validate()


@pytest.mark.parametrize("engine", ENGINES)
def test_output_view_sharing_an_input_is_refused(engine: str, rng: Rng) -> None:
    """Writing rotary q back over the very slice it reads (in place) is refused: engines
    read and write in any order."""
    qkv = _rand(rng, [2, 5, 48], F32)
    g = fg.Graph(name="inplace", io_data_type=F32)
    x = g.tensor("x", [2, 5, 16], _strides_of(qkv[..., :16]))
    g.neg(x, name="n").set_name("y").set_stride(_strides_of(qkv[..., :16])).set_output(True)
    g.validate()
    plan = _build(g, engine)
    with pytest.raises(VariantPackError, match="shares memory with input 'x'"):
        plan.execute({"x": qkv[..., :16], "y": qkv[..., :16]})
    # the k slice as input and the q slice as output of the same buffer: no shared memory
    plan.execute({"x": qkv[..., 16:32], "y": qkv[..., :16]})
    np.testing.assert_array_equal(qkv[..., :16], -qkv[..., 16:32])


def test_select_float_condition_is_still_refused() -> None:
    g = fg.Graph(io_data_type=F32)
    a, b, c = g.tensor("a", [2]), g.tensor("b", [2]), g.tensor("c", [2])
    g.binary_select(a, b, c, name="sel").set_output(True)
    with pytest.raises(ValidationError, match="BOOLEAN or an integer"):
        g.validate()


def test_sdpa_heads_must_divide() -> None:
    g = fg.Graph(io_data_type=F32)
    q, k, v = g.tensor("q", [1, 4, 5, 8]), g.tensor("k", [1, 2, 5, 8]), g.tensor("v", [1, 3, 5, 8])
    g.sdpa(q, k, v, name="attn").set_output(True)
    with pytest.raises(ValidationError, match=r"'v'.*must divide"):
        g.validate()


def test_int_conv_rejects_a_float_compute_type_and_wide_ints() -> None:
    g = fg.Graph(io_data_type=I8)
    x, w = g.tensor("x", [1, 4, 5, 5]), g.tensor("w", [4, 4, 3, 3])
    g.conv_fprop(x, w, padding=[0, 0], stride=[1, 1], dilation=[1, 1], compute_data_type=F32, name="c").set_output(True)
    with pytest.raises(ValidationError, match="INT32"):
        g.validate()
    g2 = fg.Graph(io_data_type=I32)
    x2, w2 = g2.tensor("x", [1, 4, 5, 5]), g2.tensor("w", [4, 4, 3, 3], data_type=I8)
    g2.conv_fprop(x2, w2, padding=[0, 0], stride=[1, 1], dilation=[1, 1], name="c").set_output(True)
    with pytest.raises(ValidationError, match="INT8 or UINT8"):
        g2.validate()


# ---- integer matmul accumulates wide ----------------------------------------------------------
@pytest.mark.parametrize("engine", ["reference", "torch", "iree"])
@pytest.mark.parametrize("io", [DataType.INT8, DataType.UINT8])
def test_int8_matmul_accumulates_in_32_bits(engine: str, io: DataType) -> None:
    """int8 x int8 summed over K=64 leaves int8's range at once: every engine that claims
    the graph accumulates in (at least) 32 bits, as cuDNN's INT32 compute does; none may
    wrap silently (found by benchmarks/bench_build_sequence.py: the torch engine computed
    in int8)."""
    g = fg.Graph("int8_mm")
    a = g.tensor("a", [4, 64], data_type=io)
    b = g.tensor("b", [64, 8], data_type=io)
    g.matmul(a, b).set_data_type(DataType.INT32).set_output(True).set_name("c")
    g.validate()
    rng = np.random.default_rng(3)
    lo, hi = (-128, 128) if io == DataType.INT8 else (0, 256)
    pack = {"a": rng.integers(lo, hi, (4, 64)).astype(io.numpy), "b": rng.integers(lo, hi, (64, 8)).astype(io.numpy)}
    want = pack["a"].astype(np.int64) @ pack["b"].astype(np.int64)
    assert np.abs(want).max() > 2**15  # would wrap in 8 or 16 bits
    try:
        got = g.execute(dict(pack), engine=engine)["c"]
    except (UnsupportedError, CompileError) as exc:  # refused by name, never wrong
        assert engine == "iree", exc
        return
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.int32))

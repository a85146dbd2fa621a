"""Layer/RMS norm backward and attention backward on the cuDNN engine (engines/cudnn/lower.py).

CPU: what the lowering refuses and why, the descriptors (dims, strides, uids) each tensor
gets, and the calls made to cuDNN's frontend, recorded by a stand-in ``cudnn`` module.
GPU (``pytest -m gpu tests/test_cudnn_backward.py`` on the GPU machine): built plans
against the float64 reference on fresh random data; attention backward is fed the output
and log-sum-exp statistics of the reference forward (``sdpa(..., generate_stats=True)``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from engine_fakes import rel_error

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.cudnn import CudnnEngine, lower, rules
from fusegraph.engines.unsupported import declared_unsupported
from fusegraph.reference.inputs import random_inputs

ENGINE = CudnnEngine()
GPU = fg.Handle("cuda:0")
TOL = {DT.FLOAT: 1e-4, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}  # norms: 1e-4 in f32 (means cancel)


def _g(name: str, dt: DT) -> fg.Graph:
    return fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)


def norm_bwd(kind: str, dt: DT = DT.HALF, xs: tuple[int, ...] = (64, 256), *, dbias: bool = True,
             stats_dt: DT = DT.FLOAT, scale: tuple[int, ...] | None = None, x_strides: list[int] | None = None) -> fg.Graph:
    g = _g(f"{kind}_bwd_{dt.value}", dt)
    dy, x = g.tensor("dy", list(xs), x_strides), g.tensor("x", list(xs), x_strides)
    s = g.tensor("scale", list(scale or (1, *xs[1:])))
    stat = [xs[0]] + [1] * (len(xs) - 1)
    if kind == "layernorm":
        outs: tuple[Any, ...] = g.layernorm_backward(
            dy, x, s, g.tensor("mean", stat, data_type=stats_dt), g.tensor("inv", stat, data_type=stats_dt), name="lnb")
    else:
        outs = g.rmsnorm_backward(dy, x, s, g.tensor("inv", stat, data_type=stats_dt), has_dbias=dbias, name="rmsb")
    for t in outs:
        if t is not None:
            t.set_output(True)
    return g


def bn_bwd(dt: DT = DT.HALF, n: int = 4, c: int = 32, hw: int = 8, layout: str = "NHWC", params: str = "vector") -> fg.Graph:
    """batchnorm_backward of an image batch; per-channel tensors [C] ("vector") or [1, C, 1, 1]."""
    g = _g(f"bn_bwd_{dt.value}_{layout}", dt)
    dims = [n, c, hw, hw]
    dy, x = g.tensor("dy", dims, fg.strides_for(dims, layout)), g.tensor("x", dims, fg.strides_for(dims, layout))
    pd = [c] if params == "vector" else [1, c, 1, 1]
    s, m, i = (g.tensor(name, pd, data_type=DT.FLOAT) for name in ("scale", "mean", "inv"))
    dx, ds, db = g.batchnorm_backward(dy, x, s, m, i, name="bnb")
    dx.set_dim(dims).set_stride(fg.strides_for(dims, layout))
    for t in (dx, ds, db):
        t.set_output(True)
    return g


def sdpa_bwd(dt: DT = DT.BFLOAT16, *, b: int = 2, hq: int = 4, hkv: int = 4, s: int = 128, d: int = 64,
             causal: bool = True, mask: bool = False, bshd: bool = False, scale: float | None = None) -> fg.Graph:
    """sdpa_backward alone: q, k, v, o, dO and the forward's statistics are graph inputs."""
    g = _g("sdpa_bwd", dt)

    def t(name: str, h: int) -> Any:
        strides = [s * h * d, d, h * d, 1] if bshd else None  # [b, s, h, d] in memory
        return g.tensor(name, [b, h, s, d], strides)

    q, k, v, o, do = t("q", hq), t("k", hkv), t("v", hkv), t("o", hq), t("do", hq)
    stats = g.tensor("stats", [b, hq, s, 1], data_type=DT.FLOAT)
    m = g.tensor("mask", [1, 1, s, s], data_type=dt) if mask else None
    for grad in g.sdpa_backward(q, k, v, o, do, stats, attn_scale=scale, causal=causal, mask=m, name="att_bwd"):
        grad.set_output(True)
    return g


def _refusal(g: fg.Graph) -> str:
    why = rules.refusal(g.validate())
    assert why is not None
    return why


# ---- CPU: refusals and descriptors ---------------------------------------------------------------
def test_declared_refusals_left() -> None:
    assert declared_unsupported("cudnn", norm_bwd("layernorm").validate()) is None
    assert declared_unsupported("cudnn", norm_bwd("rmsnorm").validate()) is None
    assert declared_unsupported("cudnn", sdpa_bwd().validate()) is None
    assert declared_unsupported("cudnn", bn_bwd().validate()) is None
    g = _g("drop", DT.HALF)
    q = g.tensor("q", [1, 2, 16, 8])
    st = g.tensor("st", [1, 2, 16, 1], data_type=DT.FLOAT)
    seed = g.tensor("seed", [1], data_type=DT.INT64)
    for t in g.sdpa_backward(q, q, q, q, q, st, dropout=(0.1, seed, g.scalar(3, DT.INT64)), name="a"):
        t.set_output(True)
    why = declared_unsupported("cudnn", g.validate())
    assert why is not None and "'seed'" in why and "Philox" in why


def test_norm_backward_refusals_say_why() -> None:
    assert "float32" in _refusal(norm_bwd("layernorm", stats_dt=DT.BFLOAT16))
    assert "is broadcast" in _refusal(norm_bwd("rmsnorm", DT.FLOAT, (2, 3, 4, 5), scale=(1, 1, 4, 5)))
    nhwc = _refusal(norm_bwd("layernorm", DT.HALF, (2, 8, 4, 4), x_strides=fg.strides_for([2, 8, 4, 4], "NHWC")))
    assert "channels-last" in nhwc or "row-major" in nhwc
    g = _g("partial", DT.HALF)
    x = g.tensor("x", [8, 32])
    dx, ds, db = g.layernorm_backward(g.tensor("dy", [8, 32]), x, g.tensor("s", [32]),
                                      g.tensor("m", [8, 1], data_type=DT.FLOAT), g.tensor("i", [8, 1], data_type=DT.FLOAT),
                                      name="lnb")
    dx.set_output(True)
    ds.set_output(True)
    db.set_output(True)
    g.relu(db)  # a virtual dbias read by another node
    why = _refusal(g)
    assert "'lnb'" in why and "alone" in why and "pointwise" in why
    g = _g("unwritten", DT.HALF)
    dx, ds, db = g.layernorm_backward(g.tensor("dy", [8, 32]), g.tensor("x", [8, 32]), g.tensor("s", [32]),
                                      g.tensor("m", [8, 1], data_type=DT.FLOAT), g.tensor("i", [8, 1], data_type=DT.FLOAT))
    dx.set_output(True)
    ds.set_output(True)
    assert "not graph outputs" in _refusal(g) and "dbias" in _refusal(g)
    # forward and backward in one graph
    g = _g("fwd_bwd", DT.FLOAT)
    x, s = g.tensor("x", [4, 6]), g.tensor("s", [6])
    y, inv = g.rmsnorm(x, s, g.scalar(1e-5), phase=fg.NormFwdPhase.TRAINING)
    assert inv is not None
    y.set_output(True)
    inv.set_output(True)
    for t in g.rmsnorm_backward(g.tensor("dy", [4, 6]), x, s, inv)[:2]:
        assert t is not None
        t.set_output(True)
    assert "alone" in _refusal(g) and "rmsnorm" in _refusal(g)


def test_sdpa_backward_refusals_say_why() -> None:
    g = _g("boolmask", DT.HALF)
    q = g.tensor("q", [1, 2, 16, 8])
    st = g.tensor("st", [1, 2, 16, 1], data_type=DT.FLOAT)
    m = g.tensor("m", [1, 1, 16, 16], data_type=DT.BOOLEAN)
    for t in g.sdpa_backward(q, q, q, q, q, st, mask=m, name="a"):
        t.set_output(True)
    assert "boolean mask" in _refusal(g)
    g = _g("halfstats", DT.HALF)
    st16 = g.tensor("st", [1, 2, 16, 1], data_type=DT.HALF)
    q = g.tensor("q", [1, 2, 16, 8])
    for t in g.sdpa_backward(q, q, q, q, q, st16, name="a"):
        t.set_output(True)
    assert "float32" in _refusal(g) and "'stats'" in _refusal(g)


def test_norm_backward_descriptors() -> None:
    b = rules.binding(norm_bwd("layernorm", DT.HALF, (8, 16), scale=(16,)).validate())
    assert b.trailing and b.rank == 4
    d = b.described
    assert d["x"].dims == (8, 16, 1, 1) and d["x"].strides == (16, 1, 1, 1)
    assert d["mean"].dims == (8, 1, 1, 1) and d["scale"].dims == (1, 16, 1, 1)
    assert d["lnb::dscale"].dims == (1, 16, 1, 1) and d["lnb::dx"].dims == (8, 16, 1, 1)
    assert set(b.uids) == {"dy", "x", "scale", "mean", "inv", "lnb::dx", "lnb::dscale", "lnb::dbias"}
    b = rules.binding(norm_bwd("rmsnorm", DT.BFLOAT16, (4, 8, 16), dbias=False).validate())
    assert b.described["x"].dims == (4, 8, 16, 1) and b.described["inv"].dims == (4, 1, 1, 1)
    assert "rmsb::dbias" not in b.uids and len(b.uids) == 6


def test_batchnorm_backward_descriptors_and_call() -> None:
    b = rules.binding(bn_bwd(layout="NHWC").validate())
    d = b.described
    assert d["x"].dims == (4, 32, 8, 8) and d["x"].strides == (2048, 1, 256, 32)
    assert d["bnb::dx"].strides == (2048, 1, 256, 32)
    assert d["scale"].dims == (1, 32, 1, 1) and d["bnb::dscale"].dims == (1, 32, 1, 1) and d["mean"].dims == (1, 32, 1, 1)
    (name, args, kw), = _lowered(bn_bwd(params="full")).calls
    assert name == "batchnorm_backward" and [a.kw["name"] for a in args] == ["dy", "x", "scale", "mean", "inv"]
    assert kw["peer_stats"] == [] and kw["compute_data_type"] == "FLOAT"
    g = _g("bn_mixed", DT.HALF)  # NHWC input, NCHW gradient: one layout per cuDNN graph
    dims = [4, 32, 8, 8]
    vec = [g.tensor(n, [32], data_type=DT.FLOAT) for n in ("s", "m", "i")]
    outs = g.batchnorm_backward(g.tensor("dy", dims, fg.strides_for(dims, "NHWC")), g.tensor("x", dims, fg.strides_for(dims, "NHWC")), *vec)
    outs[0].set_stride(fg.strides_for(dims, "NCHW"))
    for t in outs:
        t.set_output(True)
    assert "mixes" in _refusal(g)


def test_sdpa_backward_descriptors_keep_the_bshd_layout() -> None:
    b = rules.binding(sdpa_bwd(hq=8, hkv=2, s=32, d=16, bshd=True).validate())
    assert not b.trailing and b.rank == 4
    assert b.described["q"].dims == (2, 8, 32, 16) and b.described["q"].strides == (32 * 8 * 16, 16, 8 * 16, 1)
    assert b.described["k"].dims == (2, 2, 32, 16) and b.described["att_bwd::dk"].dims == (2, 2, 32, 16)
    assert b.described["stats"].dims == (2, 8, 32, 1)
    assert set(b.uids) >= {"q", "k", "v", "o", "do", "stats", "att_bwd::dq", "att_bwd::dk", "att_bwd::dv"}


# ---- CPU: the calls made to the frontend, through a stand-in module -----------------------------
class _T:
    """A stand-in cuDNN tensor: keeps what the lowering sets on it."""

    def __init__(self, **kw: Any) -> None:
        self.kw = dict(kw)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("set_"):
            def setter(value: Any) -> _T:
                self.kw[name[4:]] = value
                return self
            return setter
        raise AttributeError(name)


class _Graph:
    def __init__(self, **kw: Any) -> None:
        self.kw, self.calls = kw, []  # type: ignore[var-annotated]

    def tensor(self, **kw: Any) -> _T:
        return _T(**kw)

    def _op(self, name: str, n: int, args: tuple[Any, ...], kw: dict[str, Any]) -> list[Any]:
        self.calls.append((name, args, kw))
        outs: list[Any] = [_T(op=name, i=i) for i in range(n)]
        if name == "rmsnorm_backward" and not args[4]:
            outs[2] = None
        return outs

    def layernorm_backward(self, *a: Any, **kw: Any) -> list[Any]:
        return self._op("layernorm_backward", 3, a, kw)

    def rmsnorm_backward(self, *a: Any, **kw: Any) -> list[Any]:
        return self._op("rmsnorm_backward", 3, a, kw)

    def sdpa_backward(self, *a: Any, **kw: Any) -> list[Any]:
        return self._op("sdpa_backward", 3, a, kw)

    def batchnorm_backward(self, *a: Any, **kw: Any) -> list[Any]:
        return self._op("batchnorm_backward", 3, a, kw)

    def sdpa(self, *a: Any, **kw: Any) -> list[Any]:
        return self._op("sdpa", 2, a, kw)


def _fake_cudnn() -> Any:
    names = ("HALF", "BFLOAT16", "FLOAT", "DOUBLE", "INT64", "BOOLEAN")
    return SimpleNamespace(data_type=SimpleNamespace(**{n: n for n in names}), pygraph=_Graph)


def _lowered(g: fg.Graph) -> _Graph:
    g.validate()
    out = lower.lower(g, rules.binding(g), _fake_cudnn(), handle=None)
    assert isinstance(out, _Graph)
    return out


def test_lowering_calls_the_frontends_norm_backward() -> None:
    cg = _lowered(norm_bwd("rmsnorm", DT.BFLOAT16, (8, 64), dbias=False))
    (name, args, kw), = cg.calls
    assert name == "rmsnorm_backward" and args[4] is False and kw["compute_data_type"] == "FLOAT"
    assert [a.kw["name"] for a in args[:4]] == ["dy", "x", "scale", "inv"]
    assert args[3].kw["dim"] == [8, 1, 1, 1] and args[3].kw["data_type"] == "FLOAT" and args[1].kw["data_type"] == "BFLOAT16"
    cg = _lowered(norm_bwd("layernorm", DT.HALF, (8, 64)))
    (name, args, kw), = cg.calls
    assert name == "layernorm_backward" and [a.kw["name"] for a in args] == ["dy", "x", "scale", "mean", "inv"]


def test_lowering_calls_the_frontends_sdpa_backward() -> None:
    g = sdpa_bwd(DT.HALF, hq=8, hkv=2, s=32, d=16, causal=True, mask=True, bshd=True)
    cg = _lowered(g)
    (name, args, kw), = cg.calls
    assert name == "sdpa_backward" and [a.kw["name"] for a in args] == ["q", "k", "v", "o", "do", "stats"]
    assert kw["use_causal_mask"] is True and kw["attn_scale"] == pytest.approx(1 / math.sqrt(16))
    assert kw["bias"].kw["name"] == "mask" and args[0].kw["stride"] == [32 * 8 * 16, 16, 8 * 16, 1]
    cg = _lowered(sdpa_bwd(DT.HALF, causal=False, scale=0.3))
    kw = cg.calls[0][2]
    assert kw["use_causal_mask"] is False and kw["attn_scale"] == pytest.approx(0.3) and "bias" not in kw


def sdpa_fwd(dt: DT = DT.BFLOAT16, *, hq: int = 4, hkv: int = 4, s: int = 128, d: int = 64, causal: bool = True,
             stats_output: bool = True) -> fg.Graph:
    """The training forward: sdpa with the statistics its backward reads."""
    g = _g("sdpa_fwd_stats", dt)
    q, k, v = g.tensor("q", [2, hq, s, d]), g.tensor("k", [2, hkv, s, d]), g.tensor("v", [2, hkv, s, d])
    o, st = g.sdpa(q, k, v, causal=causal, generate_stats=True, name="att")
    o.set_output(True)
    st.set_output(stats_output)
    if not stats_output:
        g.relu(st).set_output(True)  # read, but not written out
    return g


def test_forward_statistics_for_the_backward() -> None:
    g = sdpa_fwd().validate()
    assert declared_unsupported("cudnn", g) is None and rules.refusal(g) is None
    b = rules.binding(g)
    assert b.described["att::stats"].dims == (2, 4, 128, 1) and "att::stats" in b.uids
    (name, _, kw), = _lowered(g).calls
    assert name == "sdpa" and kw["generate_stats"] is True
    (name, _, kw), = _lowered(sdpa_inference_graph()).calls
    assert name == "sdpa" and kw["generate_stats"] is False
    assert "float32 graph output" in _refusal(sdpa_fwd(stats_output=False))


def sdpa_inference_graph() -> fg.Graph:
    g = _g("sdpa_inference", DT.HALF)
    q = g.tensor("q", [1, 2, 16, 8])
    g.sdpa(q, q, q).set_output(True)
    return g


# ---- GPU ---------------------------------------------------------------------------------------
def _run(g: fg.Graph, pack: dict[str, Any], tol: float) -> None:
    g.validate()
    s = ENGINE.supports(g, GPU)
    assert s, s.reason
    plan = ENGINE.build(g, GPU)
    got = plan.execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        err = rel_error(got[t.name], ref[t.name])
        assert err <= tol, (t.name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
def test_norm_backward_against_float64(kind: str, dt: DT, rng: np.random.Generator) -> None:
    g = norm_bwd(kind, dt, (128, 1024)).validate()
    pack = random_inputs(g, rng)
    _run(g, pack, TOL[dt])


@pytest.mark.gpu
def test_rmsnorm_backward_without_dbias(rng: np.random.Generator) -> None:
    g = norm_bwd("rmsnorm", DT.BFLOAT16, (256, 512), dbias=False).validate()
    _run(g, random_inputs(g, rng), TOL[DT.BFLOAT16])


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_batchnorm_backward_against_float64(dt: DT, layout: str, rng: np.random.Generator) -> None:
    g = bn_bwd(dt, n=8, c=64, hw=14, layout=layout).validate()
    s = ENGINE.supports(g, GPU)
    if not s and layout == "NCHW" and s.reason.startswith("cuDNN:"):
        # cuDNN's own samples run batch norm channels-last; its answer for NCHW is recorded, not assumed
        pytest.skip(f"cuDNN itself refuses NCHW batchnorm backward here: {s.reason[:300]}")
    _run(g, random_inputs(g, rng), TOL[dt])


def _attention_feeds(g: fg.Graph, rng: np.random.Generator) -> dict[str, Any]:
    """q, k, v, dO random; o and the statistics from the reference forward of the same attention."""
    node = next(n for n in g.nodes if n.kind == fg.OpKind.SDPA_BACKWARD)
    a = node.attrs
    dt = node.inputs["q"].dtype
    pack = random_inputs(g, rng)
    f = fg.Graph("fwd", io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    ts = {p: f.tensor(p, list(node.inputs[p].shape)) for p in ("q", "k", "v")}
    m = f.tensor("mask", list(node.inputs["mask"].shape), data_type=dt) if "mask" in node.inputs else None
    o, st = f.sdpa(ts["q"], ts["k"], ts["v"], attn_scale=a.attn_scale, causal=a.causal, mask=m, generate_stats=True)
    o.set_output(True)
    st.set_output(True)
    if m is not None:  # a finite additive mask, as a real one would be
        pack["mask"] = (rng.standard_normal(m.shape)).astype(dt.numpy)
    fwd = f.execute({p: pack[p] for p in ("q", "k", "v", *(("mask",) if m is not None else ()))}, engine="reference")
    pack["o"] = np.ascontiguousarray(np.asarray(fwd[o.name])).astype(dt.numpy)
    pack["stats"] = np.asarray(fwd[st.name]).astype(np.float32)
    return pack


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_backward_against_float64(dt: DT, causal: bool, rng: np.random.Generator) -> None:
    g = sdpa_bwd(dt, causal=causal).validate()
    _run(g, _attention_feeds(g, rng), TOL[dt])


@pytest.mark.gpu
def test_sdpa_backward_gqa_bshd_and_mask(rng: np.random.Generator) -> None:
    g = sdpa_bwd(DT.BFLOAT16, hq=8, hkv=2, s=256, causal=True, bshd=True).validate()
    _run(g, _attention_feeds(g, rng), TOL[DT.BFLOAT16])
    g = sdpa_bwd(DT.HALF, causal=False, mask=True).validate()
    _run(g, _attention_feeds(g, rng), TOL[DT.HALF])


def test_gpu_selection_asks_cudnn_first_for_attention_backward() -> None:
    from fusegraph.select.heuristics import features, matching_rule

    f = features(sdpa_bwd(hq=64, hkv=8, s=4096, d=128, b=1).validate())
    assert f.flops == pytest.approx(2.5 * 4 * 64 * 4096 * 4096 * 128)  # 2.5x the forward's matmul work
    rule = matching_rule(f, GPU)
    assert rule is not None and rule.name == "gpu.compute" and rule.order[0][0] == "cudnn"


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16])
def test_training_forward_then_backward_on_cudnn(dt: DT, rng: np.random.Generator) -> None:
    """sdpa with statistics on cuDNN, its o and statistics fed to sdpa_backward on cuDNN:
    each against the float64 reference (the backward's on the same o and statistics)."""
    import torch

    fwd = sdpa_fwd(dt, hq=8, hkv=2, s=256).validate()
    pack = random_inputs(fwd, rng)
    _run(fwd, pack, TOL[dt])
    plan = ENGINE.build(fwd, GPU)
    dev = {k: torch.from_numpy(np.asarray(v, np.float32)).to("cuda", torch.float16 if dt == DT.HALF else torch.bfloat16)
           for k, v in pack.items()}
    got = plan.execute(dev)
    bwd = sdpa_bwd(dt, hq=8, hkv=2, s=256, causal=True).validate()
    feeds = random_inputs(bwd, rng)
    for name in ("q", "k", "v"):
        feeds[name] = np.asarray(pack[name])
    feeds["o"] = got["att::o"].float().cpu().numpy().astype(dt.numpy)
    feeds["stats"] = got["att::stats"].float().cpu().numpy()
    _run(bwd, feeds, TOL[dt])

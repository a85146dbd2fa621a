"""Attention for training: sdpa's statistics (log-sum-exp) and dropout, and sdpa_backward's
dq, dk, dv for causal, masked and grouped-query attention -- against torch.autograd of the
definition, on the float64 reference and the torch engine, on fresh random data; and the
dropout stream itself (Philox4x32-10's published known answers, the torch engine's mask bit
for bit the reference's, its drop rate, its determinism).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.reference.dropout import keep_mask, philox4x32

torch = pytest.importorskip("torch", reason="gradients are checked against torch.autograd")

F64, F32 = DataType.DOUBLE, DataType.FLOAT
TOL = {F64: 1e-10, F32: 2e-5}
ENGINES = ("reference", "torch")


def rel_err(out: Any, ref: Any) -> float:
    o, r = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != {r.shape}"
    assert np.isfinite(r).all()
    if not np.isfinite(o).all():
        return float("inf")
    return float(np.linalg.norm(o - r)) / max(float(np.linalg.norm(r)), 1e-300)


# The cases: (name, q heads, k heads, v heads, s_q, s_kv, causal, mask kind, v's head dim).
# v's head dim 8 (q's) takes the torch engine's fused CPU kernel, 6 its matmul path.
CASES = [
    ("plain", 2, 2, 2, 5, 7, False, None, 6),
    ("causal", 2, 2, 2, 6, 6, True, None, 6),
    ("causal_rect", 2, 2, 2, 4, 7, True, None, 6),
    ("bool_mask", 2, 2, 2, 5, 7, False, "bool", 6),
    ("float_mask", 2, 2, 2, 5, 7, False, "float", 6),
    ("gqa", 4, 2, 2, 5, 6, False, None, 6),
    ("gqa_hk_ne_hv_causal", 4, 2, 1, 6, 6, True, None, 6),
    ("mqa_masked", 4, 1, 1, 3, 5, False, "bool", 6),
    ("fused_plain", 2, 2, 2, 5, 7, False, None, 8),
    ("fused_causal_rect", 2, 2, 2, 4, 7, True, None, 8),
    ("fused_bool_mask_causal", 2, 2, 2, 6, 6, True, "bool", 8),
    ("fused_float_mask", 2, 2, 2, 5, 7, False, "float", 8),
    ("fused_gqa_causal", 4, 2, 1, 6, 6, True, None, 8),
]


def _inputs(rng: np.random.Generator, case: tuple[Any, ...], dt: DataType) -> dict[str, np.ndarray]:
    _, hq, hk, hv, sq, skv, _, mask, dv = case
    b, d = 2, 8
    vals = {
        "q": rng.standard_normal((b, hq, sq, d)),
        "k": rng.standard_normal((b, hk, skv, d)),
        "v": rng.standard_normal((b, hv, skv, dv)),
        "do": rng.standard_normal((b, hq, sq, dv)),
    }
    out = {k: v.astype(dt.numpy) for k, v in vals.items()}
    if mask == "bool":
        m = rng.random((b, 1, sq, skv)) < 0.7
        m[..., 0] = True  # no row fully masked
        out["mask"] = m
    elif mask == "float":
        out["mask"] = rng.uniform(-2, 1, size=(1, hq, sq, skv)).astype(dt.numpy)
    return out


def _graph(case: tuple[Any, ...], dt: DataType, vals: dict[str, np.ndarray], dropout: float = 0.0) -> tuple[fg.Graph, dict[str, fg.TensorAttr]]:
    causal = case[6]
    g = fg.Graph(io_data_type=dt)
    t = {n: g.tensor(n, a.shape, data_type=DataType.BOOLEAN if a.dtype == np.bool_ else dt) for n, a in vals.items()}
    drop = None
    if dropout:
        drop = (dropout, g.tensor("seed", [1], data_type=DataType.INT64), g.tensor("offset", [1], data_type=DataType.INT64))
    o, stats = g.sdpa(t["q"], t["k"], t["v"], 0.3, causal, t.get("mask"), generate_stats=True, dropout=drop)
    dq, dk, dv = g.sdpa_backward(t["q"], t["k"], t["v"], o, t["do"], stats, 0.3, causal, t.get("mask"), dropout=drop)
    outs = {"o": o, "stats": stats, "dq": dq, "dk": dk, "dv": dv}
    for x in outs.values():
        x.set_output(True)
    return g, outs


def _autograd(case: tuple[Any, ...], vals: dict[str, np.ndarray], keep: np.ndarray | None, p: float) -> dict[str, np.ndarray]:
    """torch.autograd of softmax(q kᵀ · 0.3 + mask) (dropped) v, k/v heads repeated to q's."""
    causal = case[6]
    q, k, v = (torch.tensor(vals[n].astype(np.float64), requires_grad=True) for n in ("q", "k", "v"))
    hq = q.shape[1]
    kr, vr = k.repeat_interleave(hq // k.shape[1], 1), v.repeat_interleave(hq // v.shape[1], 1)
    s = q @ kr.transpose(-1, -2) * 0.3
    if "mask" in vals:
        m = torch.tensor(vals["mask"] if vals["mask"].dtype == np.bool_ else vals["mask"].astype(np.float64))
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m
    if causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, skv, dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    pr = torch.softmax(s, -1)
    if keep is not None:
        pr = pr * torch.tensor(keep, dtype=torch.float64) / (1.0 - p)
    o = pr @ vr
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.tensor(vals["do"].astype(np.float64)))
    return {"o": o.detach().numpy(), "stats": lse.detach().numpy(), "dq": dq.numpy(), "dk": dk.numpy(), "dv": dv.numpy()}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_sdpa_stats_and_backward_vs_autograd(engine: str, dt: DataType, case: tuple[Any, ...], rng: np.random.Generator) -> None:
    vals = _inputs(rng, case, dt)
    g, outs = _graph(case, dt, vals)
    got = g.execute(dict(vals), engine=engine)
    want = _autograd(case, vals, None, 0.0)
    for port, t in outs.items():
        err = rel_err(got[t.name], want[port])
        assert err <= TOL[dt], f"{case[0]} {engine}: {port} rel err {err:.3g}"
    assert outs["stats"].dim == [2, case[1], case[4], 1] and outs["stats"].dtype == (F64 if dt == F64 else F32)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6], CASES[9]], ids=lambda c: c[0])
def test_sdpa_dropout_forward_and_backward_vs_autograd(
    engine: str, dt: DataType, case: tuple[Any, ...], rng: np.random.Generator
) -> None:
    p = 0.35
    vals = _inputs(rng, case, dt)
    g, outs = _graph(case, dt, vals, dropout=p)
    seed, offset = int(rng.integers(-(2**63), 2**63 - 1)), int(rng.integers(0, 2**40))
    feeds = {**vals, "seed": np.array([seed], np.int64), "offset": np.array([offset], np.int64)}
    got = g.execute(dict(feeds), engine=engine)
    keep = keep_mask((*outs["o"].shape[:3], case[5]), p, seed, offset)
    want = _autograd(case, vals, keep, p)
    for port, t in outs.items():
        err = rel_err(got[t.name], want[port])
        assert err <= TOL[dt], f"{case[0]} {engine}: {port} rel err {err:.3g}"


def test_dropout_changes_with_the_offset_and_repeats_with_the_same_pair(rng: np.random.Generator) -> None:
    case = CASES[0]
    vals = _inputs(rng, case, F64)
    g, outs = _graph(case, F64, vals, dropout=0.5)
    o = outs["o"].name

    def run(seed: int, offset: int) -> np.ndarray:
        feeds = {**vals, "seed": np.array([seed], np.int64), "offset": np.array([offset], np.int64)}
        return np.asarray(g.execute(dict(feeds), engine="torch")[o])

    a, b, c = run(7, 100), run(7, 100), run(7, 101)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    assert not np.allclose(a, run(8, 100))


# ---- the stream ------------------------------------------------------------------------------------
def test_philox_known_answers() -> None:
    """Philox4x32-10's known-answer vectors (Random123's kat_vectors)."""
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in kat:
        got = philox4x32(tuple(np.array([c], np.uint64) for c in counter), key)
        assert tuple(int(w[0]) for w in got) == want


def test_torch_mask_is_the_reference_mask_bit_for_bit(rng: np.random.Generator) -> None:
    from fusegraph.engines.torch.lower_dropout import keep_mask as torch_keep_mask

    for seed, offset, shape, p in [
        (0, 0, (1, 1, 3, 5), 0.5),
        (-1, 2**63 - 1, (2, 3, 7, 9), 0.1),
        (int(rng.integers(-(2**63), 2**63 - 1)), int(rng.integers(0, 2**62)), (2, 2, 33, 17), 0.9),
        (123456789, 2**32 + 5, (1, 4, 16, 16), 1e-9),
    ]:
        ref = keep_mask(shape, p, seed, offset)
        got = torch_keep_mask(shape, p, torch.tensor([seed], dtype=torch.int64), torch.tensor([offset], dtype=torch.int64))
        assert np.array_equal(got.numpy(), ref), (seed, offset, shape, p)


def test_drop_rate_is_the_probability(rng: np.random.Generator) -> None:
    n = 1 << 18
    for p in (0.1, 0.5, 0.8):
        keep = keep_mask((1, 1, 512, n // 512), p, int(rng.integers(0, 2**62)), int(rng.integers(0, 2**40)))
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs((1.0 - keep.mean()) - p) < 6 * sigma, (p, keep.mean())
    assert keep_mask((1, 1, 4, 4), 0.0, 1, 2).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("dt", "tol"), [(F32, 1e-4), (DataType.BFLOAT16, 3e-2)], ids=("f32", "bf16"))
@pytest.mark.parametrize("dropout", (0.0, 0.2), ids=("no_dropout", "dropout"))
def test_sdpa_backward_on_cuda_matches_the_reference(
    dt: DataType, tol: float, dropout: float, rng: np.random.Generator
) -> None:
    """The torch lowerings on the GPU: the same mask and gradients as the float64 reference."""
    case = CASES[6]
    vals = _inputs(rng, case, dt)
    g, outs = _graph(case, dt, vals, dropout=dropout)
    feeds = {**vals, **({"seed": np.array([-5], np.int64), "offset": np.array([2**33], np.int64)} if dropout else {})}
    ref = g.execute(dict(feeds), engine="reference")
    got = g.execute(dict(feeds), engine="torch", handle=fg.Handle("cuda:0"))
    for port, t in outs.items():
        err = rel_err(np.asarray(got[t.name], dtype=np.float64), np.asarray(ref[t.name], dtype=np.float64))
        assert err <= tol, f"cuda {port} rel err {err:.3g}"

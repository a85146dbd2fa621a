"""The pooling_backward op (cuDNN's resample backward): the builder, shape inference and its
typed errors, JSON, the float64 reference against PyTorch's autograd (an independent
implementation) on fresh random data -- ties in max windows, include- and exclude-pad
averages, asymmetric padding, 1-3 spatial axes --, the torch engine against the reference,
and the engines that do not run it refusing with their reasons."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph import PoolingMode as PM
from fusegraph.errors import ValidationError
from fusegraph.graph.ops import OpKind, PoolingAttrs
from fusegraph.reference.inputs import random_inputs

CPU = fg.Handle("cpu")
TOL = {DT.FLOAT: 1e-5, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2, DT.DOUBLE: 1e-12}

# (x dims, window, stride, pre padding, post padding)
Case = tuple[list[int], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
CASES: list[Case] = [
    ([2, 3, 9, 10], (3, 3), (2, 2), (1, 1), (1, 1)),  # ResNet's stem max pool (torch's own padding)
    ([2, 3, 8, 8], (2, 2), (2, 2), (0, 0), (0, 0)),  # AvgPool2d(2)
    ([2, 3, 7, 8], (2, 3), (1, 2), (0, 1), (1, 2)),  # asymmetric: padded explicitly
    ([2, 3, 7, 7], (3, 3), (2, 2), (1, 1), (2, 2)),  # ceil_mode-like extra window
    ([2, 4, 11], (3,), (2,), (1,), (2,)),  # one spatial axis
    ([1, 2, 5, 6, 7], (2, 3, 2), (2, 1, 2), (1, 0, 1), (0, 2, 1)),  # three
]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    assert not np.isnan(g).any() and not np.isnan(w).any(), "NaN never passes"
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def _pooled(x: list[int], w: tuple[int, ...], s: tuple[int, ...], pre: tuple[int, ...], post: tuple[int, ...]) -> list[int]:
    return [*x[:2], *((n + a + b - k) // t + 1 for n, k, t, a, b in zip(x[2:], w, s, pre, post, strict=True))]


def _graph(mode: PM, case: Case, dt: DT = DT.DOUBLE, x_stride: list[int] | None = None) -> fg.Graph:
    xd, w, s, pre, post = case
    g = fg.Graph("pool_bwd")
    dy = g.tensor("dy", _pooled(xd, w, s, pre, post), data_type=dt)
    x = g.tensor("x", xd, x_stride, data_type=dt)
    g.pooling_backward(dy, x, mode, w, s, pre_padding=pre, post_padding=post).set_output(True)
    return g.validate()


def _ties(rng: np.random.Generator, shape: list[int]) -> np.ndarray:
    """Small integers: most max windows hold their maximum more than once."""
    return rng.integers(-2, 3, shape).astype(np.float64)


# ---- graph API -----------------------------------------------------------------------------------
def test_dx_has_the_dims_of_x_and_the_type_of_dy() -> None:
    g = fg.Graph("g")
    dy = g.tensor("dy", [2, 3, 5, 5], data_type=DT.HALF)
    x = g.tensor("x", [2, 3, 9, 10], data_type=DT.FLOAT)
    dx = g.pooling_backward(dy, x, PM.MAX, (3, 3), (2, 2), (1, 1))
    dx.set_output(True)
    g.validate()
    assert list(dx.dim) == [2, 3, 9, 10] and dx.data_type == DT.HALF
    attrs = g.nodes[0].attrs
    assert g.nodes[0].kind == OpKind.POOLING_BACKWARD and isinstance(attrs, PoolingAttrs) and attrs.pre_padding == (1, 1)


def test_dx_is_laid_out_as_x() -> None:
    g = fg.Graph("g")
    dy = g.tensor("dy", [2, 3, 4, 4], data_type=DT.FLOAT)
    x = g.tensor("x", [2, 3, 8, 8], [192, 1, 24, 3], data_type=DT.FLOAT)  # channels-last
    dx = g.pooling_backward(dy, x, PM.AVG_INCLUDE_PAD, (2, 2))
    dx.set_output(True)
    g.validate()
    assert list(dx.stride) == [192, 1, 24, 3]


@pytest.mark.parametrize(("dy", "match"), [
    ([2, 3, 4, 5], r"dy dims \[2, 3, 4, 5\] must be the pooling output dims \[2, 3, 5, 5\] of x 'x'"),
    ([2, 4, 5, 5], "must be the pooling output dims"),
    ([2, 3, 20], "must be the pooling output dims"),
])
def test_dy_of_the_wrong_dims_is_a_validation_error_naming_it(dy: list[int], match: str) -> None:
    g = fg.Graph("g")
    out = g.pooling_backward(g.tensor("dy", dy, data_type=DT.FLOAT), g.tensor("x", [2, 3, 9, 10], data_type=DT.FLOAT),
                             PM.MAX, (3, 3), (2, 2), (1, 1), name="pb")
    out.set_output(True)
    with pytest.raises(ValidationError, match=match) as e:
        g.validate()
    assert e.value.node == "pb" and e.value.tensor == "dy"


def test_bad_attributes_and_types_are_validation_errors() -> None:
    def build(dy_dt: DT = DT.FLOAT, **kw: Any) -> fg.Graph:
        g = fg.Graph("g")
        args: dict[str, Any] = {"window": (2, 2), "stride": (2, 2), "padding": (0, 0), **kw}
        g.pooling_backward(g.tensor("dy", [1, 2, 3, 3], data_type=dy_dt), g.tensor("x", [1, 2, 6, 6], data_type=DT.FLOAT),
                           PM.MAX, name="pb", **args).set_output(True)
        return g

    with pytest.raises(ValidationError, match="dy must be floating-point, got INT32"):
        build(DT.INT32).validate()
    with pytest.raises(ValidationError, match="window has 3 entries, expected 2"):
        build(window=(2, 2, 2)).validate()
    with pytest.raises(ValidationError, match=r"padding on axis 0 must be in \[0, window\)"):
        build(padding=(2, 0)).validate()
    with pytest.raises(ValidationError, match="pooling needs rank 3-5"):
        g = fg.Graph("g")
        g.pooling_backward(g.tensor("dy", [4, 3], data_type=DT.FLOAT), g.tensor("x", [8, 6], data_type=DT.FLOAT),
                           PM.MAX, (2,)).set_output(True)
        g.validate()


def test_json_round_trip_keeps_the_attributes() -> None:
    g = fg.Graph("g")
    for i, mode in enumerate(PM):
        dy = g.tensor(f"dy{i}", [2, 3, 7, 5], data_type=DT.FLOAT)
        g.pooling_backward(dy, g.tensor(f"x{i}", [2, 3, 7, 8], data_type=DT.FLOAT), mode, (2, 3), (1, 2),
                           pre_padding=(0, 1), post_padding=(1, 2)).set_output(True)
    g.validate()
    back = fg.Graph.from_json(g.to_json()).validate()
    assert [(n.kind, n.attrs) for n in back.nodes] == [(n.kind, n.attrs) for n in g.nodes]
    assert back.key() == g.key()


def test_regions_take_pooling_backward_as_an_anchor() -> None:
    from fusegraph.regions import split

    g = fg.Graph("r", io_data_type=DT.FLOAT)
    dx = g.pooling_backward(g.tensor("dy", [2, 3, 4, 4]), g.tensor("x", [2, 3, 8, 8]), PM.MAX, (2, 2))
    y = g.add(dx, g.tensor("r", [2, 3, 8, 8]))
    y.set_output(True)
    s = split(g.validate())
    assert [r.pattern for r in s.regions] == ["pooling.backward", "triton.pointwise"] and not s.rejected


# ---- the reference against PyTorch's autograd ----------------------------------------------------
torch = pytest.importorskip("torch", reason="the reference is checked against PyTorch's autograd")
F = torch.nn.functional


def _autograd(mode: PM, case: Case, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """PyTorch's own gradient: its pooling with its own padding where that is symmetric,
    else on an explicitly padded x (max: -inf; exclude-pad: divided by the real count)."""
    _, w, s, pre, post = case
    xt = torch.from_numpy(x).requires_grad_(True)
    nsp = xt.dim() - 2
    pads = [p for a, b in zip(reversed(pre), reversed(post), strict=True) for p in (a, b)]
    maxp, avgp = getattr(F, f"max_pool{nsp}d"), getattr(F, f"avg_pool{nsp}d")
    if pre == post:
        if mode == PM.MAX:
            y = maxp(xt, w, s, padding=pre)
        else:
            y = avgp(xt, w, s, padding=pre, count_include_pad=mode == PM.AVG_INCLUDE_PAD)
    elif mode == PM.MAX:
        y = maxp(F.pad(xt, pads, value=-math.inf), w, s)
    elif mode == PM.AVG_INCLUDE_PAD:
        y = avgp(F.pad(xt, pads), w, s)
    else:
        y = avgp(F.pad(xt, pads), w, s) / avgp(F.pad(torch.ones_like(xt), pads), w, s)
    y.backward(torch.from_numpy(dy))
    assert xt.grad is not None
    return xt.grad.numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", list(PM))
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-w{c[1]}-s{c[2]}-p{c[3]}{c[4]}" for c in CASES])
def test_reference_against_torch_autograd(mode: PM, case: Case, rng: np.random.Generator) -> None:
    g = _graph(mode, case)
    x = _ties(rng, case[0]) if mode == PM.MAX else rng.standard_normal(case[0])
    dy = rng.standard_normal(g.inputs()[0].dim)
    got = g.execute({"dy": dy, "x": x}, engine="reference")[g.outputs()[0].name]
    assert _rel(got, _autograd(mode, case, x, dy)) <= 1e-12


def test_reference_max_ties_go_to_the_first_maximum() -> None:
    """A window whose maximum appears twice: the whole gradient goes to the first one in
    row-major window order (PyTorch's strict ``>``), none to the other."""
    x = np.array([[[[1.0, 5.0], [5.0, 2.0]]]])
    g = _graph(PM.MAX, ([1, 1, 2, 2], (2, 2), (2, 2), (0, 0), (0, 0)))
    got = g.execute({"dy": np.array([[[[3.0]]]]), "x": x}, engine="reference")[g.outputs()[0].name]
    assert got.tolist() == [[[[0.0, 3.0], [0.0, 0.0]]]]
    assert np.array_equal(got, _autograd(PM.MAX, ([1, 1, 2, 2], (2, 2), (2, 2), (0, 0), (0, 0)), x, np.array([[[[3.0]]]])))


# ---- the torch engine against the reference -------------------------------------------------------
from fusegraph.engines import torch as torch_engine  # noqa: E402

ENGINE = torch_engine.TorchEngine()


def _check_engine(g: fg.Graph, pack: dict[str, np.ndarray], tol: float, handle: fg.Handle = CPU,
                  engine: Any = ENGINE) -> None:
    if engine is not None:
        assert engine.supports(g, handle), engine.supports(g, handle).reason
        got = engine.build(g, handle).execute(pack)
    else:
        got = g.build(handle).execute(pack)  # selection's choice
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        assert got[t.name].shape == ref[t.name].shape
        assert _rel(got[t.name], ref[t.name]) <= tol, t.name


@pytest.mark.parametrize("mode", list(PM))
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-w{c[1]}-s{c[2]}-p{c[3]}{c[4]}" for c in CASES])
def test_torch_engine_float32(mode: PM, case: Case, rng: np.random.Generator) -> None:
    g = _graph(mode, case, DT.FLOAT)
    x = _ties(rng, case[0]) if mode == PM.MAX else rng.standard_normal(case[0])
    pack = {"dy": rng.standard_normal(g.inputs()[0].dim).astype(np.float32), "x": x.astype(np.float32)}
    _check_engine(g, pack, TOL[DT.FLOAT])


@pytest.mark.parametrize("dt", [DT.HALF, DT.BFLOAT16, DT.DOUBLE])
@pytest.mark.parametrize("mode", list(PM))
def test_torch_engine_other_types(mode: PM, dt: DT, rng: np.random.Generator) -> None:
    g = _graph(mode, CASES[2], dt)
    pack = random_inputs(g, rng)
    _check_engine(g, pack, TOL[dt])


def test_torch_engine_channels_last_x(rng: np.random.Generator) -> None:
    case = CASES[0]
    _, c, h, w = case[0]
    g = _graph(PM.MAX, case, DT.FLOAT, [h * w * c, 1, w * c, c])
    pack = random_inputs(g, rng)
    _check_engine(g, pack, TOL[DT.FLOAT])


def test_torch_engine_compiled_by_inductor(rng: np.random.Generator) -> None:
    """The plan compiled whole (the ``compile`` knob): every mode on explicitly padded
    input, one graph, one compile."""
    from fusegraph.engines.base import EngineConfig

    xd, w, s, pre, post = CASES[2]
    g = fg.Graph("compiled")
    x = g.tensor("x", xd, data_type=DT.FLOAT)
    for i, mode in enumerate(PM):
        dy = g.tensor(f"dy{i}", _pooled(xd, w, s, pre, post), data_type=DT.FLOAT)
        g.pooling_backward(dy, x, mode, w, s, pre_padding=pre, post_padding=post).set_output(True)
    g.validate()
    pack = random_inputs(g, rng)
    pack["x"] = _ties(rng, xd).astype(np.float32)
    got = ENGINE.build(g, CPU, EngineConfig("torch", (("compile", True),))).execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        assert _rel(got[t.name], ref[t.name]) <= TOL[DT.FLOAT], t.name


def test_selection_on_the_cpu_runs_it(rng: np.random.Generator) -> None:
    """No engine named: the engines that cannot run it are passed over with their reasons."""
    g = _graph(PM.AVG_EXCLUDE_PAD, CASES[2], DT.FLOAT)
    _check_engine(g, random_inputs(g, rng), TOL[DT.FLOAT], engine=None)


# ---- engines that do not run it ------------------------------------------------------------------
def test_other_engines_refuse_it_with_a_reason() -> None:
    from fusegraph.engines.cudnn import rules as cudnn_rules
    from fusegraph.engines.iree.emit import unsupported_reason
    from fusegraph.engines.triton.rows import Refusal, analyze
    from fusegraph.engines.unsupported import declared_unsupported

    g = _graph(PM.MAX, CASES[0], DT.FLOAT)
    assert "no resample backward node" in (cudnn_rules.refusal(g) or "")
    assert "no lowering for pooling_backward" in (unsupported_reason(g) or "")
    sm = fg.Graph.from_json(g.to_json())
    out = sm.outputs()[0]
    out.set_output(False)
    sm.softmax(out).set_output(True)
    with pytest.raises(Refusal, match="row kernel takes pointwise ops"):
        analyze(sm.validate())
    for engine in ("iree", "cudnn", "triton"):
        why = declared_unsupported(engine, g)
        assert why is not None and "(pooling_backward)" in why, engine
    assert declared_unsupported("torch", g) is None and declared_unsupported("reference", g) is None


# ---- CUDA (the GPU machine) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
@pytest.mark.parametrize("mode", list(PM))
def test_on_cuda_by_selection(mode: PM, dt: DT, rng: np.random.Generator) -> None:
    """On a CUDA handle selection picks the torch engine (cudnn, triton and IREE refuse it);
    ResNet-50's stem shape and an asymmetric one, against the reference."""
    gpu = fg.Handle("cuda:0")
    for case in (([8, 64, 112, 112], (3, 3), (2, 2), (1, 1), (1, 1)), CASES[2]):
        g = _graph(mode, case, dt)
        pack = random_inputs(g, rng)
        if mode == PM.MAX:
            pack["x"] = _ties(rng, case[0]).astype(dt.numpy)
        _check_engine(g, pack, TOL[dt], gpu, engine=None)

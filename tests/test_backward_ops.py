"""The backward (training) ops -- norm backward, activation backward, bias gradients and the
training forward's saved statistics -- against torch.autograd of each forward's definition,
on the float64 reference and on the torch engine (CPU here; the same lowerings run on CUDA,
see test_backward_ops_gpu below), on fresh random data.

Tolerances (relative Frobenius error): float64 1e-10 (both engines), float32 1e-4 for the
norms (their means and variances cancel) and 1e-5 for the elementwise modes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.dtypes import DataType

torch = pytest.importorskip("torch", reason="gradients are checked against torch.autograd")

F64, F32 = DataType.DOUBLE, DataType.FLOAT
NORM_TOL = {F64: 1e-10, F32: 1e-4}
PW_TOL = {F64: 1e-10, F32: 1e-5}
ENGINES = ("reference", "torch")


def rel_err(out: Any, ref: Any) -> float:
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != {r.shape}"
    assert np.isfinite(r).all(), "the autograd result itself is not finite"
    if not np.isfinite(o).all():
        return float("inf")  # NaN never passes
    return float(np.linalg.norm(o - r)) / max(float(np.linalg.norm(r)), 1e-300)


def check(got: dict[str, Any], want: dict[str, Any], tol: float, what: str) -> None:
    for name, ref in want.items():
        err = rel_err(got[name], ref)
        assert err <= tol, f"{what}: {name} rel err {err:.3g} > {tol:g}"


def autograd(
    fn: Callable[..., Any], inputs: Sequence[np.ndarray], grad: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray]]:
    """fn's value and the gradients of <fn(inputs), grad> w.r.t. each input, in float64."""
    ts = [torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True) for a in inputs]
    y = fn(*ts)
    gs = torch.autograd.grad(y, ts, torch.tensor(np.asarray(grad, dtype=np.float64)), allow_unused=True)
    return y.detach().numpy(), [np.zeros(a.shape) if g is None else g.numpy() for a, g in zip(inputs, gs, strict=True)]


def execute(g: fg.Graph, feeds: dict[str, np.ndarray], engine: str) -> dict[str, np.ndarray]:
    res = g.execute(dict(feeds), engine=engine)
    return {k: np.asarray(v) for k, v in res.items()}


def randn(rng: np.random.Generator, shape: Sequence[int], dt: DataType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(tuple(shape)) * scale).astype(dt.numpy)


# ---- layer norm ------------------------------------------------------------------------------
def _layernorm_def(eps: float) -> Callable[..., Any]:
    def fn(x: Any, s: Any, b: Any) -> Any:
        axes = tuple(range(1, x.dim()))
        mean = x.mean(dim=axes, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * s + b

    return fn


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize(("xs", "ps"), [((4, 3, 5), (1, 3, 5)), ((6, 16), (16,)), ((2, 3, 4, 5), (1, 1, 4, 5))])
def test_layernorm_backward_vs_autograd(
    engine: str, dt: DataType, xs: tuple[int, ...], ps: tuple[int, ...], rng: np.random.Generator
) -> None:
    eps = 1e-5
    x, s, b, dy = randn(rng, xs, dt, 2.0), randn(rng, ps, dt), randn(rng, ps, dt), randn(rng, xs, dt)
    x = x + rng.uniform(-3, 3, size=(xs[0],) + (1,) * (len(xs) - 1)).astype(dt.numpy)  # rows off centre
    g = fg.Graph(io_data_type=dt)
    xt, st, bt, dyt = (g.tensor(n, a.shape) for n, a in (("x", x), ("s", s), ("b", b), ("dy", dy)))
    y, mean, inv = g.layernorm(xt, st, bt, eps, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    dx, ds, db = g.layernorm_backward(dyt, xt, st, mean, inv)
    for t in (y, dx, ds, db, mean, inv):
        t.set_output(True)
    got = execute(g, {"x": x, "s": s, "b": b, "dy": dy}, engine)
    want_y, (gx, gs, gb) = autograd(_layernorm_def(eps), [x, s, b], dy)
    check(got, {y.name: want_y, dx.name: gx, ds.name: gs, db.name: gb}, NORM_TOL[dt], f"layernorm {engine}")
    assert ds.dim == list(ps) and db.dim == list(ps) and dx.dim == list(xs)


# ---- RMS norm --------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize("has_bias", (False, True), ids=("no_bias", "bias"))
def test_rmsnorm_backward_vs_autograd(engine: str, dt: DataType, has_bias: bool, rng: np.random.Generator) -> None:
    eps = 1e-6
    xs, ps = (5, 4, 8), (1, 4, 8)
    x, s, b, dy = randn(rng, xs, dt, 1.5), randn(rng, ps, dt), randn(rng, ps, dt), randn(rng, xs, dt)
    g = fg.Graph(io_data_type=dt)
    xt, st, bt, dyt = (g.tensor(n, a.shape) for n, a in (("x", x), ("s", s), ("b", b), ("dy", dy)))
    y, inv = g.rmsnorm(xt, st, eps, phase=fg.NormFwdPhase.TRAINING, bias=bt if has_bias else None)
    assert inv is not None
    dx, ds, db = g.rmsnorm_backward(dyt, xt, st, inv, has_dbias=has_bias)
    assert (db is not None) == has_bias
    for t in (y, dx, ds, *((db,) if db is not None else ())):
        t.set_output(True)

    def fn(x: Any, s: Any, b: Any) -> Any:
        r = torch.rsqrt((x * x).mean(dim=(1, 2), keepdim=True) + eps)
        return x * r * s + (b if has_bias else 0.0)

    feeds = {"x": x, "s": s, "dy": dy, **({"b": b} if has_bias else {})}
    got = execute(g, feeds, engine)
    want_y, (gx, gs, gb) = autograd(fn, [x, s, b], dy)
    want = {y.name: want_y, dx.name: gx, ds.name: gs}
    if db is not None:
        want[db.name] = gb
    check(got, want, NORM_TOL[dt], f"rmsnorm {engine}")


# ---- batch norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize(("xs", "ps"), [((4, 3, 5, 2), (3,)), ((8, 6), (1, 6)), ((2, 4, 3, 2, 2), (1, 4, 1, 1, 1))])
def test_batchnorm_backward_and_running_stats_vs_autograd(
    engine: str, dt: DataType, xs: tuple[int, ...], ps: tuple[int, ...], rng: np.random.Generator
) -> None:
    eps, momentum = 1e-5, 0.25
    c = xs[1]
    x, s, b, dy = randn(rng, xs, dt, 2.0), randn(rng, ps, dt), randn(rng, ps, dt), randn(rng, xs, dt)
    rm, rv = randn(rng, (c,), dt), rng.uniform(0.5, 2.0, size=(c,)).astype(dt.numpy)
    g = fg.Graph(io_data_type=dt)
    xt, st, bt, dyt, rmt, rvt = (
        g.tensor(n, a.shape) for n, a in (("x", x), ("s", s), ("b", b), ("dy", dy), ("rm", rm), ("rv", rv))
    )
    y, mean, inv, nrm, nrv = g.batchnorm(
        xt, st, bt, eps, in_running_mean=rmt, in_running_var=rvt, momentum=momentum
    )
    dx, ds, db = g.batchnorm_backward(dyt, xt, st, mean, inv)
    for t in (y, dx, ds, db, nrm, nrv):
        t.set_output(True)
    got = execute(g, {"x": x, "s": s, "b": b, "dy": dy, "rm": rm, "rv": rv}, engine)

    run_mean = torch.tensor(rm.astype(np.float64))
    run_var = torch.tensor(rv.astype(np.float64))

    def fn(x: Any, s: Any, b: Any) -> Any:
        return torch.nn.functional.batch_norm(
            x, run_mean, run_var, s.reshape(-1), b.reshape(-1), True, momentum, eps
        )

    want_y, (gx, gs, gb) = autograd(fn, [x, s, b], dy)  # also updates run_mean, run_var in place
    want = {
        y.name: want_y, dx.name: gx, ds.name: gs, db.name: gb,
        nrm.name: run_mean.numpy(), nrv.name: run_var.numpy(),
    }
    check(got, want, NORM_TOL[dt], f"batchnorm {engine}")


# ---- activation backward and the bias gradient ---------------------------------------------------
PW_BWD: dict[str, tuple[Callable[..., Any], dict[str, float], Callable[..., Any]]] = {
    "elu": (lambda g, dy, x: g.elu_backward(dy, x, alpha=0.7), {}, lambda x: torch.nn.functional.elu(x, 0.7)),
    "gelu_tanh": (
        lambda g, dy, x: g.gelu_approx_tanh_backward(dy, x), {},
        lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    ),
    "softplus": (
        lambda g, dy, x: g.softplus_backward(dy, x, beta=2.0), {},
        lambda x: torch.nn.functional.softplus(x, beta=2.0, threshold=1e30),
    ),
    "swish": (lambda g, dy, x: g.swish_backward(dy, x, beta=1.5), {}, lambda x: x * torch.sigmoid(1.5 * x)),
    "swish_beta1": (lambda g, dy, x: g.swish_backward(dy, x), {}, torch.nn.functional.silu),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", (F64, F32), ids=lambda d: d.name)
@pytest.mark.parametrize("mode", list(PW_BWD))
def test_activation_backward_modes_vs_autograd(engine: str, dt: DataType, mode: str, rng: np.random.Generator) -> None:
    build, _, fwd = PW_BWD[mode]
    x = rng.uniform(-4, 4, size=(3, 4, 5)).astype(dt.numpy)
    dy = randn(rng, (3, 4, 5), dt)
    g = fg.Graph(io_data_type=dt)
    dyt, xt = g.tensor("dy", dy.shape), g.tensor("x", x.shape)
    dx = build(g, dyt, xt).set_output(True)
    got = execute(g, {"dy": dy, "x": x}, engine)
    _, (gx,) = autograd(fwd, [x], dy)
    check(got, {dx.name: gx}, PW_TOL[dt], f"{mode} backward {engine}")


@pytest.mark.parametrize("engine", ENGINES)
def test_bias_gradient_of_a_bias_relu_epilogue_is_a_sum_of_dy(engine: str, rng: np.random.Generator) -> None:
    """The backward of y = relu(z + bias) (a fused epilogue): dz = relu_backward(dy, z + bias)
    and dbias = the sum of dz over batch and spatial axes -- graph ops that already exist."""
    z, bias, dy = randn(rng, (4, 6, 5, 3), F64), randn(rng, (1, 6, 1, 1), F64), randn(rng, (4, 6, 5, 3), F64)
    g = fg.Graph(io_data_type=F64)
    zt, bt, dyt = g.tensor("z", z.shape), g.tensor("bias", bias.shape), g.tensor("dy", dy.shape)
    pre = g.add(zt, bt)
    dz = g.relu_backward(dyt, pre).set_output(True)
    dbias = g.reduction(dz, fg.ReductionMode.SUM, axes=[0, 2, 3]).set_output(True)
    got = execute(g, {"z": z, "bias": bias, "dy": dy}, engine)
    _, (gz, gb) = autograd(lambda z, b: torch.relu(z + b), [z, bias], dy)
    check(got, {dz.name: gz, dbias.name: gb}, 1e-12, f"bias gradient {engine}")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", (F32, DataType.BFLOAT16), ids=lambda d: d.name)
def test_norm_backward_on_cuda_matches_the_reference(dt: DataType, rng: np.random.Generator) -> None:
    """The torch lowerings on the GPU (f32; bf16 operands computed in f32) against the reference."""
    xs = (64, 256)
    x = rng.standard_normal(xs).astype(dt.numpy)
    s, b, dy = (rng.standard_normal(sh).astype(dt.numpy) for sh in ((256,), (256,), xs))
    g = fg.Graph(io_data_type=dt, compute_data_type=F32)
    xt, st, bt, dyt = (g.tensor(n, a.shape) for n, a in (("x", x), ("s", s), ("b", b), ("dy", dy)))
    _, mean, inv = g.layernorm(xt, st, bt, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    _, inv_rms = g.rmsnorm(xt, st, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None and inv_rms is not None
    outs = [*g.layernorm_backward(dyt, xt, st, mean, inv), *g.rmsnorm_backward(dyt, xt, st, inv_rms)[:2]]
    for t in outs:
        t.set_output(True)
    feeds = {"x": x, "s": s, "b": b, "dy": dy}
    ref = g.execute(dict(feeds), engine="reference")
    got = g.execute(dict(feeds), engine="torch", handle=fg.Handle("cuda:0"))
    tol = 1e-4 if dt == F32 else 2e-2
    for t in outs:
        err = rel_err(np.asarray(got[t.name]), ref[t.name])
        assert err <= tol, f"cuda {t.name} rel err {err:.3g}"

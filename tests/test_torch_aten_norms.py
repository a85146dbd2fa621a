"""The ATen converters of fusegraph/torch/aten_norms.py -- batch norm (training with running
statistics, eval, backward), RMSNorm (PyTorch's fused op and its backward, and the pattern
PyTorch decomposes it into on the CPU), max pooling and concatenation -- each traced from the
ATen op itself, converted, run on the float64 reference engine and the torch engine, and
compared with the ATen op on fresh random data (relative Frobenius error: float64 1e-10,
float32 1e-4 for the norms, 1e-5 for pooling and concatenation). Then end to end: a conv net
with BatchNorm2d + MaxPool2d and an RMSNorm block, one training step under
``torch.compile(backend="fusegraph")`` against eager, and the report shows the nodes claimed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the ATen converters need torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from fusegraph.graph.ops import OpKind  # noqa: E402
from fusegraph.torch import aten as conv_aten  # noqa: E402
from fusegraph.torch.compile_backend import fusegraph_backend  # noqa: E402
from fusegraph.torch.explainer import explain  # noqa: E402
from fusegraph.torch.runtime import RUNNERS  # noqa: E402

a = torch.ops.aten
NORM_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
EXACT_TOL = {torch.float64: 1e-12, torch.float32: 1e-6}  # pooling, concatenation: no arithmetic
DTYPES = (torch.float64, torch.float32)
ENGINES = ("reference", "torch")


def _rel(got: Any, want: Any) -> float:
    g, w = np.asarray(got, dtype=np.float64), want.detach().double().numpy()
    assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
    if not np.isfinite(g).all():
        return float("inf")  # NaN never passes
    return float(np.linalg.norm(g - w)) / max(float(np.linalg.norm(w)), 1e-300)


def _outputs(gm: Any) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0]
    return list(res) if isinstance(res, tuple | list) else [res]


def _key(n: Any) -> conv_aten.Key:
    if n.op == "call_function" and n.target.__name__ == "getitem":  # type: ignore[union-attr]
        return (n.args[0].name, int(n.args[1]))  # type: ignore[union-attr, arg-type]
    return (n.name, None)


def converted(fn: Callable[..., Any], inputs: Sequence[Any], whole: bool = False,
              ) -> tuple[Any, conv_aten.Converted]:
    """``fn`` traced (functionalized, as AOTAutograd hands it over) and converted; ``whole``:
    its ATen calls recorded as they are (the fused RMSNorm, which tracing would decompose
    outside autograd), their values propagated on fake tensors."""
    if whole:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        gm = torch.fx.symbolic_trace(fn)
        mode = FakeTensorMode()
        FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(x) for x in inputs])
    else:
        gm = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(*inputs)
    return gm, conv_aten.convert(gm.graph)


def check(fn: Callable[..., Any], inputs: Sequence[Any], op: Any, tol: dict[Any, float],
          compare: Sequence[int] | None = None, whole: bool = False,
          want: Callable[..., Any] | None = None) -> conv_aten.Converted:
    """Traces ``fn``, asserts its ``op`` node converted, runs the graph on each engine and
    compares the results ``compare`` (all by default) with ``fn`` (or ``want``) run by PyTorch."""
    gm, conv = converted(fn, inputs, whole)
    nodes = [n for n in gm.graph.nodes if n.target is op]
    assert nodes and all(n.name in conv.converted for n in nodes), conv.refused
    placeholders = {n.name: x for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs,
                                              strict=True)}
    feeds = {t: placeholders[k[0]].detach().numpy() for t, k in conv.inputs.items()}
    ref = (want or fn)(*inputs)
    refs = list(ref) if isinstance(ref, tuple | list) else [ref]
    outs = _outputs(gm)
    for i in compare if compare is not None else range(len(outs)):
        conv.graph.tensor_by_name(conv.values[_key(outs[i])]).set_output(True)
    graph = conv.graph.validate()
    dtype = inputs[0].dtype
    for engine in ENGINES:
        got = graph.execute(dict(feeds), engine=engine)
        for i in compare if compare is not None else range(len(outs)):
            err = _rel(got[conv.values[_key(outs[i])]], refs[i])
            assert err <= tol[dtype], f"{op} on {engine}, {dtype}: result {i} rel err {err:.3g}"
    return conv


def randn(rng: np.random.Generator, *shape: int, dtype: Any) -> Any:
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def refused(fn: Callable[..., Any], inputs: Sequence[Any], op: Any, whole: bool = False) -> str:
    gm, conv = converted(fn, inputs, whole)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert node.name in conv.refused, f"{op} converted"
    return conv.refused[node.name]


# ---- batch norm --------------------------------------------------------------------------------------------
def _bn_inputs(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...] = (4, 3, 5, 6)) -> list[Any]:
    c = shape[1]
    return [randn(rng, *shape, dtype=dtype) * 2 + 0.5, randn(rng, c, dtype=dtype), randn(rng, c, dtype=dtype),
            randn(rng, c, dtype=dtype), randn(rng, c, dtype=dtype).abs() + 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 5)])
def test_batch_norm_training_with_running_statistics(rng: np.random.Generator, dtype: Any,
                                                     shape: tuple[int, ...]) -> None:
    def fn(x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        return a._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.3, 1e-3)

    check(fn, _bn_inputs(rng, dtype, shape), a._native_batch_norm_legit_functional.default, NORM_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_where_pytorch_would_call_cudnn(rng: np.random.Generator, dtype: Any) -> None:
    """The forms a CUDA training step takes with cuDNN: the update op with its reserve (handed
    back as zeros: only batch_norm_backward reads it, and not in its formula) and its backward."""
    def fn(dy: Any, x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        y, mean, inv, reserve, nrm, nrv = a._batch_norm_with_update_functional(x, w, b, rm, rv, 0.2, 1e-4)
        grads = a.batch_norm_backward(dy, x, w, rm, rv, mean, inv, True, 1e-4, [True, True, True], reserve)
        return y, mean, inv, nrm, nrv, *grads

    x, w, b, rm, rv = _bn_inputs(rng, dtype)
    conv = check(fn, [randn(rng, *x.shape, dtype=dtype), x, w, b, rm, rv],
                 a._batch_norm_with_update_functional.default, NORM_TOL)
    assert any(n.startswith("batch_norm_backward") for n in conv.converted), conv.refused

    def eval_fn(x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        return a._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5)[0]

    check(eval_fn, [x, w, b, rm, rv], a._batch_norm_no_update.default, NORM_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_eval_and_no_running_statistics(rng: np.random.Generator, dtype: Any) -> None:
    def eval_fn(x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        return a._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)[0]

    check(eval_fn, _bn_inputs(rng, dtype), a._native_batch_norm_legit_no_training.default, NORM_TOL)

    def no_stats(x: Any, w: Any, b: Any) -> Any:
        return a._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)

    check(no_stats, _bn_inputs(rng, dtype)[:3], a._native_batch_norm_legit.no_stats, NORM_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True)])
def test_batch_norm_backward(rng: np.random.Generator, dtype: Any, mask: tuple[bool, bool, bool]) -> None:
    def fn(dy: Any, x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        _, mean, inv = a._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
        grads = a.native_batch_norm_backward(dy, x, w, rm, rv, mean, inv, True, 1e-5, list(mask))
        return tuple(g for g in grads if g is not None)

    x, w, b, rm, rv = _bn_inputs(rng, dtype)
    check(fn, [randn(rng, *x.shape, dtype=dtype), x, w, b, rm, rv], a.native_batch_norm_backward.default, NORM_TOL)


def test_batch_norm_refusals(rng: np.random.Generator) -> None:
    x, w, b, rm, rv = _bn_inputs(rng, torch.float32)
    why = refused(lambda x, rm, rv: a._native_batch_norm_legit_functional(x, None, None, rm, rv, True, 0.1, 1e-5),
                  [x, rm, rv], a._native_batch_norm_legit_functional.default)
    assert "affine" in why
    why = refused(lambda dy, x, w, rm, rv: a.native_batch_norm_backward(dy, x, w, rm, rv, rm, rv, False, 1e-5,
                                                                        [True, True, True]),
                  [x, x, w, rm, rv], a.native_batch_norm_backward.default)
    assert "eval-mode" in why
    why = refused(lambda x, w, b, rm, rv: a.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5),
                  [x, w, b, rm, rv], a.native_batch_norm.default)
    assert "in place" in why

    def reserve_read(x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        out = a._batch_norm_with_update_functional(x, w, b, rm, rv, 0.1, 1e-5)
        return out[0], out[3].float()

    why = refused(reserve_read, [x, w, b, rm, rv], a._batch_norm_with_update_functional.default)
    assert "reserve" in why


# ---- group norm ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "groups", "affine"), [((2, 6, 4, 5), 3, True), ((3, 4, 7), 2, False)])
def test_group_norm_and_backward(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...], groups: int,
                                 affine: bool) -> None:
    n, c = shape[:2]
    hw = int(np.prod(shape[2:]))

    def fn(dy: Any, x: Any, w: Any, b: Any) -> Any:
        wt, bt = (w, b) if affine else (None, None)
        y, mean, rstd = a.native_group_norm(x, wt, bt, n, c, hw, groups, 1e-4)
        grads = a.native_group_norm_backward(dy, x, mean, rstd, wt, n, c, hw, groups, [True, affine, affine])
        return (y, mean, rstd, *(g for g in grads if g is not None))

    x = randn(rng, *shape, dtype=dtype) * 3 + 1
    inputs = [randn(rng, *shape, dtype=dtype), x, randn(rng, c, dtype=dtype), randn(rng, c, dtype=dtype)]
    conv = check(fn, inputs, a.native_group_norm.default, NORM_TOL)
    assert any(name.startswith("native_group_norm_backward") for name in conv.converted), conv.refused


# ---- RMSNorm -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "normalized", "eps"), [((3, 4, 16), [16], 1e-6), ((2, 3, 4, 8), [4, 8], None)])
def test_fused_rms_norm_and_backward(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...],
                                     normalized: list[int], eps: float | None) -> None:
    x, w = randn(rng, *shape, dtype=dtype), randn(rng, *normalized, dtype=dtype)
    def fwd(x: Any, w: Any) -> Any:
        y = a._fused_rms_norm.default(x, normalized, w, eps)
        return y[0], y[1]

    check(fwd, [x, w], a._fused_rms_norm.default, NORM_TOL, whole=True)

    # the backward has no CPU kernel: PyTorch's own decomposition of it is the reference
    decomposed = torch._decomp.decomposition_table[a._fused_rms_norm_backward.default]

    def grads(backward: Any) -> Callable[..., Any]:
        def bwd(dy: Any, x: Any, w: Any) -> Any:
            rstd = a._fused_rms_norm.default(x, normalized, w, eps)[1]
            g = backward(dy, x, normalized, rstd, w, [True, True])
            return g[0], g[1]

        return bwd

    check(grads(a._fused_rms_norm_backward.default), [randn(rng, *shape, dtype=dtype), x, w],
          a._fused_rms_norm_backward.default, NORM_TOL, whole=True, want=grads(decomposed))


def _rms_kinds(conv: conv_aten.Converted) -> list[OpKind]:
    return [n.kind for n in conv.graph.nodes if n.kind in (OpKind.RMSNORM, OpKind.REDUCTION)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decomposed_rms_norm_becomes_one_rmsnorm(rng: np.random.Generator, dtype: Any) -> None:
    """F.rms_norm on the CPU is, in AOTAutograd's graphs, pow -> mean -> add.Scalar -> rsqrt ->
    mul -> mul(weight): one rmsnorm, its six nodes its members; where the rsqrt and x * rsqrt are
    read (the backward saves them), they come from the norm's inverse RMS."""
    x, w = randn(rng, 3, 5, 16, dtype=dtype), randn(rng, 16, dtype=dtype)

    def rms_norm(x: Any, w: Any) -> Any:  # as PyTorch's decomposition writes it
        r = torch.rsqrt(a.add.Scalar(torch.pow(x, 2).mean(dim=[-1], keepdim=True), 1e-6))
        return w * x.mul(r)

    assert float((rms_norm(x, w) - F.rms_norm(x, [16], w, 1e-6)).abs().max()) < 1e-5
    conv = check(rms_norm, [x, w], a.pow.Tensor_Scalar, NORM_TOL)
    assert _rms_kinds(conv) == [OpKind.RMSNORM]
    assert [len(m) for m in conv.members.values()] == [6]

    def saved(x: Any, w: Any) -> Any:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        n = x * r
        return n * w, r, n

    conv = check(saved, [x, w], a.pow.Tensor_Scalar, NORM_TOL)
    assert _rms_kinds(conv) == [OpKind.RMSNORM]


def test_what_is_not_an_rms_norm_converts_op_by_op(rng: np.random.Generator) -> None:
    x, w = randn(rng, 3, 16, dtype=torch.float64), randn(rng, 16, dtype=torch.float64)

    def fourth(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.pow(4).mean(-1, keepdim=True) + 1e-5) * w

    def leading(x: Any, w: Any) -> Any:  # the mean over the first dim
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5) * w

    def pow_read(x: Any, w: Any) -> Any:  # the square is read elsewhere too
        p = x.pow(2)
        return x * torch.rsqrt(p.mean(-1, keepdim=True) + 1e-5) * w, p

    for fn in (fourth, leading, pow_read):
        conv = check(fn, [x, w], a.pow.Tensor_Scalar, NORM_TOL)
        assert _rms_kinds(conv) == [OpKind.REDUCTION] and not conv.members, fn.__name__


def test_rms_norm_refusals(rng: np.random.Generator) -> None:
    x = randn(rng, 3, 16, dtype=torch.float32)
    op = a._fused_rms_norm.default
    assert "weight" in refused(lambda x: op(x, [16], None, 1e-5)[0], [x], op, whole=True)


# ---- max pooling, concatenation -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil"),
                         [([3, 3], [2, 2], [1, 1], False), ([2, 2], [], [0, 0], False), ([3, 2], [2, 1], [1, 0], True)])
def test_max_pool(rng: np.random.Generator, dtype: Any, kernel: list[int], stride: list[int],
                  padding: list[int], ceil: bool) -> None:
    def fn(x: Any) -> Any:
        return a.max_pool2d_with_indices(x, kernel, stride, padding, [1, 1], ceil)[0]

    check(fn, [randn(rng, 2, 3, 8, 7, dtype=dtype)], a.max_pool2d_with_indices.default, EXACT_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil", "include_pad"),
                         [([3, 3], [2, 2], [1, 1], False, True), ([3, 3], [2, 2], [1, 1], False, False),
                          ([2, 2], [], [0, 0], False, True), ([3, 2], [2, 1], [1, 0], True, False)])
def test_avg_pool(rng: np.random.Generator, dtype: Any, kernel: list[int], stride: list[int], padding: list[int],
                  ceil: bool, include_pad: bool) -> None:
    def fn(x: Any) -> Any:
        return a.avg_pool2d(x, kernel, stride, padding, ceil, include_pad)

    check(fn, [randn(rng, 2, 3, 8, 7, dtype=dtype)], a.avg_pool2d.default, NORM_TOL)


def test_avg_pool_refusals(rng: np.random.Generator) -> None:
    x = randn(rng, 2, 3, 8, 7, dtype=torch.float32)
    why = refused(lambda x: a.avg_pool2d(x, [2, 2], [2, 2], [0, 0], False, True, 3), [x], a.avg_pool2d.default)
    assert "divisor_override" in why
    why = refused(lambda x: a.avg_pool2d(x, [3, 2], [2, 1], [1, 0], True, True), [x], a.avg_pool2d.default)
    assert "ceil_mode" in why


def test_max_pool_refusals(rng: np.random.Generator) -> None:
    x = randn(rng, 2, 3, 8, 8, dtype=torch.float32)
    why = refused(lambda x: a.max_pool2d_with_indices(x, [2, 2]), [x], a.max_pool2d_with_indices.default)
    assert "indices" in why and "backward" in why
    why = refused(lambda x: a.max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0], [2, 2])[0], [x],
                  a.max_pool2d_with_indices.default)
    assert "dilation" in why


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat(rng: np.random.Generator, dtype: Any, dim: int) -> None:
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, s in enumerate(shapes):
        s[dim] += i
    inputs = [randn(rng, *s, dtype=dtype) for s in shapes]
    check(lambda *ts: a.cat(list(ts), dim), inputs, a.cat.default, EXACT_TOL)


# ---- end to end ------------------------------------------------------------------------------------------------
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: Any) -> Any:
        y = self.pool(F.relu(self.bn1(self.c1(x))))
        y = F.relu(self.bn2(self.c2(y)) + y)
        return self.fc(y.flatten(1))


class GNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.gn = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.pool(F.silu(self.gn(self.c1(x)))).flatten(1))


class RMSBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: Any) -> Any:
        return self.n2(x + self.down(F.silu(self.up(self.n1(x)))))


def _step(model: nn.Module, fn: Callable[[Any], Any], x: Any, target: Any) -> float:
    loss = F.mse_loss(fn(x), target)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def _rel_t(got: Any, want: Any) -> float:
    assert not torch.isnan(got).any()
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(("make", "shape", "out"),
                         [(BNNet, (4, 3, 8, 8), 10), (GNNet, (2, 3, 8, 8), 10), (RMSBlock, (2, 8, 16), 16)])
def test_training_step_matches_eager(rng: np.random.Generator, make: Callable[[], nn.Module],
                                     shape: tuple[int, ...], out: int) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    eager = make()
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options={"floor": False, "rest": "eager"}))
    before = set(RUNNERS)
    x = randn(rng, *shape, dtype=torch.float32)
    target = randn(rng, *shape[:-1], out, dtype=torch.float32) if make is RMSBlock else randn(rng, shape[0], out,
                                                                                               dtype=torch.float32)
    want, got = _step(eager, eager, x, target), _step(twin, compiled, x, target)
    assert abs(got - want) <= 1e-5 * abs(want)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert q.grad is not None, name
        assert _rel_t(q.grad, p.grad) < 1e-4, name
    for (name, b), c in zip(eager.named_buffers(), twin.buffers(), strict=True):  # running statistics
        assert torch.equal(b, c) if not b.is_floating_point() else _rel_t(c, b) < 1e-5, name
    bound = [b for k in set(RUNNERS) - before for b in RUNNERS[k]._bound.values()]
    assert bound and all(b.plan is not None for b in bound), [b.why for b in bound]  # fusegraph ran each region


def test_explain_claims_batch_norm_max_pool_and_rms_norm(rng: np.random.Generator) -> None:
    x = randn(rng, 2, 3, 8, 8, dtype=torch.float32)
    report = explain(BNNet(), x, options={"rest": "eager"})
    claimed = {r.op for r in report.rows if r.fusegraph}
    assert {"aten._native_batch_norm_legit_functional", "aten.native_batch_norm_backward"} <= claimed, report.summary()
    pool = next(r for r in report.rows if r.op == "aten.max_pool2d_with_indices")
    assert not pool.fusegraph and "indices" in pool.why  # training: its backward reads the indices
    model = BNNet().eval()
    with torch.no_grad():
        infer = explain(model, x, options={"rest": "eager"})
    claimed = {r.op for r in infer.rows if r.fusegraph}
    assert {"aten._native_batch_norm_legit_no_training", "aten.max_pool2d_with_indices"} <= claimed, infer.summary()
    assert infer.coverage == 1.0, infer.summary()
    gn = explain(GNNet(), x, options={"rest": "eager"})
    claimed = {r.op for r in gn.rows if r.fusegraph}
    assert {"aten.native_group_norm", "aten.native_group_norm_backward", "aten.avg_pool2d"} <= claimed, gn.summary()
    block = explain(RMSBlock(), randn(rng, 2, 8, 16, dtype=torch.float32), options={"rest": "eager"})
    rms = [r for r in block.rows if r.pattern.startswith("triton.norm.rmsnorm") and r.node.startswith("fw")]
    assert {r.op for r in rms} >= {"aten.pow", "aten.mean", "aten.rsqrt", "aten.mul"}, block.summary()
    assert len({r.region for r in rms}) == 2  # one region for each norm


@pytest.mark.slow
def test_training_step_with_inductor_as_the_rest(rng: np.random.Generator) -> None:
    """The default rest: batch norm is kept whole through Inductor's decompositions and
    claimed; max pooling, refused in training, is decomposed for Inductor after all."""
    torch.manual_seed(int(rng.integers(1 << 31)))
    eager = BNNet()
    twin = copy.deepcopy(eager)
    x, target = randn(rng, 4, 3, 8, 8, dtype=torch.float32), randn(rng, 4, 10, dtype=torch.float32)
    report = explain(copy.deepcopy(eager), x, options={"floor": False})
    claimed = {r.op for r in report.rows if r.fusegraph}
    assert {"aten._native_batch_norm_legit_functional", "aten.native_batch_norm_backward"} <= claimed, report.summary()
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="fusegraph", options={"floor": False})
    want, got = _step(eager, eager, x, target), _step(twin, compiled, x, target)
    assert abs(got - want) <= 1e-5 * abs(want)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert q.grad is not None and _rel_t(q.grad, p.grad) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("rest", ["inductor", "eager"])
def test_cuda_training_step_claims_batch_norm_and_rms_norm(rng: np.random.Generator, rest: str) -> None:
    """On CUDA PyTorch takes other forms: batch norm goes through cuDNN's update op
    (``_batch_norm_with_update_functional`` / ``batch_norm_backward``) and RMSNorm through
    ``_fused_rms_norm`` and its backward. Each is claimed, and the step matches eager."""
    torch.manual_seed(int(rng.integers(1 << 31)))
    for make, shape, out, ops in (
        (BNNet, (4, 3, 8, 8), 10, ({"aten._batch_norm_with_update_functional", "aten._native_batch_norm_legit_functional"},
                                   {"aten.batch_norm_backward", "aten.native_batch_norm_backward"})),
        (RMSBlock, (2, 8, 16), 16, ({"aten._fused_rms_norm"}, {"aten._fused_rms_norm_backward"})),
    ):
        eager = make().cuda()
        twin = copy.deepcopy(eager)
        x = randn(rng, *shape, dtype=torch.float32).cuda()
        target = (randn(rng, *shape[:-1], out, dtype=torch.float32) if make is RMSBlock
                  else randn(rng, shape[0], out, dtype=torch.float32)).cuda()
        report = explain(copy.deepcopy(eager), x, options={"rest": rest})
        claimed = {r.op for r in report.rows if r.fusegraph}
        norms = "\n".join(f"{r.op} {r.where} {r.why}" for r in report.rows if "norm" in r.op)
        assert all(claimed & group for group in ops), f"{report.summary()}\n{norms}"
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend=partial(fusegraph_backend, options={"floor": False, "rest": rest}))
        want, got = _step(eager, eager, x, target), _step(twin, compiled, x, target)
        assert abs(got - want) <= 1e-4 * abs(want)
        for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
            assert q.grad is not None and _rel_t(q.grad, p.grad) < 1e-3, name
        for (name, b), c in zip(eager.named_buffers(), twin.buffers(), strict=True):
            assert torch.equal(b, c) if not b.is_floating_point() else _rel_t(c, b) < 1e-4, name


def test_a_0_dim_value_is_refused_alone(rng: np.random.Generator) -> None:
    """A scalar (a loss summed inside the compiled graph) is refused where it is read: as a
    graph tensor without dims it failed the whole graph's validation, so nothing was claimed."""
    def fn(x: Any, w: Any, b: Any) -> Any:
        y = a._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)[0]
        return y, torch.relu(y).sum() + x.mean()

    x, w, b = _bn_inputs(rng, torch.float32)[:3]
    _, conv = converted(fn, [x, w, b])
    conv.graph.validate()
    assert any(n.startswith("_native_batch_norm_legit") for n in conv.converted)
    assert any("0-dim" in why for why in conv.refused.values()), conv.refused

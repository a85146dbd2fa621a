"""The ATen converters of fusegraph/torch/aten_gather.py -- ``aten.embedding``, its backward
``aten.embedding_dense_backward`` and ``aten.index_select`` -- each traced from the ATen op,
converted, run on the float64 reference engine and the torch engine, and compared with the
ATen op on fresh random data; what the graph API cannot express (sparse gradients, gradients
scaled by id frequency) refused with the reason. Then end to end: ``nn.Embedding`` + ``Linear``
under ``torch.compile(backend=fusegraph)``: the embedding and its backward claimed (explain's
rows), the loss and every gradient equal to eager's, on the CPU and (marked gpu) on CUDA."""

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

a = torch.ops.aten
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _rel(got: Any, want: Any) -> float:
    g = got.detach().cpu().double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, dtype=np.float64)
    w = want.detach().cpu().double().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64)
    assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
    if not np.isfinite(g).all():
        return float("inf")  # NaN never passes
    return float(np.linalg.norm(g - w)) / max(float(np.linalg.norm(w)), 1e-300)


def _converted(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, conv_aten.Converted]:
    gm = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(*inputs)
    return gm, conv_aten.convert(gm.graph)


def _feeds(gm: Any, conv: conv_aten.Converted, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """The graph inputs' arrays: each the traced function's argument its placeholder stands for."""
    places = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return {t: inputs[places.index(k[0])].numpy() for t, k in conv.inputs.items()}


def _check(fn: Callable[..., Any], inputs: Sequence[Any], op: Any, kind: OpKind) -> None:
    """``fn``'s ``op`` node converted (to a ``kind`` node), run on the reference and torch
    engines, equal to ``fn`` run by PyTorch."""
    gm, conv = _converted(fn, inputs)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert node.name in conv.converted, conv.refused
    assert [n.kind for n in conv.graph.nodes] == [kind]
    feeds = _feeds(gm, conv, inputs)
    out = conv.graph.tensor_by_name(conv.values[(node.name, None)])
    out.set_output(True)
    graph = conv.graph.validate()
    want = fn(*inputs)
    dtype = next(x.dtype for x in inputs if x.is_floating_point())
    for engine in ("reference", "torch"):
        err = _rel(graph.execute(dict(feeds), engine=engine)[out.name], want)
        assert err <= TOL[dtype], f"{op} on {engine}, {dtype}: rel err {err:.3g}"


def _refused(fn: Callable[..., Any], inputs: Sequence[Any], op: Any) -> str:
    gm, conv = _converted(fn, inputs)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert node.name in conv.refused, f"{op} converted"
    return conv.refused[node.name]


def _one_step_like_eager(eager: Any, x: Any, target: Any, options: dict[str, Any], ops: set[str]) -> None:
    """``eager`` under the backend with ``options``: ``ops`` claimed (explain's rows), and one
    training step's MSE loss and every gradient equal to eager's (<= 1e-5 relative)."""
    twin = copy.deepcopy(eager)
    report = explain(copy.deepcopy(eager), x, options=options)
    claimed = {r.op for r in report.rows if r.fusegraph}
    assert ops <= claimed, report.summary()
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options=options))
    losses = []
    for model in (eager, compiled):
        loss = F.mse_loss(model(x), target)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(float(loss.detach()))
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0])
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert _rel(q.grad, p.grad) <= 1e-5, name


def _randn(rng: np.random.Generator, *shape: int, dtype: Any = torch.float32) -> Any:
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def _ids(rng: np.random.Generator, rows: int, *shape: int, dtype: Any = torch.int64) -> Any:
    return torch.from_numpy(rng.integers(0, rows, shape)).to(dtype)


# ---- converters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("it", [torch.int64, torch.int32])
def test_embedding(rng: np.random.Generator, dtype: Any, it: Any) -> None:
    w, ids = _randn(rng, 37, 12, dtype=dtype), _ids(rng, 37, 3, 5, dtype=it)
    _check(lambda w, i: a.embedding.default(w, i), [w, ids], a.embedding.default, OpKind.GATHER)
    _check(lambda w, i: a.embedding.default(w, i, 4), [w, ids], a.embedding.default, OpKind.GATHER)


@pytest.mark.parametrize("padding_idx", [-1, 0, 6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_embedding_dense_backward(rng: np.random.Generator, dtype: Any, padding_idx: int) -> None:
    rows = 19
    ids = _ids(rng, rows, 4, 9)
    ids[0, :4] = ids[1, 2]  # repeated ids sum
    ids[2, 3] = max(padding_idx, 0)
    dy = _randn(rng, 4, 9, 7, dtype=dtype)
    fn: Callable[..., Any] = lambda g, i: a.embedding_dense_backward.default(g, i, rows, padding_idx, False)  # noqa: E731
    _check(fn, [dy, ids], a.embedding_dense_backward.default, OpKind.GATHER_BACKWARD)


def test_embedding_dense_backward_matches_autograd(rng: np.random.Generator) -> None:
    """The converted backward against nn.Embedding's weight gradient (not only the ATen op)."""
    rows, pad = 13, 2
    ids = _ids(rng, rows, 6, 4)
    ids[1, 1] = pad
    dy = _randn(rng, 6, 4, 5, dtype=torch.float64)
    emb = nn.Embedding(rows, 5, padding_idx=pad).double()
    emb(ids).backward(dy)
    gm, conv = _converted(lambda g, i: a.embedding_dense_backward.default(g, i, rows, pad, False), [dy, ids])
    (t,) = [conv.graph.tensor_by_name(v) for v in conv.values.values()]
    t.set_output(True)
    got = conv.graph.validate().execute(_feeds(gm, conv, [dy, ids]), engine="torch")[t.name]
    assert emb.weight.grad is not None and _rel(got, emb.weight.grad) < 1e-12


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select(rng: np.random.Generator, dim: int) -> None:
    x = _randn(rng, 6, 8, 5)
    ids = _ids(rng, x.shape[dim], 7)
    _check(lambda x, i: a.index_select.default(x, dim, i), [x, ids], a.index_select.default, OpKind.GATHER)


def test_refusals_say_why(rng: np.random.Generator) -> None:
    w, ids = _randn(rng, 10, 4), _ids(rng, 10, 3)
    why = _refused(lambda w, i: a.embedding.default(w, i, -1, False, True), [w, ids], a.embedding.default)
    assert "sparse=True" in why
    why = _refused(lambda w, i: a.embedding.default(w, i, -1, True, False), [w, ids], a.embedding.default)
    assert "scale_grad_by_freq=True" in why
    dy = _randn(rng, 3, 4)
    why = _refused(lambda g, i: a.embedding_dense_backward.default(g, i, 10, -1, True), [dy, ids],
                   a.embedding_dense_backward.default)
    assert "scale_grad_by_freq=True" in why
    why = _refused(lambda x, i: a.index_select.default(x, 0, i), [w, ids[0]], a.index_select.default)
    assert "0-dim" in why


def test_ids_computed_outside_are_an_integer_graph_input(rng: np.random.Generator) -> None:
    """Ids cast from floats by code fusegraph leaves alone: a graph input of the cast's
    value, and the lookup still converted."""
    w, fids = _randn(rng, 10, 4), _ids(rng, 10, 3).double()
    _, conv = _converted(lambda x, i: a.index_select.default(x, 0, i.long()), [w, fids])
    assert "index_select" in conv.converted and "_to_copy" in conv.refused
    ids_input = next(t for t in conv.graph.inputs() if not t.dtype.is_float)
    assert ids_input.name == "in:_to_copy" and ids_input.dtype.name == "INT64"


# ---- end to end ----------------------------------------------------------------------------------------
class EmbNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16, padding_idx=5)
        self.lin = nn.Linear(16, 8)

    def forward(self, ids: Any) -> Any:
        return self.lin(torch.tanh(self.emb(ids)))


def _step(fn: Callable[[Any], Any], ids: Any, target: Any) -> float:
    loss = F.mse_loss(fn(ids), target)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def _training_step_matches_eager(rng: np.random.Generator, device: str) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    eager = EmbNet().to(device)
    twin = copy.deepcopy(eager)
    ids = _ids(rng, 64, 4, 11).to(device)
    ids[0, :2] = 5  # the padding row is looked up: its gradient stays zero
    ids[1, :3] = ids[2, 0]  # repeats
    target = _randn(rng, 4, 11, 8).to(device)
    report = explain(copy.deepcopy(eager), ids, options={"floor": False})
    claimed = {r.op for r in report.rows if r.fusegraph}
    assert {"aten.embedding", "aten.embedding_dense_backward"} <= claimed, report.summary()
    patterns = {r.pattern for r in report.rows if r.op.startswith("aten.embedding")}
    assert patterns == {"gather", "gather.backward"}, patterns
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options={"floor": False}))
    want, got = _step(eager, ids, target), _step(compiled, ids, target)
    assert abs(got - want) <= 1e-5 * abs(want)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert _rel(q.grad, p.grad) <= 1e-5, name
    assert twin.emb.weight.grad is not None and not twin.emb.weight.grad[5].any()


def test_training_step_matches_eager_on_cpu(rng: np.random.Generator) -> None:
    _training_step_matches_eager(rng, "cpu")


@pytest.mark.gpu
def test_training_step_matches_eager_on_cuda(rng: np.random.Generator) -> None:
    _training_step_matches_eager(rng, "cuda")

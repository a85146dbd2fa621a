"""The ATen converters of fusegraph/torch/aten_pool.py -- ``aten.max_pool2d_with_indices_backward``
and ``aten.avg_pool2d_backward`` -- each traced from the ATen op, converted, run on the
float64 reference engine and the torch engine, and compared with the ATen op on fresh
random data (ties in max windows included); what the graph op cannot express (dilation,
ceil_mode, divisor_override, unbatched input) refused with the reason. Then end to end: a
conv + BatchNorm + ReLU + MaxPool2d + AvgPool2d + Linear model under
``torch.compile(backend=fusegraph)``: both pooling backward ops claimed (explain's rows),
one training step's loss and every gradient equal to eager's, on the CPU and (marked gpu)
on CUDA."""

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
from test_torch_aten_gather import _converted, _randn, _refused, _rel  # noqa: E402  (the same checks)

from fusegraph.graph.ops import OpKind  # noqa: E402
from fusegraph.torch.compile_backend import fusegraph_backend  # noqa: E402
from fusegraph.torch.explainer import explain  # noqa: E402

a = torch.ops.aten
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _check(fn: Callable[..., Any], inputs: Sequence[Any], op: Any) -> None:
    """``fn``'s ``op`` node converted to one pooling_backward node, run on the reference and
    torch engines, equal to ``fn`` run by PyTorch."""
    gm, conv = _converted(fn, inputs)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert node.name in conv.converted, conv.refused
    assert [n.kind for n in conv.graph.nodes] == [OpKind.POOLING_BACKWARD]
    places = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    feeds = {t: inputs[places.index(k[0])].numpy() for t, k in conv.inputs.items()}
    out = conv.graph.tensor_by_name(conv.values[(node.name, None)])
    out.set_output(True)
    graph = conv.graph.validate()
    want = fn(*inputs)
    for engine in ("reference", "torch"):
        err = _rel(graph.execute(dict(feeds), engine=engine)[out.name], want)
        assert err <= TOL[inputs[0].dtype], f"{op} on {engine}, {inputs[0].dtype}: rel err {err:.3g}"


def _max_backward(kernel: list[int], stride: list[int], padding: list[int], dilation: Sequence[int] = (1, 1),
                  ceil: bool = False) -> Callable[[Any, Any], Any]:
    def fn(dy: Any, x: Any) -> Any:
        _, idx = a.max_pool2d_with_indices(x, kernel, stride, padding, list(dilation), ceil)
        return a.max_pool2d_with_indices_backward(dy, x, kernel, stride, padding, list(dilation), ceil, idx)
    return fn


def _avg_backward(kernel: list[int], stride: list[int], padding: list[int], ceil: bool = False,
                  include: bool = True, divisor: int | None = None) -> Callable[[Any, Any], Any]:
    def fn(dy: Any, x: Any) -> Any:
        return a.avg_pool2d_backward(dy, x, kernel, stride, padding, ceil, include, divisor)
    return fn


def _pooled(x: Any, kernel: list[int], stride: list[int], padding: list[int]) -> list[int]:
    return [*x.shape[:2], *((n + 2 * p - k) // s + 1 for n, k, s, p in zip(x.shape[2:], kernel, stride, padding,
                                                                           strict=True))]


WINDOWS = [([3, 3], [2, 2], [1, 1]), ([2, 2], [2, 2], [0, 0]), ([3, 2], [1, 2], [1, 0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("kernel", "stride", "padding"), WINDOWS)
def test_max_pool2d_with_indices_backward(rng: np.random.Generator, dtype: Any, kernel: list[int], stride: list[int],
                                          padding: list[int]) -> None:
    x = torch.from_numpy(rng.integers(-2, 3, (2, 3, 9, 8))).to(dtype)  # ties in most windows
    dy = _randn(rng, *_pooled(x, kernel, stride, padding), dtype=dtype)
    _check(_max_backward(kernel, stride, padding), [dy, x], a.max_pool2d_with_indices_backward.default)


@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize(("kernel", "stride", "padding"), WINDOWS)
def test_avg_pool2d_backward(rng: np.random.Generator, include: bool, kernel: list[int], stride: list[int],
                             padding: list[int]) -> None:
    x = _randn(rng, 2, 3, 9, 8)
    dy = _randn(rng, *_pooled(x, kernel, stride, padding))
    _check(_avg_backward(kernel, stride, padding, include=include), [dy, x], a.avg_pool2d_backward.default)


def test_refusals_say_why(rng: np.random.Generator) -> None:
    x = _randn(rng, 2, 3, 9, 9)
    mb, ab = a.max_pool2d_with_indices_backward.default, a.avg_pool2d_backward.default
    dy = _randn(rng, 2, 3, 4, 4)
    assert "dilation [2, 2]" in _refused(_max_backward([3, 3], [2, 2], [1, 1], (2, 2)), [dy, x], mb)
    dy = _randn(rng, 2, 3, 5, 5)
    assert "ceil_mode=True" in _refused(_max_backward([3, 3], [2, 2], [1, 1], ceil=True), [dy, x], mb)
    assert "ceil_mode=True" in _refused(_avg_backward([3, 3], [2, 2], [1, 1], ceil=True), [dy, x], ab)
    dy = _randn(rng, 2, 3, 4, 4)
    assert "divisor_override" in _refused(_avg_backward([3, 3], [2, 2], [0, 0], divisor=5), [dy, x], ab)
    assert "unbatched" in _refused(_avg_backward([3, 3], [2, 2], [0, 0]), [dy[0], x[0]], ab)


# ---- end to end ----------------------------------------------------------------------------------------
class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.avgpool = nn.AvgPool2d(3, 2, padding=1, count_include_pad=False)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: Any) -> Any:
        y = self.avgpool(self.maxpool(torch.relu(self.bn(self.conv(x)))))
        return self.fc(torch.flatten(y, 1))


def _step(fn: Callable[[Any], Any], x: Any, target: Any) -> float:
    loss = F.mse_loss(fn(x), target)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def _training_step_matches_eager(rng: np.random.Generator, device: str) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    eager = PoolNet().to(device)
    twin = copy.deepcopy(eager)
    x = _randn(rng, 2, 3, 16, 16).to(device)
    target = _randn(rng, 2, 5).to(device)
    report = explain(copy.deepcopy(eager), x, options={"floor": False})
    claimed = {r.op for r in report.rows if r.fusegraph}
    assert {"aten.max_pool2d_with_indices_backward", "aten.avg_pool2d_backward"} <= claimed, report.summary()
    patterns = {r.pattern for r in report.rows if r.op.endswith("pool2d_backward") or "with_indices_backward" in r.op}
    assert patterns == {"pooling.backward"}, patterns
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options={"floor": False}))
    want, got = _step(eager, x, target), _step(compiled, x, target)
    assert abs(got - want) <= 1e-5 * abs(want)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert _rel(q.grad, p.grad) <= 1e-5, name


def test_training_step_matches_eager_on_cpu(rng: np.random.Generator) -> None:
    _training_step_matches_eager(rng, "cpu")


@pytest.mark.gpu
def test_training_step_matches_eager_on_cuda(rng: np.random.Generator) -> None:
    _training_step_matches_eager(rng, "cuda")

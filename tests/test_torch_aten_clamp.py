"""The clamp converters of fusegraph/torch/aten_clamp.py -- ``aten.hardtanh`` (``nn.ReLU6``),
``aten.clamp`` / ``clamp_min`` / ``clamp_max`` and ``aten.hardtanh_backward`` -- each traced
from the ATen op, converted, run on the float64 reference engine and the torch engine, and
compared with the ATen op on fresh random data that includes values exactly at the bounds
(where the backward passes no gradient). A tensor bound is not converted, and says so. End
to end, a MobileNetV2 block (conv + batch norm + ReLU6) trains one step under the backend,
every region claimed, equal to eager, the ReLU6 backward claimed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the ATen converters need torch")

import torch.nn as nn  # noqa: E402
from test_torch_aten_gather import _converted, _feeds, _one_step_like_eager, _randn, _rel  # noqa: E402  (the same checks)

a = torch.ops.aten
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _with_bounds(rng: np.random.Generator, dtype: Any, bounds: Sequence[float]) -> Any:
    x = _randn(rng, 6, 7, dtype=dtype) * 4
    flat = x.view(-1)
    for i, b in enumerate(bounds):  # values exactly at each bound
        flat[3 * i] = b
    return x


def _check(fn: Callable[..., Any], inputs: Sequence[Any], op: Any) -> None:
    gm, conv = _converted(fn, inputs)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert node.name in conv.converted, conv.refused
    out = conv.graph.tensor_by_name(conv.values[(node.name, None)])
    out.set_output(True)
    graph = conv.graph.validate()
    want = fn(*inputs)
    for engine in ("reference", "torch"):
        got = graph.execute(dict(_feeds(gm, conv, inputs)), engine=engine)[out.name]
        err = _rel(got, want)
        assert err <= TOL[inputs[-1].dtype], f"{op} on {engine}, {inputs[-1].dtype}: rel err {err:.3g}"
        if op is a.hardtanh_backward.default:  # no gradient at the bounds, nor outside
            outside = ((inputs[1] <= 0.0) | (inputs[1] >= 6.0)).numpy()
            assert np.all(np.asarray(got)[outside] == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clamps_and_the_relu6_backward_equal_aten(rng: np.random.Generator, dtype: Any) -> None:
    x = _with_bounds(rng, dtype, (0.0, 6.0, -1.0, 2.0))
    dy = _randn(rng, 6, 7, dtype=dtype)
    _check(lambda x: a.hardtanh(x, 0.0, 6.0), [x], a.hardtanh.default)
    _check(lambda x: a.hardtanh(x), [x], a.hardtanh.default)  # the defaults, -1 and 1
    _check(lambda x: a.clamp(x, -1.0, 2.0), [x], a.clamp.default)
    _check(lambda x: a.clamp(x, None, 2.0), [x], a.clamp.default)
    _check(lambda x: a.clamp_min(x, 0.5), [x], a.clamp_min.default)
    _check(lambda x: a.clamp_max(x, -0.5), [x], a.clamp_max.default)
    _check(lambda dy, x: a.hardtanh_backward(dy, x, 0.0, 6.0), [dy, x], a.hardtanh_backward.default)


def test_a_tensor_bound_is_not_converted(rng: np.random.Generator) -> None:
    x, lo = _randn(rng, 4, 5), _randn(rng, 4, 5)
    gm, conv = _converted(lambda x, lo: a.clamp(x, lo), [x, lo])
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert node.name in conv.refused, conv.converted
    assert "no converter for aten.clamp" in conv.refused[node.name]


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1, each conv + batch norm,
    ReLU6 after the first two, the input added back."""

    def __init__(self, c: int = 8, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: Any) -> Any:
        return x + self.project(self.dw(self.expand(x)))


def test_a_mobilenet_v2_block_trains_as_eager_with_relu6_claimed(rng: np.random.Generator) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    x = _randn(rng, 2, 8, 6, 6) * 3  # wide enough that some activations pass 6
    _one_step_like_eager(InvertedResidual(), x, torch.zeros_like(x), {"floor": False, "rest": "eager"},
                         {"aten.hardtanh", "aten.hardtanh_backward"})

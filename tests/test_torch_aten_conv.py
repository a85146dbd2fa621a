"""The convolution converters of fusegraph/torch/aten.py on what a held-out model traced
(benchmarks/held_out_models.py, EfficientNet-B0): ``padding="valid"`` traces to ATen's
one-entry ``[0]``, which ATen expands to every spatial axis; the converters expand it too,
and the converted convolution and its backward equal the ATen ops on the float64 reference
and torch engines. A node a converter builds against its op's rules is refused alone, with
the rule it broke, where validating the whole graph refused every node of it. End to end,
a depthwise ``padding="valid"`` convolution's training step under the backend (every
region claimed) equals eager's, its backward claimed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the ATen converters need torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_torch_aten_gather import _converted, _feeds, _one_step_like_eager, _randn, _rel  # noqa: E402  (the same checks)

from fusegraph.graph.ops import OpKind  # noqa: E402
from fusegraph.torch import aten as conv_aten  # noqa: E402

a = torch.ops.aten
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _valid_conv(x: Any, w: Any) -> Any:
    return a.convolution(x, w, None, [1], [0], [1], False, [0], 1)


def _valid_conv_backward(dy: Any, x: Any, w: Any) -> Any:
    return a.convolution_backward(dy, x, w, None, [1], [0], [1], False, [0], 1, [True, True, False])[:2]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_entry_window_lists_are_expanded_per_spatial_axis(rng: np.random.Generator, dtype: Any) -> None:
    x, w, dy = _randn(rng, 2, 3, 9, 7, dtype=dtype), _randn(rng, 4, 3, 3, 2, dtype=dtype), _randn(rng, 2, 4, 7, 6, dtype=dtype)
    for fn, inputs, op in ((_valid_conv, [x, w], a.convolution.default),
                           (_valid_conv_backward, [dy, x, w], a.convolution_backward.default)):
        gm, conv = _converted(fn, inputs)
        node = next(n for n in gm.graph.nodes if n.target is op)
        assert node.name in conv.converted, conv.refused
        for n in conv.graph.nodes:
            if n.kind in (OpKind.CONV_FPROP, OpKind.CONV_DGRAD, OpKind.CONV_WGRAD):
                assert list(n.attrs.pre_padding) == [0, 0] and list(n.attrs.stride) == [1, 1], n
        keys = [(node.name, None)] if op is a.convolution.default else [(node.name, 0), (node.name, 1)]
        outs = [conv.graph.tensor_by_name(conv.values[k]) for k in keys]
        for t in outs:
            t.set_output(True)
        graph = conv.graph.validate()
        want = fn(*inputs)
        want = [want] if op is a.convolution.default else list(want)
        for engine in ("reference", "torch"):
            got = graph.execute(dict(_feeds(gm, conv, inputs)), engine=engine)
            for t, ref in zip(outs, want, strict=True):
                err = _rel(got[t.name], ref)
                assert err <= TOL[dtype], f"{op} on {engine}, {dtype}: rel err {err:.3g}"


def test_a_node_built_against_its_ops_rules_is_refused_alone(rng: np.random.Generator,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A converter that passes the one-entry padding on unexpanded (as before the fix)
    builds a convolution the graph's rules refuse: that node alone is refused, saying which
    rule, and the ReLU after it is still converted."""
    def unexpanded(n: Any, x: Any, **params: Any) -> dict[str, list[int]]:
        return {k: [int(v) for v in vs] for k, vs in params.items()}

    monkeypatch.setattr(conv_aten, "_window", unexpanded)

    def fn(dy: Any, x: Any, w: Any, y: Any) -> Any:
        return _valid_conv(x, w), _valid_conv_backward(dy, x, w), a.relu(y)

    dy, x, w, y = _randn(rng, 2, 4, 7, 6), _randn(rng, 2, 3, 9, 7), _randn(rng, 4, 3, 3, 2), _randn(rng, 2, 5)
    gm, conv = _converted(fn, [dy, x, w, y])
    for op in (a.convolution.default, a.convolution_backward.default):
        node = next(n for n in gm.graph.nodes if n.target is op)
        assert "pre_padding has 1 entries, expected 2" in conv.refused.get(node.name, ""), (op, conv.refused)
    relu = next(n for n in gm.graph.nodes if n.target is a.relu.default)
    assert relu.name in conv.converted, conv.refused
    conv.graph.validate()  # what is left is a valid graph


class DepthwiseValid(nn.Module):
    """EfficientNet's depthwise convolution as transformers writes it: ``padding="valid"``
    after an explicit pad, then batch norm and SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(6, 6, 3, stride=2, padding="valid", groups=6, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: Any) -> Any:
        y = F.silu(self.bn(self.dw(F.pad(x, (0, 1, 0, 1)))))
        return self.fc(y.mean((2, 3)))


def test_a_valid_padding_depthwise_training_step_matches_eager(rng: np.random.Generator) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    _one_step_like_eager(DepthwiseValid(), _randn(rng, 2, 6, 9, 9), _randn(rng, 2, 4),
                         {"floor": False, "rest": "eager"}, {"aten.convolution", "aten.convolution_backward"})

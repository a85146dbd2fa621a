"""The pad and slice converters of fusegraph/torch/aten_pad.py: a ``constant_pad_nd`` that
only crops (the pad's backward) and ``aten.slice.Tensor`` (negative starts, steps, ends past
the axis) traced, converted, run on the float64 reference engine and the torch engine, and
compared with the ATen op on fresh random data; a zero pad read by a convolution folded into
its padding (uneven, as TF-style "same" padding makes it) against ATen's pad + convolution;
pads that add elements elsewhere refused with the reason. End to end, a block with TF-style
padding before a strided convolution trains one step under the backend, every region
claimed, equal to eager, the folded convolution claimed and the crop converted (the report
counts a crop, like ``aten.slice``, as data movement, not a compute node); in inference the
pad is claimed with its convolution. ``slice_backward`` pads with zeros and stays refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the ATen converters need torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_torch_aten_clamp import _check  # noqa: E402  (converted, run on both engines, against the op)
from test_torch_aten_gather import _converted, _one_step_like_eager, _randn, _rel  # noqa: E402  (the same checks)

from fusegraph.torch import explain  # noqa: E402

a = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_crop_and_slices_equal_aten(rng: np.random.Generator, dtype: Any) -> None:
    x = _randn(rng, 2, 3, 9, 8, dtype=dtype)
    _check(lambda x: a.constant_pad_nd(x, [0, -1, -2, -1]), [x], a.constant_pad_nd.default)
    _check(lambda x: a.constant_pad_nd(x, [-1, 0, 0, 0, -1, -1]), [x], a.constant_pad_nd.default)
    _check(lambda x: a.slice(x, 1, 1, 3), [x], a.slice.Tensor)
    _check(lambda x: a.slice(x, -1, -5, 1 << 62), [x], a.slice.Tensor)  # negative start, end past the axis
    _check(lambda x: a.slice(x, 2, 1, 8, 3), [x], a.slice.Tensor)  # a step
    _check(lambda x: a.slice(x, 3, 0, 8, 2), [x], a.slice.Tensor)


@pytest.mark.parametrize("pad", [[0, 1, 0, 1], [1, 2, 0, 1], [2, 2, 2, 2]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_zero_pad_is_folded_into_the_convolution(rng: np.random.Generator, dtype: Any, pad: list[int]) -> None:
    x, w = _randn(rng, 2, 4, 9, 8, dtype=dtype), _randn(rng, 6, 4, 3, 3, dtype=dtype)

    def fn(x: Any, w: Any) -> Any:
        return a.convolution(a.constant_pad_nd(x, pad, 0.0), w, None, [2, 2], [1, 0], [1, 1], False, [0, 0], 1)

    gm, conv = _converted(fn, [x, w])
    pad_node = next(n for n in gm.graph.nodes if n.target is a.constant_pad_nd.default)
    conv_node = next(n for n in gm.graph.nodes if n.target is a.convolution.default)
    # read by the convolution alone, the pad is part of it (its region replaces both)
    assert pad_node.name in conv.converted and pad_node.name not in conv.refused, conv.refused
    assert conv.members[conv_node.name] == [conv_node.name, pad_node.name]
    assert (pad_node.name, None) not in conv.inputs.values()  # the convolution reads the pad's input, not it
    _check(fn, [x, w], a.convolution.default)

    def also_read(x: Any, w: Any) -> Any:  # the pad read elsewhere too (as the backward's saved input)
        p = a.constant_pad_nd(x, pad, 0.0)
        return a.convolution(p, w, None, [2, 2], [1, 0], [1, 1], False, [0, 0], 1) + p.sum()

    gm, conv = _converted(also_read, [x, w])
    pad_node = next(n for n in gm.graph.nodes if n.target is a.constant_pad_nd.default)
    conv_node = next(n for n in gm.graph.nodes if n.target is a.convolution.default)
    assert pad_node.name in conv.refused and "folded" in conv.refused[pad_node.name]
    assert conv_node.name in conv.converted and conv_node.name not in conv.members


def test_pads_that_add_elements_elsewhere_are_refused(rng: np.random.Generator) -> None:
    x, w = _randn(rng, 2, 4, 9, 8), _randn(rng, 6, 4, 3, 3)
    for fn in (lambda x, w: a.constant_pad_nd(x, [1, 1], 0.0) * 2,  # no convolution reads it
               lambda x, w: F.conv2d(a.constant_pad_nd(x, [1, 1], 0.5), w),  # not zero
               lambda x, w: F.conv2d(a.constant_pad_nd(x, [0, 0, 0, 0, 1, 0], 0.0)[:, 1:], w)):  # channels
        gm, conv = _converted(fn, [x, w])
        pad = next(n for n in gm.graph.nodes if n.target is a.constant_pad_nd.default)
        assert pad.name in conv.refused and "adds elements" in conv.refused[pad.name]
        for n in gm.graph.nodes:  # whatever reads the pad reads it as it is: a graph input
            if n.target is a.convolution.default and n.name in conv.converted:
                assert (pad.name, None) in conv.inputs.values() or pad not in n.all_input_nodes


class SameConv(nn.Module):
    """TF-style "same" padding before a strided convolution (as EfficientNet and MobileNetV2
    are built in ``transformers``), batch norm and ReLU6 after, then a crop by slicing."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(4, 6, 1)  # so a gradient flows into the pad, and its crop runs
        self.conv = nn.Conv2d(6, 8, 3, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: Any) -> Any:
        y = F.relu6(self.bn(self.conv(F.pad(self.expand(x), (0, 1, 0, 1)))))
        return y[:, :, 1:, ::2]


def test_a_same_padded_block_trains_as_eager_with_the_pad_folded(rng: np.random.Generator) -> None:
    torch.manual_seed(int(rng.integers(1 << 31)))
    x = _randn(rng, 2, 4, 10, 10)
    target = torch.zeros(2, 8, 4, 3)
    options = {"floor": False, "rest": "eager"}
    # the forward's strided convolution reads the pad's input (the pad itself stays outside,
    # refused); the backward's crop of the padded input's gradient is converted, a slice, which
    # the report counts as data movement, not a compute node
    rows = [r for r in explain(SameConv(), x, options=options).rows if r.op == "aten.constant_pad_nd"]
    assert len(rows) == 2, rows
    assert "adds elements" in rows[0].why and "data movement only" in rows[1].why, [r.why for r in rows]
    _one_step_like_eager(SameConv(), x, target, options, {"aten.convolution", "aten.convolution_backward"})


def test_same_padded_inference_runs_the_pad_inside_the_convolutions_region(rng: np.random.Generator) -> None:
    """Under ``no_grad`` nothing saves the padded input, so the pad is part of the convolution
    (claimed with it) and the outputs equal eager's."""
    from functools import partial

    from fusegraph.torch.compile_backend import fusegraph_backend

    torch.manual_seed(int(rng.integers(1 << 31)))
    model = SameConv().eval()
    x = _randn(rng, 2, 4, 10, 10)
    options = {"floor": False, "rest": "eager"}
    with torch.no_grad():
        rows = explain(model, x, options=options).rows
        assert [r.fusegraph for r in rows if r.op == "aten.constant_pad_nd"] == [True], rows
        torch._dynamo.reset()
        got = torch.compile(model, backend=partial(fusegraph_backend, options=options))(x)
        want = model(x)
    assert _rel(got, want) <= 1e-6

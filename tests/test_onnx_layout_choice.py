"""The ONNX door's activation layout inside partitions (``channels_last=auto``): NHWC where
convolutions or pooling are, except float32 sessions on a GPU, where cuDNN's float32
convolutions are NCHW kernels (H200 measurements in SessionPlan._channels_last's docstring).
The rule is decided from the plan's options and handle alone, so it is checked here without
a GPU; the GPU benchmarks measure its effect."""

from __future__ import annotations

from types import SimpleNamespace

import onnx.helper as oh
import pytest

from fusegraph.onnx.options import ProviderOptions
from fusegraph.onnx.plan import SessionPlan
from fusegraph.runtime.handle import Handle

CONV = oh.make_node("Conv", ["x", "w"], ["y"], name="conv")
RELU = oh.make_node("Relu", ["y"], ["z"], name="relu")


def _layout(device: str, **opts: str) -> dict[str, bool]:
    plan = SimpleNamespace(opts=ProviderOptions.parse(opts), handle=Handle(device))
    return {n.name: SessionPlan._channels_last(plan, [n]) for n in (CONV, RELU)}  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "opts", "conv_nhwc"), [
    ("cpu", {}, True),
    ("cuda:0", {}, False),  # float32 on a GPU: NCHW
    ("cuda:0", {"precision": "fp16"}, True),
    ("cuda:0", {"precision": "bf16"}, True),
    ("cuda:0", {"precision": "tf32"}, True),
    ("cuda:0", {"channels_last": "on"}, True),
    ("cpu", {"channels_last": "off"}, False),
])
def test_auto_layout_follows_device_and_precision(device: str, opts: dict[str, str], conv_nhwc: bool) -> None:
    got = _layout(device, **opts)
    assert got["conv"] is conv_nhwc
    assert got["relu"] is (opts.get("channels_last") == "on")  # no spatial op: NHWC only when forced

"""fusegraph.torch's autograd functions: forward and backward are fusegraph graphs. Their
gradients are checked against finite differences (torch.autograd.gradcheck, float64), their
values and gradients against PyTorch's own functions (float32, fresh random data), plans
are built once per signature, and a plan handed a tensor that wants gradients says where
to go instead of returning it detached."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="fusegraph.torch is the PyTorch front door")

import torch.nn.functional as F  # noqa: E402

import fusegraph as fg  # noqa: E402
from fusegraph.errors import VariantPackError  # noqa: E402
from fusegraph.torch import functions as fgf  # noqa: E402
from fusegraph.torch.plans import PLANS  # noqa: E402


def _rand(*shape: int, dtype: Any = torch.float64, grad: bool = True) -> Any:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _rel(a: Any, b: Any) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


_TORCH_ACT: dict[str, Callable[[Any], Any]] = {
    "none": lambda z: z, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu,
}


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
def test_conv_bias_act_gradients_match_finite_differences(act: str) -> None:
    x, w, b = _rand(2, 3, 5, 5), _rand(4, 3, 3, 3), _rand(4)
    assert torch.autograd.gradcheck(lambda x, w, b: fgf.conv_bias_act(x, w, b, 1, 1, 1, act), (x, w, b))


def test_strided_grouped_channels_last_conv_gradients() -> None:
    x = _rand(2, 4, 7, 7).detach().to(memory_format=torch.channels_last).requires_grad_()
    w, b = _rand(6, 2, 3, 3), _rand(6)  # groups = 4 / 2
    assert torch.autograd.gradcheck(lambda x, w, b: fgf.conv_bias_act(x, w, b, 2, 1, 1, "tanh"), (x, w, b))


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "sigmoid"])
def test_conv_and_linear_match_pytorch_in_float32(act: str) -> None:
    x, w, b = _rand(2, 3, 9, 9, dtype=torch.float32), _rand(5, 3, 3, 3, dtype=torch.float32), _rand(5, dtype=torch.float32)
    got = fgf.conv_bias_act(x, w, b, 1, 1, 1, act)
    want_x, want_w, want_b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    want = _TORCH_ACT[act](F.conv2d(want_x, want_w, want_b, 1, 1))
    assert _rel(got, want) < 1e-5
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    for a, e in ((x, want_x), (w, want_w), (b, want_b)):
        assert _rel(a.grad, e.grad) < 1e-4
    xl, wl, bl = _rand(3, 4, 16, dtype=torch.float32), _rand(8, 16, dtype=torch.float32), _rand(8, dtype=torch.float32)
    assert _rel(fgf.linear_bias_act(xl, wl, bl, act), _TORCH_ACT[act](F.linear(xl, wl, bl))) < 1e-5


def test_linear_gradients_match_finite_differences() -> None:
    x, w, b = _rand(2, 3, 6), _rand(4, 6), _rand(4)
    assert torch.autograd.gradcheck(lambda x, w, b: fgf.linear_bias_act(x, w, b, "gelu"), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: fgf.linear_bias_act(x, w, None, "relu"), (x, w))


def test_norm_gradients_and_values() -> None:
    x, g, b = _rand(2, 3, 8), _rand(8), _rand(8)
    assert torch.autograd.gradcheck(lambda x, g, b: fgf.layer_norm(x, [8], g, b), (x, g, b))
    assert torch.autograd.gradcheck(lambda x, g: fgf.rms_norm(x, [8], g, 1e-6), (x, g))
    xf, gf, bf = (t.detach().float() for t in (x, g, b))
    assert _rel(fgf.layer_norm(xf, [8], gf, bf), F.layer_norm(xf, [8], gf, bf)) < 1e-5
    assert _rel(fgf.rms_norm(xf, [8], gf, 1e-6), F.rms_norm(xf, [8], gf, 1e-6)) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_including_grouped_query(causal: bool) -> None:
    q, k, v = _rand(1, 4, 5, 3), _rand(1, 2, 5, 3), _rand(1, 2, 5, 3)  # 2 key/value heads for 4 query heads
    assert torch.autograd.gradcheck(
        lambda q, k, v: fgf.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v)
    )
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
    assert _rel(fgf.scaled_dot_product_attention(qf, kf, vf, is_causal=causal), want) < 1e-5


def test_a_second_step_builds_no_plan() -> None:
    x, w, b = _rand(2, 3, 6, 6, dtype=torch.float32), _rand(4, 3, 3, 3, dtype=torch.float32), _rand(4, dtype=torch.float32)

    def step() -> None:
        fgf.conv_bias_act(x, w, b, 1, 1, 1, "relu").square().sum().backward()

    step()
    built = PLANS.builds
    step()
    step()
    assert PLANS.builds == built


def test_bf16_autocast_and_no_grad_inference() -> None:
    x, w, b = _rand(2, 3, 8, 8, dtype=torch.float32), _rand(4, 3, 3, 3, dtype=torch.float32), _rand(4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fgf.conv_bias_act(x, w, b, 1, 1, 1, "relu")
        want = F.relu(F.conv2d(x, w, b, 1, 1))
    assert got.dtype == want.dtype == torch.bfloat16
    assert _rel(got, want) < 2e-2
    got.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    with torch.no_grad():
        y = fgf.linear_bias_act(x.reshape(2, -1), torch.randn(5, 192), None, "gelu")
    assert not y.requires_grad and y.shape == (2, 5)


def test_a_plan_given_a_tensor_that_wants_gradients_says_where_to_go() -> None:
    g = fg.Graph("relu", io_data_type=fg.DataType.FLOAT)
    g.relu(g.tensor("x", [2, 3])).set_output(True).set_name("y")
    plan = g.build(engine="torch")
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(VariantPackError, match=r"requires_grad=True.*fusegraph\.torch"):
        plan.execute({"x": x})
    with torch.no_grad():  # nothing to record: runs
        assert torch.equal(plan.execute({"x": x})["y"], torch.relu(x.detach()))
    assert torch.equal(plan.execute({"x": x.detach()})["y"], torch.relu(x.detach()))


def test_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="activation"):
        fgf.conv_bias_act(torch.randn(1, 1, 3, 3), torch.randn(1, 1, 1, 1), act="mish")

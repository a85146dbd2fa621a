"""The PyTorch front door on an NVIDIA GPU (run on the GPU machine: pytest -m gpu): the
autograd functions' gradients (float64 gradcheck on CUDA; selection picks the engine), the
backend on a conv net (channels-last, bf16 autocast) and a transformer block against eager,
mode="reduce-overhead", dynamic batch, and the typed refusal of a CUDA plan given a tensor
that wants gradients. Speed is measured by benchmarks/bench_torch.py, never asserted here."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch front door needs torch")

import torch.nn.functional as F  # noqa: E402

from fusegraph.torch import functions as fgf  # noqa: E402
from fusegraph.torch.compile_backend import fusegraph_backend  # noqa: E402
from fusegraph.torch.explainer import explain  # noqa: E402

pytestmark = pytest.mark.gpu

CLAIM_ALL = {"floor": False}


def _rel(a: Any, b: Any) -> float:
    assert not torch.isnan(a).any()
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


def _models() -> dict[str, Any]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_torch_compile import Block, ConvNet

    return {"conv": ConvNet, "block": Block}


@pytest.fixture
def cuda() -> Any:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")


def test_autograd_functions_gradcheck_on_cuda(cuda: Any) -> None:
    d = dict(dtype=torch.float64, device=cuda, requires_grad=True)
    x, w, b = torch.randn(2, 3, 6, 6, **d), torch.randn(4, 3, 3, 3, **d), torch.randn(4, **d)
    assert torch.autograd.gradcheck(lambda x, w, b: fgf.conv_bias_act(x, w, b, 1, 1, 1, "relu"), (x, w, b))
    xl, wl, bl = torch.randn(5, 7, **d), torch.randn(3, 7, **d), torch.randn(3, **d)
    assert torch.autograd.gradcheck(lambda x, w, b: fgf.linear_bias_act(x, w, b, "gelu"), (xl, wl, bl))
    xn, g = torch.randn(4, 16, **d), torch.randn(16, **d)
    assert torch.autograd.gradcheck(lambda x, g: fgf.rms_norm(x, [16], g, 1e-6), (xn, g))
    q, k, v = (torch.randn(1, 2, 8, 4, **d) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: fgf.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functions_match_pytorch_on_cuda(cuda: Any, dtype: Any) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    x = torch.randn(8, 16, 32, 32, device=cuda, dtype=dtype).to(memory_format=torch.channels_last)
    w = torch.randn(32, 16, 3, 3, device=cuda, dtype=dtype).to(memory_format=torch.channels_last)
    b = torch.randn(32, device=cuda, dtype=dtype)
    assert _rel(fgf.conv_bias_act(x, w, b, 1, 1, 1, "relu"), F.relu(F.conv2d(x, w, b, 1, 1))) < tol
    q, k, v = (torch.randn(2, 8, 256, 64, device=cuda, dtype=dtype) for _ in range(3))
    assert _rel(fgf.scaled_dot_product_attention(q, k, v, is_causal=True),
                F.scaled_dot_product_attention(q, k, v, is_causal=True)) < tol
    xn, g = torch.randn(64, 1024, device=cuda, dtype=dtype), torch.randn(1024, device=cuda, dtype=dtype)
    assert _rel(fgf.rms_norm(xn, [1024], g, 1e-6), F.rms_norm(xn, [1024], g, 1e-6)) < tol


@pytest.mark.parametrize("name", ["conv", "block"])
def test_backend_matches_eager_on_cuda(cuda: Any, name: str) -> None:
    make = _models()[name]
    eager = make().to(cuda)
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options=CLAIM_ALL))
    x = torch.randn((4, 3, 8, 8) if name == "conv" else (2, 16, 32), device=cuda)
    want, got = eager(x), compiled(x)
    assert _rel(got, want) < 1e-4
    want.square().sum().backward()
    got.square().sum().backward()
    for (pname, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        assert _rel(q.grad, p.grad) < 1e-3, pname


def test_bf16_channels_last_training_step_and_report(cuda: Any) -> None:
    make = _models()["conv"]
    eager = make().to(cuda).to(memory_format=torch.channels_last)
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, options=CLAIM_ALL))
    x = torch.randn(8, 3, 8, 8, device=cuda).to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = eager(x), compiled(x)
    assert _rel(got.float(), want.float()) < 3e-2
    got.float().sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    report = explain(make().to(cuda), x)
    assert report.coverage > 0.5, report.summary()


def test_reduce_overhead_and_dynamic_batch(cuda: Any) -> None:
    make = _models()["block"]
    eager = make().to(cuda)
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=partial(fusegraph_backend, mode="reduce-overhead", options=CLAIM_ALL))
    with torch.no_grad():
        for _ in range(3):  # cudagraph trees record, then replay
            x = torch.randn(2, 16, 32, device=cuda)
            assert _rel(compiled(x), eager(x)) < 1e-4
    torch._dynamo.reset()
    dyn = torch.compile(copy.deepcopy(eager), backend=partial(fusegraph_backend, options=CLAIM_ALL))
    for batch in (2, 3, 5):
        x = torch.randn(batch, 16, 32, device=cuda)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            assert _rel(dyn(x), eager(x)) < 1e-4


def test_a_cuda_plan_refuses_a_tensor_that_wants_gradients(cuda: Any) -> None:
    import fusegraph as fg
    from fusegraph.errors import VariantPackError

    g = fg.Graph("relu", io_data_type=fg.DataType.FLOAT)
    g.relu(g.tensor("x", [64, 64])).set_output(True).set_name("y")
    plan = g.build(handle=fg.Handle("cuda:0"))
    with pytest.raises(VariantPackError, match="requires_grad=True"):
        plan.execute({"x": torch.randn(64, 64, device=cuda, requires_grad=True)})


def _compiled_bf16_rows(fn: Any, *args: Any) -> list[Any]:
    """``fn`` compiled by the backend as users get it (floor on), run once under no_grad on
    bfloat16 ``args``: its answer checked against ``fn`` in float32, its report rows returned."""
    from fusegraph.torch.compile_backend import collecting

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusegraph_backend)
    with torch.no_grad(), collecting() as rows:
        got = compiled(*args)
    assert _rel(got.float(), fn(*(a.float() for a in args))) < 2e-2
    return rows


def test_floor_measures_kernel_engine_regions_on_device_time(cuda: Any) -> None:
    """With the floor and the whole-graph check on, a GPU region is built on a kernel engine
    (never the torch engine: that is the incumbent's own code behind one more call) and
    timed on device time, which its report row says; the answer matches PyTorch's."""
    def fn(x: Any, w: Any, b: Any) -> Any:
        return F.gelu(F.linear(x, w, b))

    # bfloat16: cuDNN's float32 matmuls round to TF32, so float32 ones stay with cuBLAS
    bf16 = torch.bfloat16
    x, w, b = (torch.randn(4096, 768, device=cuda, dtype=bf16), torch.randn(3072, 768, device=cuda, dtype=bf16) / 30,
               torch.randn(3072, device=cuda, dtype=bf16))
    rows = _compiled_bf16_rows(fn, x, w, b)
    timed = [r for r in rows if r.region is not None and ("the incumbent" in r.why or "screened:" in r.why)]
    assert timed, [(r.node, r.where, r.why) for r in rows]
    assert all("device time" in r.why for r in timed), [r.why for r in timed]
    engines = {r.where.split(":", 1)[1].split("[")[0] for r in rows if r.fusegraph}
    assert engines <= {"cudnn", "triton"}, engines


def test_a_3d_layer_norm_region_reaches_a_kernel_engine_through_folded_views(cuda: Any) -> None:
    """A [B, S, F] layer norm converts with reshapes (rows in, weight [1, F], the result
    back to [B, S, F]) that neither kernel engine takes: folded into views, the region is
    built and measured instead of refused, and its answer is PyTorch's where it is kept."""
    def fn(x: Any, w: Any, b: Any) -> Any:
        return F.layer_norm(x, (768,), w, b) * 2.0

    bf16 = torch.bfloat16
    x, w, b = (torch.randn(8, 512, 768, device=cuda, dtype=bf16), torch.randn(768, device=cuda, dtype=bf16),
               torch.randn(768, device=cuda, dtype=bf16))
    rows = _compiled_bf16_rows(fn, x, w, b)
    norm = [r for r in rows if r.op == "aten.native_layer_norm"]
    assert norm and all("refused" not in r.why for r in norm), [r.why for r in norm]
    assert all("device time" in r.why for r in norm), [r.why for r in norm]

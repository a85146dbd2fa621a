"""Inductor's own compile in CUDA graphs as a step-check candidate (fusegraph/torch/cuda_graphs.py).

On the CPU: ``Owned`` on a stand-in for a CUDA graph's pool (a function whose output and
whose backward's gradient are the same buffers every call, overwritten, as a replay
overwrites the pool): without it a kept output and an accumulated gradient come out
wrong, with it they match eager. On the GPU: Inductor's real CUDA graphs under the loop
styles that broke ``mode="reduce-overhead"`` in a probe (``zero_grad(set_to_none=False)``,
gradient accumulation, ``.grad`` read after another forward, outputs kept across steps),
the device-share measure, and the backend choosing the candidate on a host-bound step."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch.compile backend needs torch")

from fusegraph.torch import cuda_graphs  # noqa: E402

nn = torch.nn


class _Pool:
    """A graph "replayed" into fixed buffers: y = tanh(x @ w), its output and the gradient of
    ``w`` written into the same two tensors at every call, as a CUDA graph's pool is."""

    def __init__(self, rows: int, d: int) -> None:
        self.out = torch.empty(rows, d)
        self.grad_w = torch.empty(d, d)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        pool = self

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
                ctx.save_for_backward(x, w)
                pool.out.copy_(torch.tanh(x @ w))
                return pool.out

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
                x, w = ctx.saved_tensors
                pool.grad_w.copy_(x.t() @ (g * (1 - torch.tanh(x @ w) ** 2)))
                return None, pool.grad_w

        return [Replay.apply(x, w)]


def _eager(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return [torch.tanh(x @ w)]


def _accumulate(fn: Any, w: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gradient accumulation over ``xs``, every output kept: w.grad and the kept outputs."""
    w.grad = None
    kept = []
    for x in xs:
        y = fn(x, w)[0]
        kept.append(y)
        y.sum().backward()
    return w.grad.clone(), [k.detach().clone() for k in kept]


@pytest.mark.parametrize("seed", [0, 1])
def test_owned_results_survive_the_pools_next_replay(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    w0 = torch.randn(4, 4, generator=g, dtype=torch.float64)
    want_grad, want_out = _accumulate(_eager, w0.clone().requires_grad_(), xs)

    pool = _Pool(5, 4)
    pool.out, pool.grad_w = pool.out.double(), pool.grad_w.double()
    bare_grad, bare_out = _accumulate(pool, w0.clone().requires_grad_(), xs)
    # the stand-in is faithful: its bare outputs and gradients are overwritten
    assert not torch.allclose(bare_out[0], want_out[0]) or not torch.allclose(bare_grad, want_grad)

    got_grad, got_out = _accumulate(cuda_graphs.owned(pool), w0.clone().requires_grad_(), xs)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_out, want_out, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_owned_keeps_inputs_updated_in_place_and_passes_non_tensors() -> None:
    """A graph that updates an input in place (batch norm's running statistics) updates the
    caller's tensor; an output that needs no gradient comes back without one."""
    stats = torch.zeros(3)

    def fn(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> list[Any]:
        s.add_(x.mean(0))
        return [x * w, (x > 0).sum(), None]

    x, w = torch.randn(4, 3), torch.randn(3, requires_grad=True)
    y, count, none = cuda_graphs.owned(fn)(x, w, stats)
    torch.testing.assert_close(stats, x.mean(0))
    assert y.requires_grad and not count.requires_grad and none is None
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0))
    with torch.no_grad():
        y2 = cuda_graphs.owned(fn)(x, w, stats)[0]
    assert not y2.requires_grad


def test_the_option_is_checked() -> None:
    from fusegraph.errors import OptionError
    from fusegraph.torch.partition import Options

    assert Options.of({"cuda_graphs": False}).cuda_graphs is False
    with pytest.raises(OptionError, match="cuda_graphs is True or False"):
        Options.of({"cuda_graphs": "yes"})


def test_a_gpu_graphs_verdict_is_keyed_by_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step timed whole includes the host's launches, so a verdict stored on one host
    (CUDA graphs, eager, Inductor's own) is not read on another (a fake CUDA input: no GPU
    is needed to compute the key)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusegraph.select import device_id
    from fusegraph.torch.dynamo_verdict import DynamoVerdict
    from fusegraph.torch.partition import Options

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, device="cuda")

    def key(host: str, device_input: Any) -> str:
        monkeypatch.setattr(device_id, "cpu_model", lambda: host)
        return str(DynamoVerdict.of(gm, [device_input], Options(), None, True).key)

    assert key("host a", x) != key("host b", x)


@pytest.mark.parametrize(("share", "tried"), [(0.4, True), (0.95, False), (None, False)])
def test_the_check_tries_graphs_only_where_the_host_leaves_the_device_idle(
        share: float | None, tried: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The step check's choice with the candidate (step_floor._with_graphs) on forced step
    times: below SHARE it is compiled, timed with the rest and wins when fastest; at or over
    SHARE, or unmeasured, it is not compiled and the verdict says why."""
    from test_torch_step_floor import step_timer

    from fusegraph.torch import graph_floor, step_floor

    state = step_timer(monkeypatch, tmp_path)
    state.update(own_ms=10.0, eager_ms=12.0, graphed_ms=6.0)
    monkeypatch.setattr(cuda_graphs, "eligible", lambda inputs: "")
    monkeypatch.setattr(graph_floor, "room", lambda *a, **k: "")
    monkeypatch.setattr(cuda_graphs, "device_share", lambda step, wall_ms, device: share)

    def f(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tanh(x @ w)]

    gm = torch.fx.symbolic_trace(f)
    compiled: list[int] = []

    def graphed() -> Any:
        compiled.append(1)
        return f

    inputs = [torch.randn(4, 6), torch.randn(6, 6, requires_grad=True)]
    settled = step_floor.settle(gm, inputs, lambda: f, f, margin=0.03, warmup_s=0.0, graphed=graphed)
    assert settled.verdict is not None
    why = settled.verdict.why
    assert bool(compiled) is tried
    if tried:
        assert settled.side == step_floor.GRAPHED and step_floor.winner(settled.verdict) == step_floor.GRAPHED
        assert "40% of Inductor's own step, so Inductor's own compile in CUDA graphs was tried" in why, why
    else:
        assert settled.side == step_floor.OWN
        assert f"{cuda_graphs.NAME} not tried" in why, why
        assert ("95%" in why) if share is not None else ("could not be measured" in why), why


def test_not_eligible_off_the_gpu() -> None:
    assert cuda_graphs.eligible([torch.randn(2)]) == "not on a CUDA device"


# ---- on the GPU ------------------------------------------------------------------------------
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: run on the GPU machine with `pytest -m gpu`")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.l1, self.l2 = nn.Linear(8 * 16, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.c(x))).mean(dim=3).flatten(1)
        return self.l2(nn.functional.gelu(self.l1(y)))


def _loop(fn: Any, model: nn.Module, style: str, steps: int = 6) -> list[float]:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    out: list[float] = []
    held = []
    for _ in range(steps):
        xs = [torch.randn(4, 3, 16, 16, generator=g).cuda() for _ in range(2 if style == "accumulate" else 1)]
        t = torch.randint(0, 10, (4,), generator=g).cuda()
        opt.zero_grad(set_to_none=style != "set_to_none_false")
        for x in xs:
            y = fn(x)
            held.append(y.detach())
            loss = nn.functional.cross_entropy(y, t)
            loss.backward()
        opt.step()
        if style == "grad_after_next_forward":
            fn(xs[0])
            out.append(float(sum(p.grad.norm() for p in model.parameters())))
        out.append(float(loss))
    out.append(float(torch.stack([h.sum() for h in held]).sum()))  # every step's output, read at the end
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["plain", "set_to_none_false", "accumulate", "grad_after_next_forward"])
def test_graphed_keeps_the_default_modes_semantics(style: str) -> None:
    _cuda()
    torch.manual_seed(0)
    base = _Net().cuda()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = copy.deepcopy(base)
        want = _loop(model, model, style)
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        seen: list[Any] = []

        def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            seen.append(gm)
            # as the backend compiles the candidate (compile_backend.compile_inductors)
            import torch._functorch.config as functorch_config
            from torch._inductor.compile_fx import compile_fx

            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                return cuda_graphs.owned(compile_fx(gm, inputs, config_patches=cuda_graphs.PATCHES))

        got = _loop(torch.compile(model, backend=backend), model, style)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert seen
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_device_share_tells_a_host_bound_step_from_a_device_bound_one() -> None:
    _cuda()
    small = [torch.randn(64, device="cuda") for _ in range(4)]
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def many() -> None:  # 600 tiny kernels, host work between them: the device mostly waits
        for _ in range(150):
            for t in small:
                t.mul_(1.0)
                sum(range(100))

    def one() -> None:
        big @ big

    for step in (many, one):
        step()
    torch.cuda.synchronize()

    def wall(step: Any) -> float:
        import time

        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[2]

    low = cuda_graphs.device_share(many, wall(many), torch.device("cuda"))
    high = cuda_graphs.device_share(one, wall(one), torch.device("cuda"))
    assert low is not None and high is not None
    # the one is tried in CUDA graphs, the other not (on an H200 without the host work
    # between launches the tiny kernels' step measured 0.72, the matmul's 0.97)
    assert low < min(0.5, cuda_graphs.SHARE) and high >= cuda_graphs.SHARE, (low, high)


@pytest.mark.gpu
def test_the_backend_runs_a_host_bound_step_in_cuda_graphs_and_tracks_eager(tmp_path: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep, narrow MLP at batch 8 (hundreds of tiny kernels a step): the check finds the
    device idle most of Inductor's step and the graphed side faster; the report says so and
    float32 losses track eager's."""
    _cuda()
    from fusegraph.torch.compile_backend import collecting

    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    layers = [m for _ in range(24) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())]
    base = nn.Sequential(*layers).cuda()
    x = torch.randn(8, 64, device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        losses = {}
        for name in ("eager", "fusegraph"):
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            fn = model if name == "eager" else torch.compile(model, backend="fusegraph", options={"loop_steps": 0})
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            got = []
            with collecting() as rows:
                for _ in range(5):
                    opt.zero_grad(set_to_none=False)
                    loss = fn(x).square().mean()
                    loss.backward()
                    opt.step()
                    got.append(float(loss))
            losses[name] = got
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    why = " ".join(r.why for r in rows)
    assert "was tried" in why, why
    assert cuda_graphs.NAME in why
    torch.testing.assert_close(torch.tensor(losses["fusegraph"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-6)

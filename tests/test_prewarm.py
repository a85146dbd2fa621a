"""The GPU library warm-up thread (engines/torch/prewarm.py): once per device, nothing
changed that a session could see."""

from __future__ import annotations

import pytest

import fusegraph as fg
from fusegraph.engines.torch import prewarm


def test_a_cpu_handle_starts_nothing() -> None:
    assert prewarm.start(fg.Handle("cpu")) is None


@pytest.mark.gpu
def test_the_warm_up_runs_once_per_device_and_draws_no_random_numbers() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    handle = fg.Handle("cuda:0")
    cpu_state, gpu_state = torch.get_rng_state(), torch.cuda.get_rng_state(0)
    prewarm._STARTED.discard(str(handle.device))  # this process may have warmed it already
    thread = prewarm.start(handle)
    assert thread is not None
    assert prewarm.start(handle) is None  # the second session of the process: already loading
    thread.join(60)
    assert not thread.is_alive()
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(0), gpu_state)
    # the libraries it loaded serve this thread: a matmul and a convolution agree with the CPU
    a = torch.randn(64, 48, dtype=torch.float64)
    b = torch.randn(48, 32, dtype=torch.float64)
    got = torch.mm(a.cuda(), b.cuda()).cpu()
    assert torch.allclose(got, a @ b, rtol=1e-12, atol=1e-12)
    x, w = torch.randn(2, 3, 9, 9, dtype=torch.float64), torch.randn(5, 3, 3, 3, dtype=torch.float64)
    conv = torch.nn.functional.conv2d(x.cuda(), w.cuda()).cpu()
    assert torch.allclose(conv, torch.nn.functional.conv2d(x, w), rtol=1e-10, atol=1e-10)

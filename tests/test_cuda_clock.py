"""The device clock (fusegraph/select/cuda_clock.py) on an NVIDIA GPU: a call that is mostly
host work around a tiny kernel must time as its kernel, and a spin kernel as its length,
while the host clock ranks the two the other way round. (The method itself is tested on a
virtual clock in test_timing.py; this checks the CUDA side of it.)"""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the device clock is torch's CUDA events")

from fusegraph.select import cuda_clock  # noqa: E402
from fusegraph.select.timing import fastest, time_candidates  # noqa: E402

pytestmark = pytest.mark.gpu


def test_device_clock_times_kernels_not_host_work() -> None:
    dev = torch.device("cuda")
    x = torch.randn(4096, device=dev)
    per_ms = cuda_clock._calibrate(torch.cuda.current_device())

    def host_heavy() -> Any:  # ~0.3 ms of host work around a ~2 us kernel
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3e-4:
            pass
        return x.add_(1.0)

    def device_heavy() -> Any:  # a ~0.1 ms kernel behind almost no host work
        torch.cuda._sleep(int(per_ms * 0.1))

    cands = {"host": host_heavy, "device": device_heavy}
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    on_host = time_candidates(cands, sync=sync, warmup_s=0.2, min_rounds=5)
    assert fastest(on_host) == "device", {k: v.median_ms for k, v in on_host.items()}
    got = time_candidates(cands, sync=sync, warmup_s=0.2, min_rounds=5, device_clock=cuda_clock.CudaClock(dev))
    assert fastest(got) == "host", {k: v.median_ms for k, v in got.items()}
    # the spin measures near its calibrated length; the host-heavy call near its kernel
    assert 0.05 < got["device"].median_ms < 0.2, got["device"]
    assert got["host"].median_ms < 0.5 * got["device"].median_ms, got["host"]

"""The capture guard every GPU plan's CUDA-graph capture runs under (engines/cuda_capture.py),
on the CPU: the cycle collector is paused for the capture and restored after, and the census
collects dropped plans when the captured graphs alive have doubled. GPU tests exercise the
captures themselves (test_torch_engine_gpu.py, test_cudnn_engine.py)."""

from __future__ import annotations

import gc

import pytest

from fusegraph.engines.cuda_capture import CaptureCensus, capturing


class _Plan:
    """Stands for a plan: in a reference cycle with its graph, as real plans are."""

    def __init__(self) -> None:
        self.graph = {"plan": self}


def test_capturing_pauses_the_collector_and_restores_it() -> None:
    assert gc.isenabled()
    with capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), capturing():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with capturing():
            pass
        assert not gc.isenabled()  # a caller's own setting is kept
    finally:
        gc.enable()


def test_census_collects_dropped_plans_once_the_living_double() -> None:
    census = CaptureCensus(first=4)
    gc.disable()
    try:
        plans = [_Plan() for _ in range(4)]
        for p in plans:
            census.track(p)
        assert census.alive == 4
        del plans, p  # garbage in cycles: only the collector frees them
        assert census.alive == 4
        census.before_capture()  # 4 >= 4: collected
        assert (census.alive, census.collections) == (0, 1)
        census.before_capture()  # nothing alive: no collection
        assert census.collections == 1
        kept = [_Plan() for _ in range(4)]
        for p in kept:
            census.track(p)
        census.before_capture()  # 4 alive and in use: collected, nothing freed, threshold 8
        assert (census.alive, census.collections) == (4, 2)
        extra = [_Plan() for _ in range(3)]
        for p in extra:
            census.track(p)
        census.before_capture()  # 7 < 8: the living alone do not trigger another
        assert census.collections == 2
        del extra, p
        census.track(kept[0])  # 8 counted (3 of them dead): due
        census.before_capture()
        assert census.collections == 3 and census.alive == 5
    finally:
        gc.enable()

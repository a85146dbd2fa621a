"""The cuDNN plan's launch (engines/cudnn/plan.py's _RawLaunch) with fake cuDNN and torch
objects, so CI checks its rules without a GPU: the pointer slots, the stream set on the
shared handle only when it changes, a workspace per stream, CUDA-graph capture after
repeated pointers on the default stream only, and several threads launching at once.
The GPU tests (test_cudnn_engine.py) check the same against the float64 reference."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from engine_fakes import in_threads

from fusegraph.engines.cudnn.plan import HandleGate, _RawLaunch
from fusegraph.engines.launch_replay import LaunchReplay


class _Lowered:
    def __init__(self, order: list[int], slow: float = 0.0) -> None:
        self.order = order
        self.calls: list[tuple[list[int], int, int]] = []  # (pointers, workspace, stream)
        self.stream: int | None = None
        self.slow = slow
        self.capturing = False
        self.captured: list[list[int]] = []

    def _prepare_variant_pack_template(self) -> None:
        pass

    def _get_variant_pack_uids_sorted(self) -> list[int]:
        return self.order

    def _execute_with_raw_ptrs(self, addr: int, n: int, ws: int, backend: int, index: int) -> None:
        import ctypes

        ptrs = [int(p or 0) for p in (ctypes.c_void_p * n).from_address(addr)]
        if self.slow:
            time.sleep(self.slow)  # another thread would overwrite the array now, were it not locked
            ptrs2 = [int(p or 0) for p in (ctypes.c_void_p * n).from_address(addr)]
            assert ptrs2 == ptrs
        if self.capturing:
            self.captured.append(ptrs)
        else:
            self.calls.append((ptrs, ws, self.stream or 0))


class _Graph:
    def __init__(self, lowered: _Lowered) -> None:
        self._lowered_graph = lowered
        self._plans: list[Any] = []
        self._plan_index = 0


class _Handle:
    backend_handle = 1234


class _Cudnn:
    def __init__(self, lowered: _Lowered) -> None:
        self.lowered = lowered
        self.set_calls = 0

    def set_stream(self, handle: Any, stream: int) -> None:
        self.set_calls += 1
        self.lowered.stream = stream


class _Tensor:
    _next = 0x10000

    def __init__(self, n: int) -> None:
        _Tensor._next += 0x1000
        self.ptr = _Tensor._next

    def data_ptr(self) -> int:
        return self.ptr


class _CUDAGraph:
    def __init__(self, lowered: _Lowered, fail: bool) -> None:
        self.lowered, self.fail, self.replays = lowered, fail, 0

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        assert capture_error_mode == "thread_local"
        self.lowered.capturing = True

    def capture_end(self) -> None:
        self.lowered.capturing = False
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self) -> None:
        self.replays += 1
        self.lowered.calls.append((self.lowered.captured[-1], -1, -1))


class _Torch:
    uint8 = "uint8"

    def __init__(self, lowered: _Lowered, fail_capture: bool = False) -> None:
        self.allocs = 0
        torch = self

        class _Stream:
            cuda_stream = 77

            def __init__(self, device: Any) -> None:
                pass

        class _Cuda:
            Stream = _Stream

            @staticmethod
            def CUDAGraph() -> _CUDAGraph:
                return _CUDAGraph(lowered, fail_capture)

            @staticmethod
            @contextlib.contextmanager
            def stream(s: Any) -> Iterator[None]:
                yield

        self.cuda = _Cuda

        def empty(n: int, dtype: Any, device: Any) -> _Tensor:
            torch.allocs += 1
            return _Tensor(n)

        self.empty = empty


def _launch(graphs: bool = True, ws_size: int = 256, slow: float = 0.0, fail_capture: bool = False) -> tuple[_RawLaunch, _Lowered, _Cudnn, _Torch]:
    lowered = _Lowered([3, 5, 9, 11], slow=slow)
    cudnn, torch = _Cudnn(lowered), _Torch(lowered, fail_capture)

    class _Binding:
        uids: ClassVar[dict[str, int]] = {"x": 5, "w": 3, "y": 11}

    scalar = _Tensor(1)
    raw = _RawLaunch.make(cudnn, torch, _Graph(lowered), _Handle(), HandleGate(), _Binding(), {9: scalar},  # type: ignore[arg-type]
                          ws_size, 0xAAAA, "cuda:0", graphs)
    assert raw is not None
    assert raw.template == [0, 0, scalar.ptr, 0]
    assert raw.slot == {"w": 0, "x": 1, "y": 3}
    return raw, lowered, cudnn, torch


def _ptrs(raw: _RawLaunch, x: int, w: int, y: int) -> list[int]:
    p = raw.template.copy()
    p[raw.slot["x"]], p[raw.slot["w"]], p[raw.slot["y"]] = x, w, y
    return p


def test_operands_fusegraph_does_not_know_leave_the_launch_to_execute() -> None:
    lowered = _Lowered([3, 5, 9, 11, 13])

    class _Binding:
        uids: ClassVar[dict[str, int]] = {"x": 5, "w": 3, "y": 11}

    assert _RawLaunch.make(_Cudnn(lowered), _Torch(lowered), _Graph(lowered), _Handle(), HandleGate(), _Binding(),  # type: ignore[arg-type]
                           {9: _Tensor(1)}, 0, 0, "cuda:0", True) is None


def test_stream_set_only_when_it_changes_and_workspace_per_stream() -> None:
    raw, lowered, cudnn, torch = _launch(graphs=False)
    p = _ptrs(raw, 1, 2, 3)
    raw.run(p, 5)  # the first stream: the plan's own workspace
    raw.run(p, 5)
    assert cudnn.set_calls == 1 and torch.allocs == 0
    raw.run(p, 6)  # another stream: a workspace for the call from torch's allocator
    assert cudnn.set_calls == 2 and torch.allocs == 1
    assert [c[1] for c in lowered.calls][:2] == [0xAAAA, 0xAAAA] and lowered.calls[2][1] != 0xAAAA
    assert [c[2] for c in lowered.calls] == [5, 5, 6]
    assert all(c[0] == p for c in lowered.calls)


def test_no_workspace_no_allocation_on_another_stream() -> None:
    raw, lowered, _, torch = _launch(graphs=False, ws_size=0)
    raw.run(_ptrs(raw, 1, 2, 3), 5)
    raw.run(_ptrs(raw, 1, 2, 3), 6)
    assert torch.allocs == 0 and lowered.calls[1][1] == 0


def test_graph_captured_after_repeats_on_the_default_stream_then_replayed() -> None:
    raw, lowered, _, _ = _launch()
    p = _ptrs(raw, 1, 2, 3)
    for _ in range(LaunchReplay.REPEATS):
        raw.run(p, 0)
    assert len(raw.replays.graphs) == 1 and lowered.captured == [p]
    assert raw.replays.describe() == {"cuda_graph": "auto", "cuda_graphs_captured": 1}
    assert len(lowered.calls) == LaunchReplay.REPEATS  # the capture launched nothing
    raw.run(p, 0)
    assert lowered.calls[-1][1:] == (-1, -1)  # replayed
    q = _ptrs(raw, 1, 2, 4)  # another output address: launched, not replayed
    raw.run(q, 0)
    assert lowered.calls[-1] == (q, 0xAAAA, 0)


def test_no_graph_off_the_default_stream_or_when_off_or_alternating() -> None:
    raw, lowered, _, _ = _launch()
    p = _ptrs(raw, 1, 2, 3)
    for _ in range(6):
        raw.run(p, 5)  # a side stream (the plan's first): launched each time
    assert not raw.replays.graphs and not lowered.captured
    raw, lowered, _, _ = _launch(graphs=False)
    for _ in range(6):
        raw.run(p, 0)
    assert not raw.replays.graphs
    raw, lowered, _, _ = _launch()
    q = _ptrs(raw, 1, 2, 4)
    for i in range(8):  # alternating pointers never repeat three calls running
        raw.run(p if i % 2 else q, 0)
    assert not raw.replays.graphs


def test_failed_capture_turns_graphs_off_and_launches_go_on() -> None:
    raw, lowered, _, _ = _launch(fail_capture=True)
    p = _ptrs(raw, 1, 2, 3)
    for _ in range(6):
        raw.run(p, 0)
    assert not raw.replays.graphs and raw.replays.on is False
    assert raw.replays.describe()["cuda_graph"] == "off"
    assert len(lowered.calls) == 6 and all(c[1:] == (0xAAAA, 0) for c in lowered.calls)


def test_graphs_per_plan_are_bounded() -> None:
    raw, _, _, _ = _launch()
    for y in range(LaunchReplay.MAX_GRAPHS + 3):
        p = _ptrs(raw, 1, 2, 100 + y)
        for _ in range(LaunchReplay.REPEATS):
            raw.run(p, 0)
    assert len(raw.replays.graphs) == LaunchReplay.MAX_GRAPHS


def test_threads_launching_at_once_keep_their_own_pointers() -> None:
    """Each thread's pointers reach cuDNN intact: the shared array is written and read under
    the handle's lock (the fake launch sleeps between reading it twice)."""
    raw, lowered, _, _ = _launch(graphs=False, slow=0.001)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                raw.run(_ptrs(raw, 1000 * i + j, 2, 3), 5 + i % 2)
        except BaseException as exc:
            errors.append(exc)

    in_threads(4, work)
    assert not errors, errors
    assert len(lowered.calls) == 80
    # each launch ran on the stream its thread asked for
    for ptrs, _, stream in lowered.calls:
        i = ptrs[raw.slot["x"]] // 1000
        assert stream == 5 + i % 2


def test_cuda_graph_knob_value_checked() -> None:
    import fusegraph as fg
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.cudnn.engine import CudnnEngine

    g = fg.Graph("k", io_data_type=fg.DataType.HALF)
    g.relu(g.tensor("x", [4, 4])).set_output(True)
    with pytest.raises(ValueError, match="cuda_graph"):
        CudnnEngine().build(g.validate(), fg.Handle("cuda:0"), EngineConfig("cudnn", (("cuda_graph", "sometimes"),)))

"""Fake engines for selection / autotuning tests: real plans (the float64 reference does the
math, cast to the graph's types), with a chosen op coverage, device coverage, speed per
knob setting and, on demand, wrong answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import fusegraph as fg
from fusegraph.engines.base import EngineConfig, ExecutionPlan, Knob, Support
from fusegraph.engines.reference import write_outputs
from fusegraph.engines.registry import BUILTIN, Registry
from fusegraph.graph.ops import OpKind
from fusegraph.reference.executor import run_reference
from fusegraph.runtime.variant_pack import resolve_pack
from fusegraph.select.partition import to_host


class FakePlan(ExecutionPlan):
    def __init__(self, graph: fg.Graph, handle: fg.Handle, config: EngineConfig, engine: FakeEngine) -> None:
        super().__init__(graph, handle, config)
        self.fake = engine

    def execute(self, variant_pack: Mapping[Any, Any]) -> dict[str, Any]:
        self.fake.calls += 1
        delay = self.fake.delay * self.fake.speed.get(self.config.get("speed", "slow"), 1.0)
        if delay:
            time.sleep(delay)
        pack = resolve_pack(self.graph, variant_pack, check=lambda t, v, what: v)
        values = run_reference(self.graph, {k: np.asarray(to_host(v)) for k, v in pack.inputs.items()})
        if self.fake.wrong:
            values = {k: v + 1.0 for k, v in values.items()}
        return write_outputs(self.graph, values, pack.outputs)


class FakeEngine:
    """An engine for tests; ``ops`` limits the op kinds it takes (None: all)."""

    def __init__(
        self,
        name: str,
        *,
        ops: set[OpKind] | None = None,
        gpu: bool = True,
        cpu: bool = True,
        delay: float = 0.0,
        wrong: bool = False,
        version: str = "1.0",
        knobs: Sequence[Knob] = (),
        speed: dict[Any, float] | None = None,
        build_delay: float = 0.0,
    ) -> None:
        self.name = name
        self.version = version
        self.ops = ops
        self.gpu, self.cpu = gpu, cpu
        self.delay = delay
        self.wrong = wrong
        self._knobs = list(knobs)
        self.speed = speed or {}
        self.build_delay = build_delay
        self.calls = 0
        self.builds = 0

    def available(self) -> Support:
        return Support.yes()

    def supports(self, graph: fg.Graph, handle: fg.Handle) -> Support:
        if handle.device.is_gpu and not self.gpu:
            return Support.no(f"{self.name} has no GPU backend")
        if not handle.device.is_gpu and not self.cpu:
            return Support.no(f"{self.name} has no CPU backend")
        if self.ops is not None:
            for n in graph.nodes:
                if n.kind not in self.ops:
                    return Support.no(f"{self.name} cannot run {n.kind.value} (node '{n.name}')")
        return Support.yes()

    def knobs(self, graph: fg.Graph, handle: fg.Handle) -> Sequence[Knob]:
        return list(self._knobs)

    def build(self, graph: fg.Graph, handle: fg.Handle, config: EngineConfig | None = None) -> ExecutionPlan:
        self.builds += 1
        if self.build_delay:
            time.sleep(self.build_delay)  # as a compiler would
        return FakePlan(graph, handle, config or EngineConfig(self.name), self)


def registry_with(*engines: Any, reference: bool = True) -> Registry:
    """A registry of exactly these engines (plus the real reference engine)."""
    reg = Registry(builtin={"reference": BUILTIN["reference"]} if reference else {}, discover=False)
    for e in engines:
        reg.register(e, origin="test")
    return reg


def chain_graph(n: int = 3, shape: Sequence[int] = (4, 16)) -> fg.Graph:
    """x -> relu -> (+ b) -> tanh ... : a pointwise chain of ``n`` ops."""
    g = fg.Graph("chain", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", list(shape))
    b = g.tensor("b", list(shape))
    y = g.relu(x)
    for i in range(n - 1):
        y = g.add(y, b) if i % 2 == 0 else g.tanh(y)
    y.set_output(True).set_name("y")
    return g.validate()


def matmul_chain_graph() -> fg.Graph:
    """matmul -> relu -> matmul -> add: two kinds of op, interleaved."""
    g = fg.Graph("mm_chain", io_data_type=fg.DataType.FLOAT)
    a = g.tensor("a", [8, 16])
    w1 = g.tensor("w1", [16, 12])
    w2 = g.tensor("w2", [12, 10])
    bias = g.tensor("bias", [1, 10])
    h = g.relu(g.matmul(a, w1, name="mm1"), name="act")
    y = g.add(g.matmul(h, w2, name="mm2"), bias, name="addb")
    y.set_output(True).set_name("y")
    return g.validate()


def conv_graph(n: int = 1, c: int = 8, hw: int = 8, k: int = 8) -> fg.Graph:
    g = fg.Graph("conv_bias_relu", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
    w = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    b = g.tensor("b", [1, k, 1, 1])
    y = g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1], name="conv"), b, name="bias"), name="relu")
    y.set_output(True).set_name("y")
    return g.validate()


def layernorm_graph(rows: int = 8, cols: int = 32) -> fg.Graph:
    g = fg.Graph("layernorm", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [rows, cols])
    s = g.tensor("s", [1, cols])
    b = g.tensor("b", [1, cols])
    y, _, _ = g.layernorm(x, s, b, 1e-5)
    y.set_output(True).set_name("y")
    return g.validate()


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(o).any(), "NaN in output"
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-300))


def in_threads(n: int, work: Callable[[int], None]) -> None:
    """Runs ``work(0)`` .. ``work(n - 1)`` in ``n`` threads at once and waits for them all."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def check_repeated_calls(plan: Any, g: fg.Graph, dev: dict[str, Any], given: Any, outputs: str,
                         rng: np.random.Generator, calls: int = 8, tol: float = 1e-2) -> None:
    """A GPU plan called again and again with the same pointers (its inputs rewritten in
    place; the output ``given`` -- NaN-filled before each call -- or allocated where the last
    one was freed), each call's result against the float64 reference for that call's inputs:
    a replayed launch must read each call's inputs and write each call's output."""
    import torch

    from fusegraph.reference.inputs import random_inputs

    name = g.outputs()[0].name
    for _ in range(calls):
        pack = random_inputs(g, rng)
        # Copied from host tensors: staging on the device would allocate there and move
        # where the caching allocator puts an allocated output, so its pointer would not
        # repeat (the replay this checks would never be captured).
        for t in g.inputs():
            a = np.ascontiguousarray(pack[t.name])
            host = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if t.dtype == fg.DataType.BFLOAT16
                    else torch.from_numpy(a))
            dev[t.name].copy_(host)
        ref = g.execute(pack, engine="reference")[name]
        if outputs == "given":
            given.fill_(float("nan"))
            assert plan.execute({**dev, name: given}) == {}
            got = given.float().cpu().numpy()
        else:
            y = plan.execute(dev)[name]
            got = y.float().cpu().numpy()
            del y
        assert rel_error(got, ref) <= tol


class DLPackOnly:
    """An array that speaks only DLPack (as CuPy or JAX arrays do)."""

    def __init__(self, t: Any) -> None:
        self._t = t

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


class Clock:
    """A virtual clock for select/timing.py's ``clock``: time moves only when a fake call says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def virtual_call(clock: Clock, ms: float, inner: Callable[[], object] | None = None) -> Callable[[], object]:
    """A call that takes ``ms`` virtual milliseconds (running ``inner`` for its result)."""

    def call() -> object:
        clock.now += ms / 1e3
        return inner() if inner is not None else None

    return call

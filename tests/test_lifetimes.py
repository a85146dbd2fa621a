"""Threads (issue 12 item 4): one built plan executed from several threads at once gives each
thread its own right answer, on every available CPU engine. (Flat memory and descriptors over
10,000 build/execute/release cycles, and a clean interpreter exit with live plans, are
measured by benchmarks/bench_lifetimes.py: docs/reliability.md.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.engines.registry import active_registry
from fusegraph.reference.executor import run_reference
from fusegraph.reference.inputs import random_inputs

CPU_ENGINES = ["reference", "torch", "iree"]


def _graph(rng: np.random.Generator) -> fg.Graph:
    # dims drawn per run: each run builds (and, on IREE, compiles) a plan of its own
    n, c, hw, k = 2, int(rng.integers(3, 9)), 8, int(rng.integers(4, 13))
    g = fg.Graph("threads", io_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
    w = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    b = g.tensor("b", [1, k, 1, 1])
    y = g.relu(g.bias(g.conv_fprop(x, w, padding=[1, 1]), b))
    out, _, _ = g.layernorm(y, g.tensor("s", [1, k, hw, hw]), g.tensor("bb", [1, k, hw, hw]), epsilon=1e-5)
    out.set_name("y").set_output(True)
    return g.validate()


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_one_plan_executed_from_several_threads_at_once(engine: str, rng: np.random.Generator) -> None:
    if engine not in [e.name for e in active_registry().available_engines()]:
        pytest.skip(f"the {engine} engine is not available here")
    g = _graph(rng)
    plan = g.build(engine=engine)
    n_threads, per_thread = 6, 15
    cases = []
    for _ in range(n_threads):  # different inputs per thread: a shared buffer would mix them up
        ins = random_inputs(g, rng)
        cases.append((ins, np.asarray(run_reference(g, ins)["y"], np.float64)))
    errors: list[str] = []
    worst = [0.0]
    start = threading.Barrier(n_threads)
    lock = threading.Lock()

    def work(t: int) -> None:
        ins, ref = cases[t]
        start.wait()
        for _ in range(per_thread):
            try:
                got = np.asarray(plan.execute(ins)["y"], np.float64)
            except Exception as exc:  # recorded: a refusal must be a clear error, and is a failure here
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                return
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.isfinite(got).all() else np.inf
            with lock:
                worst[0] = max(worst[0], err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "an execute hung"
    assert not errors, errors[:3]
    assert worst[0] <= 1e-4, f"{engine}: worst relative error {worst[0]:.2e} across threads"


def test_loaded_iree_modules_are_bounded_and_live_plans_keep_theirs(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every distinct graph used to stay loaded in the IREE runtime for good (~0.13 MiB each)."""
    if "iree" not in [e.name for e in active_registry().available_engines()]:
        pytest.skip("the IREE engine is not available here")
    from fusegraph.engines.iree.runtime import runtime_for
    from fusegraph.runtime import iree_hal

    monkeypatch.setattr(iree_hal, "MAX_LOADED_MODULES", 2)
    graphs = [_graph(rng) for _ in range(4)]
    plans = [g.build(engine="iree") for g in graphs]
    runtime = runtime_for(fg.Handle("cpu"))
    assert len(runtime._modules) <= 2
    g, plan = graphs[0], plans[0]  # its module was evicted from the runtime; the plan keeps it
    ins = random_inputs(g, rng)
    got = np.asarray(plan.execute(ins)["y"], np.float64)
    ref = np.asarray(run_reference(g, ins)["y"], np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-4

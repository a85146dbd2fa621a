"""Shared fixtures; GPU-marked tests are skipped (with the reason) where no GPU is present."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return os.path.exists("/dev/nvidia0")


def pytest_configure(config: pytest.Config) -> None:
    """The suite never reads or writes the user's real cache directory: one temporary cache
    for the whole run (subprocesses inherit it), removed at the end. Fixtures that want a
    cache of their own still point FUSEGRAPH_CACHE_DIR elsewhere."""
    root = tempfile.mkdtemp(prefix="fusegraph-test-cache-")
    os.environ["FUSEGRAPH_CACHE_DIR"] = root
    # The torch engine's compiled CPU path costs seconds to tens of seconds per graph on a
    # cold cache; tests of numerics run the eager plan, tests/test_cpu_paths.py the compiled one.
    os.environ.setdefault("FUSEGRAPH_TORCH_CPU_COMPILE", "off")
    os.environ.setdefault("FUSEGRAPH_FLOOR_MODE", "inline")  # background children per session: tests opt in
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: run on the GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data each run; the seed is printed on failure for reproduction."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache per test module (modules that want it use ``iree_cache_dir``)."""
    return tmp_path_factory.mktemp("iree-cache")


@pytest.fixture
def iree_cache_dir(monkeypatch: pytest.MonkeyPatch, shared_cache: Path) -> Path:
    """The engines' cache pointed at the module's own directory, caching on, in-process compiler."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(shared_cache))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.delenv("FUSEGRAPH_IREE_COMPILER", raising=False)
    return shared_cache


@pytest.fixture
def iree_engine() -> None:
    """Skips, saying why, where the IREE engine cannot be loaded or is not available."""
    from fusegraph.engines.registry import REGISTRY

    try:
        state = REGISTRY.get("iree").available()
    except Exception as exc:  # a broken engine is reported as the reason
        pytest.skip(f"engine iree cannot be loaded here: {exc}")
    if not state:
        pytest.skip(f"engine iree is not available here: {state.reason}")


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own, caching on (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("own_cache")``)."""
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    return tmp_path


@pytest.fixture(autouse=True)
def _steady_machine_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-model runner verdicts are keyed by the machine's load class, read from the load
    average at session creation; a suite on 2 busy cores can cross the threshold between two
    sessions of one test, so tests see one class ("quiet") unless they set it.
    tests/test_onnx_load_class.py tests the real reading."""
    from fusegraph.onnx import floor

    monkeypatch.setattr(floor, "machine_load", lambda: "quiet")


class LoopClock:
    """The virtual clock of a training loop's steps (fusegraph/torch/loop_trial.py): the
    test's candidates add their cost to ``now``."""

    def __init__(self) -> None:
        self.now = 0.0


@pytest.fixture
def loop_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopClock]:
    """loop_trial's clock made virtual, with a queue and an optimizer-step count of the
    test's own (the hook released afterwards)."""
    from fusegraph.torch import loop_trial

    clock = LoopClock()
    monkeypatch.setattr(loop_trial, "_clock", lambda: clock.now)
    monkeypatch.setattr(loop_trial, "QUEUE", loop_trial._Queue())
    monkeypatch.setattr(loop_trial, "OPTIMIZER", loop_trial._OptimizerSteps())
    yield clock
    loop_trial.OPTIMIZER.release()

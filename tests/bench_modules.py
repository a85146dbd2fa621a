"""A benchmarks/ script loaded as a module, for the tests that check it or reuse its models
(benchmarks/ is not a package: its scripts import their siblings from their own folder)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(script: str, alias: str) -> ModuleType:
    """``benchmarks/<script>.py`` executed under the module name ``alias`` (each test its own,
    so two tests' loads do not share state), its folder on ``sys.path`` while it imports."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(alias, BENCH_DIR / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH_DIR))
    return module

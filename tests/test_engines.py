"""Registry and discovery: built-ins, broken plugins, a real plugin package through entry
points (installed into a temporary directory, run in a subprocess), the engines CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from engine_fakes import FakeEngine, chain_graph, registry_with

from fusegraph.cli import main as cli_main
from fusegraph.engines.base import Engine, EngineConfig, Knob
from fusegraph.engines.registry import BUILTIN, REGISTRY, Registry, using
from fusegraph.errors import UnsupportedError

PLUGIN_SRC = Path(__file__).parent / "plugin_pkg"


def test_builtins_are_listed_with_version_and_availability() -> None:
    names = {r.name: r for r in REGISTRY.info()}
    for name in ("reference", "iree", "torch"):
        assert name in names, f"{name} missing from {list(names)}"
        row = names[name]
        assert (row.version and row.version != "?") or row.origin == "broken"
        assert row.available or row.available.reason, "an unavailable engine must say why"
    assert names["reference"].available
    assert list(BUILTIN) == ["iree", "torch", "cudnn", "triton", "reference"]


def test_every_loaded_engine_implements_the_protocol() -> None:
    for e in REGISTRY.engines():
        assert isinstance(e, Engine)
        assert e.name and isinstance(e.name, str)


def test_a_module_that_fails_to_import_is_reported_not_raised() -> None:
    reg = Registry(builtin={"ghost": "fusegraph_no_such_module:Engine", "reference": BUILTIN["reference"]}, discover=False)
    assert reg.names() == ["reference"]
    row = next(r for r in reg.info() if r.name == "ghost")
    assert not row.available and "fusegraph_no_such_module" in row.available.reason
    with pytest.raises(UnsupportedError, match=r"ghost.*failed to load"):
        reg.get("ghost")


def test_an_object_without_the_protocol_is_reported() -> None:
    reg = Registry(builtin={"bad": "fusegraph.errors:FusegraphError"}, discover=False)
    assert reg.names() == []
    assert "Engine protocol" in reg.broken()["bad"] or "failed to load" in reg.broken()["bad"]


def test_unknown_engine_names_the_known_ones() -> None:
    reg = registry_with(FakeEngine("fast"))
    with pytest.raises(UnsupportedError, match=r"no engine named 'nope'.*fast"):
        reg.get("nope")


def test_register_and_unregister_at_runtime() -> None:
    reg = registry_with()
    reg.register(FakeEngine("extra"))
    assert "extra" in reg.names()
    reg.unregister("extra")
    assert "extra" not in reg.names()


def test_knob_is_typed_and_checks_values() -> None:
    k = Knob("level", 2, (1, 2, 3), description="a level")
    assert k.type is int
    k.check(3)
    with pytest.raises(ValueError, match="not in"):
        k.check(7)
    r = Knob("ratio", 0.5, range=(0.0, 1.0))
    r.check(1.0)
    with pytest.raises(ValueError, match="outside"):
        r.check(1.5)


def test_engine_config_is_hashable_and_printable() -> None:
    c = EngineConfig("torch", (("compile", True),))
    assert {c: 1}[EngineConfig("torch", (("compile", True),))] == 1
    assert str(c) == "torch[compile=True]"
    assert c.as_dict() == {"engine": "torch", "knobs": {"compile": True}}


def test_engines_cli_lists_every_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["engines", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "iree", "torch"):
        assert name in out
    assert "heuristics: builtin" in out
    assert "on cpu:" in out


def test_engines_cli_says_why_not_for_a_gpu_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["engines", "--device", "cuda:0"]) == 0
    out = capsys.readouterr().out
    assert "reference: no: the reference engine runs on the host only" in out


def test_using_swaps_the_active_registry() -> None:
    fake = FakeEngine("only")
    reg = registry_with(fake, reference=False)
    g = chain_graph()
    x = np.random.default_rng(1).uniform(-1, 1, (4, 16)).astype(np.float32)
    with using(reg):
        g.execute({"x": x, "b": x})
    assert fake.calls == 1


# ---- a real plugin package, discovered through its entry points ------------------------------
@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/plugin_pkg pip-installed into a temporary --target directory (nothing global)."""
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(PLUGIN_SRC, src)  # build artifacts land in the copy, not in the repo
    target = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(target), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"pip install of the test plugin failed:\n{res.stdout}\n{res.stderr}"
    assert any(p.name.startswith("fusegraph_tiny_engine") and p.suffix == ".dist-info" for p in target.iterdir())
    return target


def _run_with(plugin: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env)


def test_plugin_package_adds_an_engine_and_a_heuristic(plugin_dir: Path) -> None:
    res = _run_with(
        plugin_dir,
        """
        import numpy as np, fusegraph as fg
        from fusegraph.engines.registry import REGISTRY
        print("ENGINES", sorted(REGISTRY.names()))
        print("ORIGIN", REGISTRY.origin("tiny"))
        print("HEUR", [h.name for h in REGISTRY.heuristics()])
        g = fg.Graph("pw", io_data_type=fg.DataType.FLOAT)
        x = g.tensor("x", [3, 5]); b = g.tensor("b", [3, 5])
        g.relu(g.add(x, b)).set_output(True).set_name("y")
        g.validate()
        cands = g.create_execution_plans([fg.HeurMode.A, fg.HeurMode.FALLBACK])
        print("FIRST", g._selection.candidates[0].config, g._selection.candidates[0].source)
        plan = g.build("cpu")
        print("BUILT", plan.engine)
        rng = np.random.default_rng(0)
        xv = rng.uniform(-1, 1, (3, 5)).astype(np.float32); bv = rng.uniform(-1, 1, (3, 5)).astype(np.float32)
        y = g.execute({"x": xv, "b": bv})["y"]
        ref = g.execute({"x": xv, "b": bv}, engine="reference")["y"]
        print("ERR", float(np.abs(y - ref).max()))
        """,
    )
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    assert "'tiny'" in lines["ENGINES"]
    assert lines["ORIGIN"].startswith("plugin fusegraph_tiny:TinyEngine")
    assert "tiny-first" in lines["HEUR"]
    assert lines["FIRST"] == "tiny plugin:tiny-first"
    assert lines["BUILT"] == "tiny"
    assert float(lines["ERR"]) < 1e-6


def test_plugin_is_listed_by_the_cli(plugin_dir: Path) -> None:
    res = _run_with(plugin_dir, "from fusegraph.cli import main; main(['engines'])")
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("tiny"))
    assert "0.0.1" in row and "plugin" in row and "available" in row
    assert "tiny-first" in res.stdout


def test_without_the_plugin_dir_there_is_no_tiny_engine() -> None:
    assert "tiny" not in REGISTRY.names()

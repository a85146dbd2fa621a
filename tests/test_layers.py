"""The structure issue 10 asks for, checked: imports go only down the layer order of
docs/DESIGN.md, no module outgrows 800 lines, a cached IREE build in a fresh process
imports neither torch nor IREE's compiler, and every engine covers the op table or says
why not.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph.engines.unsupported import UNSUPPORTED
from fusegraph.errors import FusegraphError, VariantPackError
from fusegraph.graph import seam
from fusegraph.graph.ops import OpKind, PointwiseMode

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fusegraph"

# The layer order (docs/DESIGN.md "Layers"): a module may import its own layer and those
# below it. Keys are the first component under fusegraph/ (a subpackage or a top module).
LAYERS: dict[str, float] = {
    "dtypes": 0,
    "errors": 0,
    "graph": 1,
    "reference": 2,
    "runtime": 3,
    "engines": 4,
    "select": 5,
    "regions": 5.5,  # the region choice both front doors share (onnx/, torch/)
    "onnx": 6,
    "torch": 6,  # fusegraph/torch/: the PyTorch front door
    "demo": 7,
    "commands": 7,
    "bench": 7,  # fusegraph/bench/: the `fusegraph bench` driver's modules
    "cli": 7,
    "__main__": 7,
    "__init__": 7,  # fusegraph/__init__.py: the re-exports
}
MAX_LINES = 800


def _layer_of(path: Path) -> tuple[str, int]:
    top = path.relative_to(PKG).parts[0].removesuffix(".py")
    if top not in LAYERS:
        raise AssertionError(f"{path.relative_to(ROOT)}: '{top}' has no layer; add it to LAYERS and docs/DESIGN.md")
    return top, LAYERS[top]


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: annotations only, never executed."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parent.parts)


def _imports(path: Path, package: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import, module- and function-level alike, relative
    imports resolved against ``package``; imports under ``if TYPE_CHECKING:`` are left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield node.lineno, module, [a.name for a in node.names]


def layer_violations() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        top, level = _layer_of(path)
        for line, module, names in _imports(path, _package_of(path)):
            parts = module.split(".")
            if parts[0] != "fusegraph":
                continue
            if len(parts) == 1:
                # ``from fusegraph import __version__`` reads the one string fusegraph/__init__.py
                # sets before it imports anything: the version is L0, not the re-exports.
                if names == ["__version__"]:
                    continue
                target, target_level = "fusegraph (the re-exports)", LAYERS["__init__"]
            else:
                target = parts[1]
                target_level = LAYERS.get(target, 99)
            if target_level > level:
                out.append(
                    f"{path.relative_to(ROOT)}:{line}: {top} (L{level}) imports {module} (L{target_level})"
                )
    return out


def test_imports_go_only_down_the_layers() -> None:
    bad = layer_violations()
    assert not bad, "imports against the layer order (docs/DESIGN.md):\n  " + "\n  ".join(bad)


def test_the_layer_check_sees_function_level_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fusegraph.select import api\n"
        "def f():\n    from fusegraph.engines import registry\n    import fusegraph.onnx.plan\n"
    )
    found = [(line, module) for line, module, _ in _imports(src, "fusegraph.x")]
    assert (5, "fusegraph.engines") in found and (6, "fusegraph.onnx.plan") in found
    assert all(module != "fusegraph.select" for _, module in found)  # TYPE_CHECKING only


def _node_of(module: str) -> str:
    """The subpackage a module belongs to (``fusegraph.engines.torch`` for
    ``fusegraph.engines.torch.plan``), or the module itself for a top module
    (``fusegraph.dtypes``); ``fusegraph`` is the package's __init__ (the re-exports)."""
    parts = module.split(".")
    path = PKG.joinpath(*parts[1:])
    if path.is_dir():  # a package: its own node
        return module
    return ".".join(parts[:-1]) if len(parts) > 2 else module


def _target(module: str, names: list[str]) -> list[str]:
    """What ``from module import names`` (or ``import module``) imports: a submodule or
    subpackage named in ``names`` where there is one, else ``module`` itself."""
    base = PKG.joinpath(*module.split(".")[1:])
    subs = [f"{module}.{n}" for n in names if (base / f"{n}.py").is_file() or (base / n).is_dir()]
    return subs if len(subs) == len(names) and names else [module]


def subpackage_imports() -> dict[str, dict[str, str]]:
    """node -> {node it imports: one place that does}, every import (module- and
    function-level; not under TYPE_CHECKING) between fusegraph's subpackages and top modules."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = _node_of(module)
        edges.setdefault(src, {})
        for line, imported, names in _imports(path, _package_of(path)):
            if imported.split(".")[0] != "fusegraph" or (imported == "fusegraph" and names == ["__version__"]):
                continue  # another library, or the version string set before anything is imported
            for target in _target(imported, names):
                dst = _node_of(target)
                if dst != src:
                    edges[src].setdefault(dst, f"{path.relative_to(ROOT)}:{line}")
    return edges


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str]:
    """One import cycle as its path of nodes (first node repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycle_between_subpackages() -> None:
    edges = subpackage_imports()
    assert {"fusegraph.graph", "fusegraph.engines", "fusegraph.engines.torch", "fusegraph.onnx.ops"} <= set(edges)
    cycle = find_cycle(edges)
    where = [f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(cycle)]
    assert not cycle, "import cycle between subpackages:\n  " + "\n  ".join(where)


def test_the_cycle_check_finds_a_cycle() -> None:
    edges = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:3"}, "d": {"a": "d.py:1"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {}}) == []
    assert _node_of("fusegraph.engines.torch.plan") == "fusegraph.engines.torch"
    assert _node_of("fusegraph.engines.registry") == "fusegraph.engines"
    assert _node_of("fusegraph.dtypes") == "fusegraph.dtypes"
    assert _target("fusegraph.engines", ["registry"]) == ["fusegraph.engines.registry"]
    assert _target("fusegraph.graph.ops", ["OpKind"]) == ["fusegraph.graph.ops"]


def test_no_module_over_800_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


# ---- the seam ------------------------------------------------------------------------------------
def _relu_graph() -> fg.Graph:
    g = fg.Graph("seam", io_data_type=fg.DataType.FLOAT)
    g.relu(g.tensor("x", [2, 3])).set_output(True).set_name("y")
    return g


def test_graph_methods_reach_the_planner_through_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class Recorder:
        def __getattr__(self, method: str) -> Any:
            return lambda *args, **kw: calls.append((method, args[0])) or {}

    monkeypatch.setattr(seam, "_PLANNER", [Recorder()])
    g = _relu_graph()
    g.execute({})
    g.build()
    assert [m for m, _ in calls] == ["execute", "build"] and all(graph is g for _, graph in calls)


def test_without_a_planner_the_error_says_what_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seam, "_PLANNER", [])
    with pytest.raises(FusegraphError, match="import fusegraph"):
        _relu_graph().build()


def test_an_engine_name_in_the_workspace_slot_is_refused(rng: np.random.Generator) -> None:
    g = _relu_graph()
    pack = {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    with pytest.raises(VariantPackError, match=r"engine='reference'"):
        g.execute(pack, "reference")  # type: ignore[arg-type]
    with pytest.raises(VariantPackError, match="workspace"):
        g.execute(pack, 3)
    with pytest.raises(TypeError):
        g.execute(pack, None, "cpu")  # type: ignore[misc]  # handle is keyword-only
    y = g.execute(pack, np.empty(16, np.uint8), engine="reference")["y"]  # a buffer is a workspace
    assert np.array_equal(y, np.maximum(pack["x"], 0))
    g.build(engine="reference")
    g.create_execution_plans().check_support().build_plans()
    with pytest.raises(VariantPackError, match="engine="):
        g.execute_plan_at_index(pack, 0, "iree")


# ---- lazy engines: a cached IREE build in a fresh process ------------------------------------------
_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import fusegraph as fg
    g = fg.Graph("cached_iree", io_data_type=fg.DataType.FLOAT)
    x, b = g.tensor("x", [8, 32]), g.tensor("b", [1, 32])
    g.tanh(g.mul(g.add(x, b), x)).set_output(True).set_name("y")
    mode = sys.argv[1]
    if mode == "populate":
        g.build(engine="iree")
        raise SystemExit
    if mode == "tune":  # a tuning-database entry naming IREE, as autotune would write it
        from fusegraph.engines.base import EngineConfig
        from fusegraph.engines.registry import REGISTRY
        from fusegraph.select import tuning_db
        from fusegraph.select.device_id import device_id
        versions = tuning_db.engine_versions(REGISTRY.available_engines())
        entry = tuning_db.TuningEntry(g.key(), g.name, device_id(fg.Handle("cpu")), versions, EngineConfig("iree"))
        tuning_db.default_db().put(entry)
        raise SystemExit
    plan = g.build(engine="iree") if mode == "pinned" else g.build()
    watch = ("torch", "iree.compiler", "fusegraph.engines.iree.compile", "fusegraph.engines.iree.lower_base")
    loaded = {m: m in sys.modules for m in watch}
    from fusegraph.runtime.iree_hal import bindings
    loaded["iree runtime"] = bindings.cache_info().currsize == 1  # the runtime bindings are loaded
    source = next(c.source for c in g._selection.candidates if c.plan is plan)
    rng = np.random.default_rng(7)
    pack = {"x": rng.standard_normal((8, 32), dtype=np.float32), "b": rng.standard_normal((1, 32), dtype=np.float32)}
    y = g.execute(pack)["y"]
    ref = g.execute(pack, engine="reference")["y"]
    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    print(json.dumps({"engine": plan.engine, "source": source, "loaded": loaded, "rel_err": err}))
    """
)


_CACHED_BUILD_LOADS = {
    "torch": False,
    "iree.compiler": False,
    "fusegraph.engines.iree.compile": False,
    "fusegraph.engines.iree.lower_base": False,
    "iree runtime": True,
}


def _child(mode: str, env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"child '{mode}' failed:\n{res.stderr[-3000:]}"
    return dict(json.loads(res.stdout.strip().splitlines()[-1])) if mode not in ("populate", "tune") else {}


@pytest.fixture(scope="module")
def cached_iree_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("iree.compiler", reason="the IREE compiler wheel is a hard dependency")
    env = dict(os.environ)
    env["FUSEGRAPH_CACHE_DIR"] = str(tmp_path_factory.mktemp("fusegraph-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("FUSEGRAPH_ENGINE", None)
    env.pop("FUSEGRAPH_CACHE", None)
    _child("populate", env)
    return env


@pytest.mark.parametrize("mode", ["pinned", "default"])
def test_a_cached_iree_build_imports_neither_torch_nor_the_compiler(mode: str, cached_iree_env: dict[str, str]) -> None:
    """engine="iree", and the default build where the heuristics rank IREE first (a CPU
    pointwise chain): IREE's runtime is loaded; torch, the compiler, the compiler driver
    (engines/iree/compile.py) and the lowerings are not. Its time is measured by
    benchmarks/bench_cold_build.py (no wall-clock asserts in tests)."""
    out = _child(mode, cached_iree_env)
    assert (out["engine"], out["source"]) == ("iree", "heuristic:A"), out
    assert out["loaded"] == _CACHED_BUILD_LOADS, out
    assert out["rel_err"] < 1e-5, out


def test_a_tuned_iree_build_imports_neither_torch_nor_the_compiler(
    cached_iree_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**cached_iree_env, "FUSEGRAPH_CACHE_DIR": str(tmp_path)}
    _child("populate", env)
    _child("tune", env)
    out = _child("default", env)
    assert (out["engine"], out["source"]) == ("iree", "tuned"), out
    assert out["loaded"] == _CACHED_BUILD_LOADS, out
    assert out["rel_err"] < 1e-5, out


# ---- one op table: every engine implements each op or declares why not ----------------------------
_POINTWISE_TABLE_NAMES = ("POINTWISE_TABLE", "POINTWISE_LOWER", "POINTWISE", "pointwise_table", "_pointwise_table")


def _torch_tables() -> tuple[set[Any], set[Any]]:
    """The torch engine's op table (``LOWER``, keyed by OpKind) and pointwise table (keyed by
    PointwiseMode), in whichever module of the engine (or its package) holds them."""
    pytest.importorskip("torch", reason="the torch engine's pointwise table is built with torch")
    root = importlib.import_module("fusegraph.engines.torch")
    modules = [root]
    if hasattr(root, "__path__"):
        import pkgutil

        modules += [importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")]
    ops: set[Any] | None = None
    modes: set[Any] | None = None
    for module in modules:
        lower = getattr(module, "LOWER", None)
        if ops is None and isinstance(lower, dict) and any(isinstance(k, OpKind) for k in lower):
            ops = set(lower)
        for attr in _POINTWISE_TABLE_NAMES:
            table = getattr(module, attr, None)
            table = table() if callable(table) else table
            if modes is None and isinstance(table, dict) and any(isinstance(k, PointwiseMode) for k in table):
                modes = set(table)
    assert ops is not None and modes is not None, (
        "the torch engine's LOWER / pointwise table moved: update _torch_tables in tests/test_layers.py"
    )
    return ops, modes


def _implemented() -> dict[str, tuple[set[Any], set[Any]]]:
    from fusegraph.engines.iree.emit import LOWER as IREE_LOWER
    from fusegraph.engines.iree.lower_pointwise import POINTWISE_LOWER
    from fusegraph.engines.triton.codegen import POINTWISE_TRITON
    from fusegraph.engines.triton.rows import ROW_OPS
    from fusegraph.reference.ops import POINTWISE_FNS, REFERENCE

    return {
        "reference": (set(REFERENCE), set(POINTWISE_FNS)),
        "iree": (set(IREE_LOWER), set(POINTWISE_LOWER)),
        "torch": _torch_tables(),
        "triton": ({*ROW_OPS, OpKind.POINTWISE, OpKind.RESHAPE}, set(POINTWISE_TRITON)),  # reshapes of the whole frame: views
    }


def test_every_engine_covers_the_op_table_or_says_why_not() -> None:
    missing = []
    for engine, (ops, modes) in _implemented().items():
        declared = UNSUPPORTED.get(engine, {})
        for op in [*OpKind, *PointwiseMode]:
            implemented = op in (ops if isinstance(op, OpKind) else modes)
            if implemented and op in declared:
                missing.append(f"{engine}: {op!r} is implemented and also declared unsupported")
            elif not implemented and not declared.get(op):
                missing.append(f"{engine}: {op!r} has no lowering and no reason in engines/unsupported.py")
    assert not missing, "\n  ".join(["op table coverage:", *missing])


def test_a_declared_unsupported_op_is_refused_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(UNSUPPORTED, "reference", {PointwiseMode.RELU_FWD: "not today"})
    with pytest.raises(fg.UnsupportedError, match=r"relu.*not today"):
        _relu_graph().build(engine="reference")


def test_the_registry_imports_an_engine_module_only_when_that_engine_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusegraph.engines.registry import BUILTIN, Registry

    (tmp_path / "fg_lazy_probe.py").write_text(
        "class ProbeEngine:\n"
        "    name = 'probe'\n    version = '1'\n"
        "    def available(self): ...\n    def supports(self, graph, handle): ...\n"
        "    def knobs(self, graph, handle): return []\n    def build(self, graph, handle, config=None): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fg_lazy_probe", raising=False)
    reg = Registry(builtin={"probe": "fg_lazy_probe:ProbeEngine", "reference": BUILTIN["reference"]}, discover=False)
    assert reg.get("reference").name == "reference"
    assert "fg_lazy_probe" not in sys.modules
    assert reg.names() == ["probe", "reference"]  # listing loads everything, in registry order
    assert "fg_lazy_probe" in sys.modules


def test_the_plugin_scan_is_reused_until_what_it_read_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process does not re-read every distribution's entry_points.txt (issue 10's
    cold build): the scan's answer is kept in the cache directory and reused while sys.path,
    its directories and the plugin files it read are unchanged."""
    from fusegraph.engines import registry

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.syspath_prepend(str(site))
    scans: list[int] = []
    real_scan = registry._scan

    def counted() -> Any:
        scans.append(1)
        return real_scan()

    monkeypatch.setattr(registry, "_scan", counted)

    def dist(name: str, body: str) -> Path:
        d = site / f"{name}-1.0.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (d / "entry_points.txt").write_text(body)
        return d

    settled: list[int] = []

    def settle(*paths: Path) -> None:  # older than the scan's 2 s timestamp-granularity guard
        settled.append(1)  # each time another time, as real changes would have
        past = os.stat(site).st_mtime_ns - (100 - len(settled)) * 10**9
        for p in (*paths, site):
            os.utime(p, ns=(past, past))

    def names() -> list[str]:
        return sorted(ep.name for ep in registry.plugin_entry_points())

    alpha = dist("fg_alpha", "[fusegraph.engines]\nalpha = fg_alpha_mod:Engine\n")
    settle(alpha / "entry_points.txt")
    assert names() == ["alpha"] and len(scans) == 1
    assert names() == ["alpha"] and len(scans) == 1  # reused
    beta = dist("fg_beta", "[fusegraph.heuristics]\nbeta = fg_beta_mod:Rules\n")  # the directory changes
    assert names() == ["alpha", "beta"] and len(scans) == 2
    settle(beta / "entry_points.txt")
    assert names() == ["alpha", "beta"] and len(scans) == 3  # a recent change is not stored, then it is
    assert names() == ["alpha", "beta"] and len(scans) == 3
    (alpha / "entry_points.txt").write_text("[console_scripts]\nalpha = fg_alpha_mod:main\n")  # in place
    assert names() == ["beta"] and len(scans) == 4
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")
    assert names() == ["beta"] and len(scans) == 5  # caches off: always scanned

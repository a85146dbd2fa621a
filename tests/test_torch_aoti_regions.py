"""torch[compile=True] plans kept as AOTInductor packages in fusegraph's cache
(fusegraph/engines/torch/aoti_cache.py) when asked (``plan.persist()``; a build alone keeps
nothing): a later process loads the package without
importing Dynamo or Inductor and computes what the float64 reference does; a damaged
package is compiled again with a log line; a graph the export refuses is compiled in
process, and the refusal is remembered. GPU tests (``-m gpu``) check the package runs on
the caller's stream: captured in a CUDA graph on a side stream and replayed.

Cost on the shared 2-core machine: two AOTInductor compiles (~10 s each), one in-process
Inductor compile, one child process (~3 s).
"""

from __future__ import annotations

import json
import logging
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
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig

torch = pytest.importorskip("torch", reason="the torch engine needs PyTorch (pip install 'fusegraph[torch]')")

from fusegraph.engines.torch import TorchEngine, aoti_cache, compiled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINE = TorchEngine()
COMPILE = EngineConfig("torch", (("compile", True),))
TOL = {DT.FLOAT: 1e-4, DT.HALF: 1e-2}  # layer norm in the chain: the norms' f32 tolerance


def region_graph(dt: DT = DT.FLOAT, name: str = "region") -> fg.Graph:
    """What a Swin-T region on torch[compile=True] holds: a layer norm, a reshape and a
    transpose (window partition), then a pointwise chain. Inputs in0..in3, output out0
    (the names regions/plan.py's steps bind)."""
    g = fg.Graph(name, io_data_type=dt, intermediate_data_type=DT.FLOAT)
    x = g.tensor("in0", [64, 24])
    y, _, _ = g.layernorm(x, g.tensor("in1", [1, 24]), g.tensor("in2", [1, 24]), 1e-5)
    t = g.transpose(g.reshape(y, [2, 4, 8, 24]), [0, 2, 1, 3])
    z = g.mul(g.add(g.reshape(t, [64, 24]), g.tensor("in3", [1, 24])), g.scalar(0.5))
    g.tanh(g.relu(z)).set_name("out0").set_output(True)
    return g.validate()


def pointwise_graph() -> fg.Graph:
    g = fg.Graph("chain", io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT)
    x = g.tensor("x", [16, 12])
    g.sigmoid(g.mul(g.add(x, g.tensor("b", [1, 12])), g.scalar(1.5))).set_output(True)
    return g.validate()


def random_pack(g: fg.Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {t.name: rng.standard_normal(t.dim).astype(t.dtype.numpy) for t in g.inputs()}


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> None:
    """Relative L2 against the reference, max-abs in the message; NaN never passes."""
    g64, r64 = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert g64.shape == r64.shape, (what, g64.shape, r64.shape)
    assert not np.isnan(g64).any() and not np.isnan(r64).any(), f"{what}: NaN"
    err = float(np.linalg.norm(g64 - r64)) / max(float(np.linalg.norm(r64)), 1e-30)
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e} (max abs {np.abs(g64 - r64).max():.2e})"


def check(g: fg.Graph, device: str, rng: np.random.Generator, tol: float, persist: bool = True) -> Any:
    """Builds ``g`` with compile=True on ``device``, runs fresh random data, compares every
    output with the float64 reference, then (``persist``) asks the plan to keep its package;
    returns the plan."""
    plan = ENGINE.build(g, fg.Handle(device), COMPILE)
    pack = random_pack(g, rng)
    got = plan.execute(pack)
    ref = g.execute(pack, engine="reference")
    for t in g.outputs():
        assert_close(got[t.name], ref[t.name], TOL.get(t.dtype, 1e-4), t.name)
    if persist:
        plan.persist()
    return plan


def packages(root: Path) -> list[Path]:
    return sorted((root / aoti_cache.PACKAGES).glob("*.pt2"))


def index(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / aoti_cache.PACKAGES / aoti_cache.INDEX).read_text()))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One fusegraph cache for the module, on; the process's compiled callables forgotten
    before and after (a test that builds again must load from disk, as a new process does)."""
    root = tmp_path_factory.mktemp("aoti-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEGRAPH_CACHE_DIR", str(root))
        mp.delenv("FUSEGRAPH_CACHE", raising=False)
        mp.setattr(compiled, "COMPILED", {})
        yield root


@pytest.fixture(scope="module")
def built(cache_dir: Path) -> Path:
    """The region graph compiled once on the CPU (cold cache): its package kept."""
    if not ENGINE.compile_support(fg.Handle("cpu")):
        pytest.skip(f"Inductor cannot compile here: {ENGINE.compile_support(fg.Handle('cpu')).reason}")
    check(region_graph(), "cpu", np.random.default_rng(), TOL[DT.FLOAT])
    kept = packages(cache_dir)
    assert len(kept) == 1, kept
    return kept[0]


CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import fusegraph as fg
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.torch import TorchEngine
    from test_torch_aoti_regions import region_graph
    g = region_graph()
    plan = TorchEngine().build(g, fg.Handle({device!r}), EngineConfig("torch", (("compile", True),)))
    pack = dict(np.load({pack!r}))
    np.save({out!r}, plan.execute(pack)["out0"])
    print(json.dumps({{m: m in sys.modules for m in ("torch._dynamo", "torch._inductor")}}))
""")


def run_child(device: str, tmp_path: Path, pack: dict[str, np.ndarray]) -> tuple[dict[str, bool], np.ndarray]:
    """Builds the region graph in a new process (this module's cache): what it imported, what it computed."""
    np.savez(tmp_path / "pack.npz", **pack)  # type: ignore[arg-type]
    code = CHILD.format(tests=str(ROOT / "tests"), device=device, pack=str(tmp_path / "pack.npz"),
                        out=str(tmp_path / "out.npy"))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), np.load(tmp_path / "out.npy")


# ---- the CPU ---------------------------------------------------------------------------------------
def test_a_new_process_loads_the_package_without_dynamo(built: Path, cache_dir: Path, tmp_path: Path,
                                                         rng: np.random.Generator) -> None:
    entry = index(cache_dir)[built.stem]
    assert entry["bytes"] == built.stat().st_size and len(entry["sha256"]) == 64
    before = built.stat().st_ino  # a package compiled again is a new file moved into place
    g = region_graph()
    pack = random_pack(g, rng)
    imported, got = run_child("cpu", tmp_path, pack)
    assert imported == {"torch._dynamo": False, "torch._inductor": False}, imported
    assert_close(got, g.execute(pack, engine="reference")["out0"], TOL[DT.FLOAT], "out0 (new process)")
    assert packages(cache_dir) == [built] and built.stat().st_ino == before  # loaded, not compiled again


def test_the_package_agrees_with_the_eager_plan(built: Path, rng: np.random.Generator) -> None:
    """Numbers do not change: the loaded package against the same plan run eagerly (f32)."""
    compiled.COMPILED.clear()
    g = region_graph()
    plan = ENGINE.build(g, fg.Handle("cpu"), COMPILE)
    assert any(getattr(f, "loader", None) is not None for f in compiled.COMPILED.values())  # the package ran
    eager = ENGINE.build(g, fg.Handle("cpu"), EngineConfig("torch"))
    pack = random_pack(g, rng)
    assert_close(plan.execute(pack)["out0"], eager.execute(pack)["out0"], 1e-5, "out0 vs eager")


def test_a_damaged_package_is_compiled_again_with_a_log_line(built: Path, cache_dir: Path, rng: np.random.Generator,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    data = bytearray(built.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = os.urandom(64)  # same size, other bytes
    built.write_bytes(bytes(data))
    compiled.COMPILED.clear()
    with caplog.at_level(logging.INFO, logger="fusegraph.engines.torch"):
        check(region_graph(), "cpu", rng, TOL[DT.FLOAT])
    assert "is not the file stored" in caplog.text and "compiling the plan again" in caplog.text, caplog.text
    assert "AOTInductor package compiled" in caplog.text, caplog.text
    entry = index(cache_dir)[built.stem]
    assert entry["sha256"] == aoti_cache._digest(built) and entry["bytes"] == built.stat().st_size


def test_a_package_the_loader_refuses_is_a_miss_not_a_crash(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file with the recorded digest that is no package (a foreign write): a log line, then compiled again."""
    key = "r" + "0" * 32
    path = cache_dir / aoti_cache.PACKAGES / f"{key}.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK\x03\x04 not a package" * 64)
    table = index(cache_dir) if (cache_dir / aoti_cache.PACKAGES / aoti_cache.INDEX).exists() else {}
    table[key] = {"sha256": aoti_cache._digest(path), "bytes": path.stat().st_size}
    (cache_dir / aoti_cache.PACKAGES / aoti_cache.INDEX).write_text(json.dumps(table))
    with caplog.at_level(logging.INFO, logger="fusegraph.engines.torch"):
        assert aoti_cache.cached(key, torch.device("cpu")) is None
    assert "could not be loaded" in caplog.text, caplog.text


def test_a_refused_export_is_remembered(cache_dir: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """torch.export refusing the graph: compiled in process (right numbers), the refusal
    kept; the next build (a new process would do the same) does not try the export again."""
    if not ENGINE.compile_support(fg.Handle("cpu")):
        pytest.skip(f"Inductor cannot compile here: {ENGINE.compile_support(fg.Handle('cpu')).reason}")
    calls: list[int] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("export refuses this graph (test)")

    monkeypatch.setattr(torch.export, "export", refuse)
    compiled.COMPILED.clear()
    g = pointwise_graph()
    with caplog.at_level(logging.INFO, logger="fusegraph.engines.torch"):
        check(g, "cpu", rng, 1e-5)
    assert calls == [1] and "remembering the refusal" in caplog.text, caplog.text
    refused = [e for e in index(cache_dir).values() if "refused" in e]
    assert len(refused) == 1 and "export refuses this graph" in refused[0]["refused"], refused
    compiled.COMPILED.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusegraph.engines.torch"):
        check(g, "cpu", rng, 1e-5)
    assert calls == [1], "the export was tried again"
    assert "no AOTInductor package: RuntimeError: export refuses this graph" in caplog.text, caplog.text


def test_the_key_covers_layout_options_variant_and_device() -> None:
    x = torch.empty(4, 6)
    base = aoti_cache.region_key("g", ["a"], ["y"], [x], None, ())
    assert base == aoti_cache.region_key("g", ["a"], ["y"], [torch.empty(4, 6)], {}, ())
    others = {
        aoti_cache.region_key("h", ["a"], ["y"], [x], None, ()),
        aoti_cache.region_key("g", ["a"], ["y"], [x.t().contiguous().t()], None, ()),  # column-major
        aoti_cache.region_key("g", ["a"], ["y"], [x.half()], None, ()),
        aoti_cache.region_key("g", ["a"], ["y"], [x], {"coordinate_descent_tuning": True}, ()),
        aoti_cache.region_key("g", ["a"], ["y"], [x], None, ("fp32_matmul", "bf16x3")),
        aoti_cache.region_key("g", ["b"], ["y"], [x], None, ()),
    }
    assert base not in others and len(others) == 6
    assert aoti_cache.device_identity(torch.device("cpu")).startswith("cpu ")


def test_a_build_alone_keeps_no_package(tmp_path: Path, rng: np.random.Generator,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Packaging costs an AOTInductor compile: only a plan the caller keeps is packaged."""
    if not ENGINE.compile_support(fg.Handle("cpu")):
        pytest.skip(f"Inductor cannot compile here: {ENGINE.compile_support(fg.Handle('cpu')).reason}")
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.setattr(compiled, "COMPILED", {})
    plan = check(pointwise_graph(), "cpu", rng, 1e-5, persist=False)
    assert packages(tmp_path) == []
    assert plan.persist().startswith("AOTInductor package kept") and len(packages(tmp_path)) == 1
    assert plan.persist() == ""  # once


def test_with_the_cache_off_nothing_is_kept(tmp_path: Path, rng: np.random.Generator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if not ENGINE.compile_support(fg.Handle("cpu")):
        pytest.skip(f"Inductor cannot compile here: {ENGINE.compile_support(fg.Handle('cpu')).reason}")
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSEGRAPH_CACHE", "0")
    monkeypatch.setattr(compiled, "COMPILED", {})
    check(pointwise_graph(), "cpu", rng, 1e-5)  # Inductor in process (its FX graph cache serves it)
    assert not (tmp_path / aoti_cache.PACKAGES).exists()


def test_an_unwritable_cache_compiles_in_process(tmp_path: Path, rng: np.random.Generator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A file where the cache directory should be: one warning, no package compiled (nobody
    could load it later), the plan right."""
    if not ENGINE.compile_support(fg.Handle("cpu")):
        pytest.skip(f"Inductor cannot compile here: {ENGINE.compile_support(fg.Handle('cpu')).reason}")
    from fusegraph.runtime.cache_dir import CacheUnavailableWarning

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file")
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(blocked))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.setattr(compiled, "COMPILED", {})
    with pytest.warns(CacheUnavailableWarning):
        check(pointwise_graph(), "cpu", rng, 1e-5)
    assert not any(getattr(f, "loader", None) is not None for f in compiled.COMPILED.values())


# ---- the GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_plans_are_not_packaged_while_cuda_packages_are_off(tmp_path: Path, rng: np.random.Generator,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """aoti_cache.CUDA_PACKAGES is off (the loader crashed on an H200): a CUDA plan compiles
    in process, agrees with the reference, and persist() keeps nothing."""
    if aoti_cache.CUDA_PACKAGES:
        pytest.skip("CUDA packages are on: the tests below cover them")
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)
    monkeypatch.setattr(compiled, "COMPILED", {})
    plan = check(region_graph(), "cuda:0", rng, TOL[DT.FLOAT], persist=False)
    assert plan.persist() == "" and packages(tmp_path) == []


def _cuda_packages() -> None:
    if not aoti_cache.CUDA_PACKAGES:
        pytest.skip("aoti_cache.CUDA_PACKAGES is off: the C++ loader crashed on a CUDA package on an H200 "
                    "(torch 2.11); these tests say what must hold before it is turned on")


@pytest.mark.gpu
def test_gpu_a_new_process_loads_the_package_without_dynamo(cache_dir: Path, tmp_path: Path,
                                                            rng: np.random.Generator) -> None:
    _cuda_packages()
    compiled.COMPILED.clear()
    g = region_graph()
    check(g, "cuda:0", rng, TOL[DT.FLOAT])  # compiled and kept here
    pack = random_pack(g, rng)
    imported, got = run_child("cuda:0", tmp_path, pack)
    assert imported == {"torch._dynamo": False, "torch._inductor": False}, imported
    assert_close(got, g.execute(pack, engine="reference")["out0"], TOL[DT.FLOAT], "out0 (new process, GPU)")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF])
def test_gpu_a_loaded_package_replays_in_a_cuda_graph(dt: DT, cache_dir: Path, rng: np.random.Generator) -> None:
    """The package runs on the caller's current stream: captured in a CUDA graph (on the
    side stream torch.cuda.graph captures on, thread_local mode, as regions/plan.py does),
    then replayed on inputs written after the capture, against the eager plan."""
    _cuda_packages()
    from fusegraph.regions.plan import RegionPlan, fusegraph_step

    g = region_graph(dt, name=f"region_graph_{dt.name}")
    compiled.COMPILED.clear()
    ENGINE.build(g, fg.Handle("cuda:0"), COMPILE).persist()  # compiled and kept
    compiled.COMPILED.clear()
    plan = ENGINE.build(g, fg.Handle("cuda:0"), COMPILE)  # loaded from the cache
    assert any(getattr(f, "loader", None) is not None for f in compiled.COMPILED.values())
    eager = ENGINE.build(g, fg.Handle("cuda:0"), EngineConfig("torch", (("cuda_graph", False),)))
    names = [t.name for t in g.inputs()]
    region = RegionPlan([fusegraph_step("r0", plan, names, ["out0"])], ["out0"])

    def fresh() -> dict[str, Any]:
        return {n: torch.from_numpy(v).cuda() for n, v in random_pack(g, rng).items()}

    why = region.capture(fresh())
    assert why == "", why
    for _ in range(3):
        values = fresh()
        got = region.execute(values)["out0"]
        want = eager.execute(values)["out0"]
        torch.cuda.synchronize()
        assert_close(got.float().cpu().numpy(), want.float().cpu().numpy(), 1e-5 if dt == DT.FLOAT else 1e-2,
                     "replayed vs eager")
        ref = g.execute({k: v.cpu().numpy() for k, v in values.items()}, engine="reference")["out0"]
        assert_close(got.float().cpu().numpy(), ref, TOL[dt], "replayed vs reference")
    side = torch.cuda.Stream()
    values = fresh()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # uncaptured, on another stream: its work is ordered on that stream
        got = plan.execute(values)["out0"]
        want = eager.execute(values)["out0"]
    side.synchronize()
    assert_close(got.float().cpu().numpy(), want.float().cpu().numpy(), 1e-5 if dt == DT.FLOAT else 1e-2,
                 "on a side stream")

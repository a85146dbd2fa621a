"""IREE runtime side: handles, Buffers (NumPy/DLPack), device-resident execution with no
host round trip, artifacts, and a clean interpreter exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fusegraph as fg
from fusegraph import DataType
from fusegraph.engines.iree import IreeEngine, compile_to_artifact, load_artifact, read_artifact
from fusegraph.engines.iree.runtime import IreeRuntime, runtime_for
from fusegraph.graph import layout
from fusegraph.reference.executor import run_reference
from fusegraph.runtime.handle import Device, parse_device

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache_dir(iree_cache_dir: Path) -> None:
    """Every test here on the module's own compile cache (conftest.iree_cache_dir)."""


def rel_err(out: Any, ref: Any) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(o).any()
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def chain(name: str = "chain", shape: tuple[int, ...] = (8, 32)) -> fg.Graph:
    g = fg.Graph(name, io_data_type="float")
    a, b = g.tensor("a", shape), g.tensor("b", shape)
    g.tanh(g.mul(g.relu(g.add(a, b)), b)).set_output(True).set_name("y")
    return g.validate()


def nhwc_scale(shape: tuple[int, int, int, int] = (2, 8, 5, 5)) -> fg.Graph:
    """y = x * s + x with x NHWC-strided and s a broadcast [1, C, 1, 1] per-channel scale."""
    g = fg.Graph("nhwc_scale", io_data_type="float")
    x = g.tensor("x", shape, fg.strides_for(shape, "NHWC"))
    s = g.tensor("s", [1, shape[1], 1, 1], fg.strides_for([1, shape[1], 1, 1], "NHWC"))
    g.add(g.mul(x, s), x).set_output(True).set_name("y")
    return g.validate()


# ---- handles ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "device"),
    [("cpu", Device("cpu", 0)), ("cuda", Device("cuda", 0)), ("cuda:1", Device("cuda", 1)), ("HIP:2", Device("hip", 2)), (" cpu ", Device("cpu", 0))],
)
def test_handle_parsing(spec: str, device: Device) -> None:
    assert parse_device(spec) == device
    assert fg.Handle(spec).device == device
    assert fg.Handle(spec) == fg.Handle(str(device))


@pytest.mark.parametrize("bad", ["gpu0", "cuda:-1", "tpu", "cuda:x", ""])
def test_bad_handle_specs(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        fg.Handle(bad)


def test_runtime_is_shared_per_device() -> None:
    h1, h2 = fg.Handle("cpu"), fg.Handle("cpu")
    rt = runtime_for(h1)
    assert isinstance(rt, IreeRuntime) and rt is runtime_for(h2)
    assert h1.state["iree"] is rt and rt.driver_name == "local-task"


def test_missing_gpu_is_an_unsupported_error() -> None:
    with pytest.raises(fg.UnsupportedError, match="cuda:5"):
        runtime_for(fg.Handle("cuda:5"))


# ---- buffers --------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [np.float32, np.float16, "bfloat16", np.int32, np.int8, np.bool_, np.float64])
def test_buffer_round_trip(dt: Any, rng: np.random.Generator) -> None:
    dtype = np.dtype(fg.as_data_type(dt).numpy)
    arr = (rng.standard_normal((3, 5, 7)) * 10).astype(dtype)
    b = fg.Buffer.from_numpy(arr, "cpu")
    assert b.shape == (3, 5, 7) and b.dtype == dtype and b.device == "cpu"
    assert b.nbytes == arr.nbytes
    back = b.to_numpy()
    assert back.dtype == dtype and np.array_equal(back, arr)
    arr[...] = 0  # the Buffer holds a copy
    assert np.array_equal(b.to_numpy(), back)


def test_buffer_keeps_an_nhwc_view_layout(rng: np.random.Generator) -> None:
    dense = rng.standard_normal((2, 5, 5, 8)).astype(np.float32)  # memory order N, H, W, C
    logical = dense.transpose(0, 3, 1, 2)  # dims N, C, H, W with NHWC strides
    b = fg.Buffer.from_numpy(logical)
    assert b.shape == (2, 8, 5, 5) and b.strides == fg.strides_for([2, 8, 5, 5], "NHWC")
    assert b.physical_shape == (2, 5, 5, 8)
    out = b.to_numpy()
    assert np.array_equal(out, logical) and out.strides == logical.strides


def test_buffer_for_a_tensor_relayouts(rng: np.random.Generator) -> None:
    g = nhwc_scale()
    x = g.tensor_by_name("x")
    arr = rng.standard_normal(x.shape).astype(np.float32)  # row-major NCHW data
    b = fg.Buffer.from_numpy(arr, "cpu", tensor=x)
    assert b.strides == x.strides and np.array_equal(b.to_numpy(), arr)
    with pytest.raises(fg.VariantPackError, match="shape"):
        fg.Buffer.from_numpy(arr[:1], "cpu", tensor=x)
    with pytest.raises(fg.VariantPackError, match="dtype"):
        fg.Buffer.from_numpy(arr.astype(np.float16), "cpu", tensor=x)


def aligned(shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
    """An uninitialized array whose data starts ``offset`` bytes past a 64-byte boundary."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = np.empty(n + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    return raw[start : start + n].view(dt).reshape(shape)


def test_dlpack_import_aliases_contiguous_host_memory(rng: np.random.Generator) -> None:
    arr = aligned((4, 6), np.float32)
    arr[...] = rng.standard_normal((4, 6))
    b = fg.Buffer.from_dlpack(arr, "cpu")
    arr[0, 0] = 123.0  # zero copy: the Buffer sees the change
    assert b.to_numpy()[0, 0] == 123.0
    odd = aligned((4, 6), np.float32, offset=4)  # IREE needs 64-byte alignment: copied
    odd[...] = 1.0
    bo = fg.Buffer.from_dlpack(odd, "cpu")
    odd[...] = 2.0
    assert np.all(bo.to_numpy() == 1.0)
    t = arr.T  # not row-major: copied
    bt = fg.Buffer.from_dlpack(t, "cpu")
    assert bt.shape == (6, 4) and np.array_equal(bt.to_numpy(), t)
    with pytest.raises(TypeError, match="DLPack"):
        fg.Buffer.from_dlpack([1, 2, 3], "cpu")


def test_dlpack_import_from_torch(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch", reason="torch is optional (fusegraph[torch])")
    t = torch.from_numpy(aligned((3, 4), np.float32))
    t[...] = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    b = fg.Buffer.from_dlpack(t, "cpu")
    t[1, 1] = -7.0
    assert b.to_numpy()[1, 1] == -7.0 and b.data_type == DataType.FLOAT


# ---- execution with buffers -------------------------------------------------------------------
class _NoHostTraffic:
    """Fails the test if the runtime moves data between host and device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rt: IreeRuntime) -> None:
        def fail(*_a: Any, **_k: Any) -> None:
            raise AssertionError("host round trip")

        monkeypatch.setattr(rt, "upload", fail)
        monkeypatch.setattr(rt, "download", fail)


def test_buffers_in_and_out_with_no_host_round_trip(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    h = fg.Handle("cpu")
    g1, g2 = chain("first"), chain("second")
    e = IreeEngine()
    p1, p2 = e.build(g1, h), e.build(g2, h)
    A, B = (rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2))
    bA, bB = fg.Buffer.from_numpy(A, h), fg.Buffer.from_numpy(B, h)
    with monkeypatch.context() as m:
        _NoHostTraffic(m, runtime_for(h))
        y1 = p1.execute({"a": bA, "b": bB})["y"]
        assert isinstance(y1, fg.Buffer)
        y2 = p2.execute({"a": y1, "b": bB})["y"]  # plan 1's output feeds plan 2 on the device
        (y3,) = p1.run_buffers([y2, bB])
    r1 = run_reference(g1, {"a": A, "b": B})["y"]
    r2 = run_reference(g2, {"a": r1.astype(np.float32), "b": B})["y"]
    r3 = run_reference(g1, {"a": r2.astype(np.float32), "b": B})["y"]
    assert rel_err(y2.to_numpy(), r2) < 1e-5
    assert rel_err(y3.to_numpy(), r3) < 1e-5


def test_output_buffer_destinations(rng: np.random.Generator) -> None:
    h = fg.Handle("cpu")
    g = chain()
    plan = IreeEngine().build(g, h)
    A, B = (rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2))
    ref = run_reference(g, {"a": A, "b": B})["y"]
    dest = fg.Buffer.empty(g.tensor_by_name("y"), h)  # owned: rebound to the result
    assert plan.execute({"a": A, "b": B, "y": dest}) == {}
    assert rel_err(dest.to_numpy(), ref) < 1e-5
    host = aligned((8, 32), np.float32)
    host[...] = 0
    wrapped = fg.Buffer.from_dlpack(host, h)  # someone else's memory: written on the device
    plan.execute({"a": fg.Buffer.from_numpy(A, h), "b": fg.Buffer.from_numpy(B, h), "y": wrapped})
    assert rel_err(host, ref) < 1e-5


def test_as_buffers_switch_and_mixed_inputs(rng: np.random.Generator) -> None:
    h = fg.Handle("cpu")
    g = chain()
    plan = IreeEngine().build(g, h)
    A, B = (rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2))
    ref = run_reference(g, {"a": A, "b": B})["y"]
    out = plan.execute({"a": A, "b": fg.Buffer.from_numpy(B, h)})["y"]
    assert isinstance(out, fg.Buffer) and rel_err(out.to_numpy(), ref) < 1e-5
    out = plan.execute({"a": A, "b": B}, as_buffers=True)["y"]
    assert isinstance(out, fg.Buffer)
    out = plan.execute({"a": fg.Buffer.from_numpy(A, h), "b": fg.Buffer.from_numpy(B, h)}, as_buffers=False)["y"]
    assert isinstance(out, np.ndarray) and rel_err(out, ref) < 1e-5


def test_identity_output_never_aliases_the_input(rng: np.random.Generator) -> None:
    g = fg.Graph("ident", io_data_type="float")
    g.identity(g.tensor("a", [64, 16])).set_output(True).set_name("y")
    g.validate()
    plan = IreeEngine().build(g, fg.Handle("cpu"))
    a = rng.standard_normal((64, 16)).astype(np.float32)
    y = plan.execute({"a": a})["y"]
    assert np.array_equal(y, a) and not np.shares_memory(y, a)
    a[0, 0] = 5.0
    assert y[0, 0] != 5.0


def test_strided_and_broadcast_buffers(rng: np.random.Generator) -> None:
    h = fg.Handle("cpu")
    g = nhwc_scale()
    plan = IreeEngine().build(g, h)
    xt, st = g.tensor_by_name("x"), g.tensor_by_name("s")
    x = rng.standard_normal(xt.shape).astype(np.float32)
    s = rng.standard_normal(st.shape).astype(np.float32)
    ref = run_reference(g, {"x": x, "s": s})["y"]
    y = plan.execute({"x": fg.Buffer.from_numpy(x, h, xt), "s": fg.Buffer.from_numpy(s, h, st)})["y"]
    assert y.strides == g.tensor_by_name("y").strides and rel_err(y.to_numpy(), ref) < 1e-5
    with pytest.raises(fg.VariantPackError, match="strides"):
        plan.execute({"x": fg.Buffer.from_numpy(x, h), "s": fg.Buffer.from_numpy(s, h, st)})  # row-major x


def test_buffer_of_the_wrong_type_or_shape(rng: np.random.Generator) -> None:
    h = fg.Handle("cpu")
    plan = IreeEngine().build(chain(), h)
    A = rng.standard_normal((8, 32)).astype(np.float32)
    with pytest.raises(fg.VariantPackError, match="HALF"):
        plan.execute({"a": fg.Buffer.from_numpy(A.astype(np.float16), h), "b": A})
    with pytest.raises(fg.VariantPackError, match="shape"):
        plan.execute({"a": fg.Buffer.from_numpy(A[:4], h), "b": A})


# ---- artifacts ------------------------------------------------------------------------------------
def test_artifact_round_trip(rng: np.random.Generator) -> None:
    g = chain("artifact")
    data = compile_to_artifact(g, "cpu", opt_level="O3")
    header, _vmfb = read_artifact(data)
    assert header["target"] == "cpu" and "--iree-opt-level=O3" in header["flags"]
    assert [i["name"] for i in header["inputs"]] == ["a", "b"] and header["outputs"][0]["buffer_shape"] == [8, 32]
    assert fg.Graph.from_json(header["graph"]).key() == g.key()
    plan = load_artifact(data, fg.Handle("cpu"))
    A, B = (rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2))
    assert rel_err(plan.execute({"a": A, "b": B})["y"], run_reference(g, {"a": A, "b": B})["y"]) < 1e-5
    again = load_artifact(plan.serialize(), "cpu")
    assert again.key == plan.key
    assert g.compile_to_artifact("cpu", opt_level="O3") == data  # Graph's delegate; the cache makes it identical


def test_damaged_artifacts_are_refused() -> None:
    data = compile_to_artifact(chain("artifact"), "cpu")
    with pytest.raises(fg.ValidationError, match="magic"):
        load_artifact(b"not an artifact at all")
    with pytest.raises(fg.ValidationError, match="truncated"):
        load_artifact(data[:-10])


def test_gpu_artifact_compiles_here_but_needs_a_gpu_to_load() -> None:
    data = compile_to_artifact(chain("for_gpu"), "cuda")
    header, _ = read_artifact(data)
    assert header["target"] == "cuda" and "--iree-cuda-target=sm_80" in header["flags"]
    with pytest.raises(fg.UnsupportedError, match="cannot run on cpu"):
        load_artifact(data, "cpu")


# ---- process exit ------------------------------------------------------------------------------------
EXIT_SCRIPT = """
import numpy as np, fusegraph as fg
from fusegraph.engines.iree import IreeEngine
g = fg.Graph("exit", io_data_type="float")
a = g.tensor("a", [4, 4]); g.relu(a).set_output(True).set_name("y"); g.validate()
plan = IreeEngine().build(g, fg.Handle("cpu"))
KEEP_BUF = plan.execute({"a": fg.Buffer.from_numpy(np.ones((4, 4), np.float32))})["y"]  # default handle
KEEP_ARR = plan.execute({"a": np.ones((4, 4), np.float32)})["y"]
print("ok", float(KEEP_BUF.to_numpy().sum()), float(KEEP_ARR.sum()))
"""


def test_interpreter_exits_cleanly_with_live_results(shared_cache: Path) -> None:
    """IREE 3.13's bindings crash at exit when a result buffer outlives its device; the
    runtime releases tracked Buffers first (see runtime.track)."""
    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": str(shared_cache), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stdout.strip() == "ok 16.0 16.0"
    assert "leaked" not in proc.stderr


def test_physical_helpers_agree_with_buffers(rng: np.random.Generator) -> None:
    dims, strides = (2, 3, 4, 5), fg.strides_for([2, 3, 4, 5], "NHWC")
    arr = layout.from_physical(rng.standard_normal((2, 4, 5, 3)).astype(np.float32), dims, strides)
    b = fg.Buffer.from_numpy(arr)
    assert b.physical_shape == layout.physical_shape(dims, strides) and tuple(b.view.shape) == (2, 4, 5, 3)

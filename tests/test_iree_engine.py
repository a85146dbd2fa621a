"""The IREE engine (part B: compile, knobs, fusion evidence, errors) on the CPU.

Numbers are checked against the float64 reference engine on fresh random data. Graphs
are lowered by the real emitter (fusegraph/engines/iree/emit.py) unless a test says why
it uses the tiny fake one (tests/_iree_fake_emit.py) or hand-written MLIR.
"""

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
from fusegraph.engines.base import Engine, EngineConfig
from fusegraph.engines.iree import IreeEngine, IreePlan
from fusegraph.engines.iree import compile as iree_compile
from fusegraph.engines.iree.flags import (
    DEFAULTS,
    FlagSet,
    default_flagset,
    flag_knobs,
    flagset_from_knobs,
)
from fusegraph.engines.iree.targets import TARGETS, host_cpu_id, parse_target, target_for_device
from fusegraph.graph import layout
from fusegraph.reference.executor import run_reference
from fusegraph.runtime.handle import Device

sys.path.insert(0, str(Path(__file__).parent))
from _iree_fake_emit import FakeEmitted, fake_emit

TOL = {DataType.FLOAT: 1e-5, DataType.HALF: 1e-2, DataType.BFLOAT16: 2e-2}


@pytest.fixture(autouse=True)
def _cache_dir(iree_cache_dir: Path) -> None:
    """Every test here on the module's own compile cache (conftest.iree_cache_dir)."""


def assert_close(out: Any, ref: np.ndarray, dt: DataType) -> None:
    out64, ref64 = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out64.shape == ref64.shape
    assert not np.isnan(out64).any(), "NaN in output"
    rel = np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30)
    max_abs = float(np.max(np.abs(out64 - ref64))) if out64.size else 0.0
    assert rel <= TOL[dt], f"relative error {rel:.3g} > {TOL[dt]} (max abs {max_abs:.3g})"


def random_inputs(g: fg.Graph, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Fresh random values for every input, as logical views with the declared strides."""
    out = {}
    for t in g.inputs():
        phys = layout.physical_shape(t.shape, t.strides)
        dense = (rng.standard_normal(phys) * scale).astype(t.dtype.numpy)
        view = layout.from_physical(dense, t.shape, t.strides)
        out[t.name] = np.broadcast_to(view, t.shape) if view.shape != t.shape else view
    return out


def chain_graph(n: int = 6, dt: str = "float", shape: tuple[int, ...] = (32, 256)) -> fg.Graph:
    """A pointwise chain of n ops over two inputs (add, mul, relu, tanh, sigmoid, sub...)."""
    g = fg.Graph(f"chain{n}", io_data_type=dt, compute_data_type="float")
    a, b = g.tensor("a", shape), g.tensor("b", shape)
    y = a
    ops = [lambda v: g.add(v, b), lambda v: g.relu(v), lambda v: g.mul(v, b), g.tanh, g.sigmoid, lambda v: g.sub(v, a)]
    for i in range(n):
        y = ops[i % len(ops)](y)
    y.set_output(True).set_name("y")
    return g.validate()


def cbr_graph(lay: str = "NHWC", filt: str | None = None, k: int = 3, c: int = 16, hw: int = 12) -> fg.Graph:
    """conv (k x k, same padding) + bias + ReLU with activations in layout ``lay``."""
    g = fg.Graph(f"cbr_{lay}_{filt}_{k}", io_data_type="float")
    x = g.tensor("x", [1, c, hw, hw], fg.strides_for([1, c, hw, hw], lay))
    wdims = [c, c, k, k]
    if filt == "HWCF":  # memory order R, S, C, K: what linalg.conv_2d_nhwc_hwcf reads as is
        ws = layout.packed_strides(wdims, (2, 3, 1, 0))
    else:
        ws = fg.strides_for(wdims, "KRSC" if lay == "NHWC" else "KCRS")
    w = g.tensor("w", wdims, ws)
    b = g.tensor("b", [1, c, 1, 1], fg.strides_for([1, c, 1, 1], lay))
    p = (k - 1) // 2
    y = g.relu(g.bias(g.conv_fprop(x, w, padding=[p, p]), b))
    y.set_output(True).set_name("y")
    return g.validate()


# ---- engine protocol ------------------------------------------------------------------------
def test_engine_protocol_and_version() -> None:
    e = IreeEngine()
    assert isinstance(e, Engine)
    assert e.name == "iree"
    assert fg.__version__ in e.version and "iree3.13" in e.version
    assert e.available()


def test_supports_cpu_and_says_why_not_for_a_missing_gpu() -> None:
    e = IreeEngine()
    g = chain_graph(2)
    assert e.supports(g, fg.Handle("cpu"))
    sup = e.supports(g, fg.Handle("cuda:7"))  # no 8th NVIDIA GPU here (nor on the H200 box)
    assert not sup and "cuda:7" in sup.reason


def test_knobs_are_flag_knobs_plus_emit_options() -> None:
    e = IreeEngine()
    g = cbr_graph()  # a padded conv: every knob but attention/norm_variance/round_intermediates applies
    knobs = {k.name: k for k in e.knobs(g, fg.Handle("cpu"))}
    for name in ("opt_level", "data_tiling", "ukernels", "aggressive_fusion", "fuse_padding", "extra_flags", "conv_layout"):
        assert name in knobs, name
    # a pointwise chain: only the knobs that can change its module (autotune times each setting)
    assert {k.name for k in e.knobs(chain_graph(2), fg.Handle("cpu"))} == {"opt_level", "aggressive_fusion", "extra_flags"}
    cpu = DEFAULTS["cpu"]
    assert knobs["opt_level"].default == cpu.opt_level and "O3" in knobs["opt_level"].choices
    assert knobs["data_tiling"].default is cpu.data_tiling
    assert set(knobs["conv_layout"].choices) == {"nhwc", "nchw"}


def test_unknown_or_bad_knob_is_refused() -> None:
    e, g, h = IreeEngine(), chain_graph(2), fg.Handle("cpu")
    with pytest.raises(fg.UnsupportedError, match="no knob 'bogus'"):
        e.build(g, h, EngineConfig("iree", (("bogus", 1),)))
    with pytest.raises(ValueError, match="opt_level"):
        e.build(g, h, EngineConfig("iree", (("opt_level", "O9"),)))


# ---- flags and targets --------------------------------------------------------------------------
def test_flagset_renders_iree_flags() -> None:
    cpu, cuda, hip = TARGETS["cpu"], TARGETS["cuda"], TARGETS["hip"]
    f = FlagSet(opt_level="O3", data_tiling=True, ukernels="mmt4d", fuse_padding=True, extra_flags=("--foo",)).flags(cpu)
    assert f[:4] == (
        "--iree-input-type=torch",
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=host",
    )
    assert "--iree-opt-level=O3" in f and "--iree-opt-data-tiling=true" in f
    assert "--iree-llvmcpu-enable-ukernels=mmt4d" in f and f[-1] == "--foo"
    assert "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops" in f
    g = FlagSet(ukernels="all").flags(cuda)
    assert "--iree-cuda-target=sm_80" in g and not any("ukernels" in x for x in g)
    assert "--iree-rocm-target=gfx942" in FlagSet().flags(hip)
    assert "ukernels" not in {k.name for k in flag_knobs(cuda)}


def test_flagset_from_knobs_checks_and_defaults() -> None:
    cpu = TARGETS["cpu"]
    assert flagset_from_knobs(cpu, {}) == default_flagset(cpu)
    fs = flagset_from_knobs(cpu, {"opt_level": "O1", "extra_flags": "--a --b", "conv_layout": "nchw"})
    assert fs.opt_level == "O1" and fs.extra_flags == ("--a", "--b")
    with pytest.raises(ValueError):
        flagset_from_knobs(cpu, {"ukernels": "everything"})


def test_target_table() -> None:
    assert parse_target("cpu") is TARGETS["cpu"]
    assert parse_target("cuda").arch == "sm_80"  # IREE 3.13 has no sm_90: one place to change
    assert parse_target("cuda:sm_86").arch == "sm_86" and parse_target("cuda:sm_86").driver == "cuda"
    assert parse_target("cuda:0") is TARGETS["cuda"]  # a device index, not an arch
    assert parse_target("hip:gfx90a").flags()[-1] == "--iree-rocm-target=gfx90a"
    assert parse_target("rocm").kind == "hip" and parse_target("cpu:znver4").spec == "cpu:znver4"
    with pytest.raises(ValueError, match="unknown IREE target"):
        parse_target("tpu")
    assert target_for_device(Device("cuda", 3)).driver == "cuda"
    assert TARGETS["cpu"].cache_identity() == f"cpu:host[{host_cpu_id()}]"
    assert parse_target("cpu:x86-64-v3").cache_identity() == "cpu:x86-64-v3"


# ---- building and running -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", ["float", "half", "bfloat16"])
def test_pointwise_chain_matches_reference(dt: str, rng: np.random.Generator) -> None:
    g = chain_graph(6, dt)
    plan = IreeEngine().build(g, fg.Handle("cpu"))
    assert isinstance(plan, IreePlan)
    ins = random_inputs(g, rng)
    out = plan.execute(ins)["y"]
    assert out.dtype == g.tensor_by_name("y").dtype.numpy
    ref = run_reference(g, ins)["y"]
    assert_close(out, ref, g.tensor_by_name("y").dtype)


@pytest.mark.parametrize("lay", ["NCHW", "NHWC"])
def test_conv_bias_relu_matches_reference(lay: str, rng: np.random.Generator) -> None:
    g = cbr_graph(lay)
    plan = IreeEngine().build(g, fg.Handle("cpu"))
    ins = random_inputs(g, rng, 0.5)
    out = plan.execute(ins)["y"]
    y = g.tensor_by_name("y")
    assert out.shape == y.shape and layout.element_strides(out.shape, out.strides, out.itemsize) == y.strides
    assert_close(out, run_reference(g, ins)["y"], DataType.FLOAT)


def test_graph_execute_with_engine_name(rng: np.random.Generator) -> None:
    g = chain_graph(3)
    ins = random_inputs(g, rng)
    out = g.execute(ins, engine="iree")
    assert_close(out["y"], run_reference(g, ins)["y"], DataType.FLOAT)
    assert any(isinstance(p, IreePlan) for p in g.plans.values())


def test_written_in_place_output_and_returned_ones(rng: np.random.Generator) -> None:
    g = fg.Graph("two_outputs", io_data_type="float")
    a, b = g.tensor("a", [8, 64]), g.tensor("b", [8, 64])
    s = g.add(a, b).set_output(True).set_name("s")
    g.relu(s).set_output(True).set_name("r")
    g.validate()
    plan = IreeEngine().build(g, fg.Handle("cpu"))
    ins = random_inputs(g, rng)
    dest = np.full((8, 64), np.nan, np.float32)
    out = plan.execute({**ins, "s": dest})
    ref = run_reference(g, ins)
    assert set(out) == {"r"}
    assert_close(dest, ref["s"], DataType.FLOAT)
    assert_close(out["r"], ref["r"], DataType.FLOAT)


def test_bad_packs_raise_variant_pack_errors(rng: np.random.Generator) -> None:
    g = chain_graph(2)
    plan = IreeEngine().build(g, fg.Handle("cpu"))
    ins = random_inputs(g, rng)
    with pytest.raises(fg.VariantPackError, match="missing input"):
        plan.execute({"a": ins["a"]})
    with pytest.raises(fg.VariantPackError, match="dtype"):
        plan.execute({"a": ins["a"].astype(np.float64), "b": ins["b"]})
    with pytest.raises(fg.VariantPackError, match="no tensor of this name"):
        plan.execute({**ins, "nope": ins["a"]})
    other = chain_graph(2)
    with pytest.raises(fg.VariantPackError, match="another graph"):
        plan.execute({other.tensor_by_name("a"): ins["a"], "b": ins["b"]})
    with pytest.raises(fg.VariantPackError, match="mapping"):
        plan.execute([ins["a"]])  # type: ignore[arg-type]


def test_runtime_failure_raises_execution_error(rng: np.random.Generator) -> None:
    """A buffer of the wrong size smuggled past the checks: IREE's own shape assertion fires."""
    g = chain_graph(2)
    h = fg.Handle("cpu")
    plan = IreeEngine().build(g, h)
    ins = random_inputs(g, rng)
    bad = fg.Buffer.from_numpy(ins["a"], h)
    bad._view = fg.Buffer.from_numpy(np.zeros((3, 3), np.float32), h).view
    with pytest.raises(fg.ExecutionError, match="IREE failed running graph"):
        plan.execute({"a": bad, "b": fg.Buffer.from_numpy(ins["b"], h)})


# ---- fusion evidence ------------------------------------------------------------------------------
def test_pointwise_chain_is_one_dispatch() -> None:
    plan = IreeEngine().build(chain_graph(6), fg.Handle("cpu"))
    stats = plan.statistics
    assert plan.dispatch_count == 1, stats
    assert len(stats["dispatches"]) == 1 and "elementwise" in stats["dispatches"][0]


def test_conv_bias_relu_is_one_conv_dispatch() -> None:
    """Bias and ReLU fuse into the convolution's dispatch (IREE names a dispatch after its
    root op: a conv dispatch and no elementwise one). The only other dispatches allowed
    are data movement the emitter asks for (filter transpose, padding copy)."""
    plan = IreeEngine().build(cbr_graph("NHWC"), fg.Handle("cpu"))
    names = plan.statistics["dispatches"]
    assert sum("conv" in n for n in names) == 1, names
    assert not any("elementwise" in n or "generic" in n for n in names), names
    assert all("conv" in n or "transpose" in n or "memcpy" in n for n in names), names


def test_conv_bias_relu_single_dispatch_with_hwcf_filter_and_fused_padding(rng: np.random.Generator) -> None:
    """With the filter already in HWCF memory order and padding fused (knob), the whole
    graph is exactly one dispatch."""
    g = cbr_graph("NHWC", filt="HWCF")
    plan = IreeEngine().build(g, fg.Handle("cpu"), EngineConfig("iree", (("fuse_padding", True),)))
    assert plan.dispatch_count == 1, plan.statistics
    ins = random_inputs(g, rng, 0.5)
    assert_close(plan.execute(ins)["y"], run_reference(g, ins)["y"], DataType.FLOAT)


def test_statistics_are_kept_in_the_cache_entry() -> None:
    plan = IreeEngine().build(chain_graph(6), fg.Handle("cpu"))
    assert plan.entry.path is not None
    import json

    raw = json.loads((plan.entry.path / "stats.json").read_text())
    assert raw["stream-aggregate"]["execution"]["dispatch-count"] == 1
    manifest = json.loads((plan.entry.path / "manifest.json").read_text())
    assert manifest["meta"]["statistics"]["dispatch_count"] == 1


# ---- compile errors ------------------------------------------------------------------------------
def _broken_emitter(graph: fg.Graph, func_name: str = "main", options: Any = None) -> FakeEmitted:
    """Valid torch IR that IREE cannot lower: an op torch-mlir does not know."""
    good = fake_emit(graph, func_name, options)
    text = good.text.replace("torch.aten.relu %", 'torch.operator "torch.aten.no_such_op"(%', 1)
    text = text.replace(") : !torch.vtensor", ") : !torch.vtensor", 1)
    lines = []
    for line in text.splitlines():
        if "no_such_op" in line:  # generic form: (%x) : (T) -> T
            lhs, ty = line.split(" : ", 1)
            src, dst = ty.split(" -> ")
            line = f"{lhs}) : ({src}) -> {dst}"
        lines.append(line)
    return FakeEmitted("\n".join(lines) + "\n", good.func_name, good.inputs, good.outputs, good.input_shapes, good.output_shapes)


_broken_emitter.version = "broken-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["inprocess", "cli"])
def test_compile_error_keeps_a_reproducer_that_reproduces(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_IREE_COMPILER", backend)
    g = fg.Graph(f"broken_{backend}", io_data_type="float")
    a = g.tensor("a", [4, 8])
    g.relu(a).set_output(True).set_name("y")
    g.validate()
    with pytest.raises(fg.CompileError) as info:
        IreeEngine(emitter=_broken_emitter).build(g, fg.Handle("cpu"))
    err = info.value
    assert "failed to legalize" in err.diagnostic and "no_such_op" in err.diagnostic
    repro = err.reproducer
    assert repro is not None and str(repro) in str(err)
    assert repro.parent.name == "failures" and repro.parent.parent == Path(os.environ["FUSEGRAPH_CACHE_DIR"])
    for name in ("module.mlir", "flags.txt", "diagnostic.txt", "repro.sh", "graph.json"):
        assert (repro / name).exists(), name
    assert "--iree-input-type=torch" in (repro / "flags.txt").read_text()
    proc = subprocess.run(["sh", str(repro / "repro.sh")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "failed to legalize operation 'torch.operator'" in proc.stderr
    assert "iree-compile" in (repro / "repro.sh").read_text()


def test_emitter_breaking_the_boundary_is_a_compile_error() -> None:
    def wrong_shapes(graph: fg.Graph, func_name: str = "main", options: Any = None) -> FakeEmitted:
        e = fake_emit(graph, func_name, options)
        return FakeEmitted(e.text, e.func_name, e.inputs, e.outputs, ((1, 2),) * len(e.inputs), e.output_shapes)

    with pytest.raises(fg.CompileError, match="boundary convention"):
        IreeEngine(emitter=wrong_shapes).build(chain_graph(2), fg.Handle("cpu"))


# ---- the compiler itself ------------------------------------------------------------------------
HAND_WRITTEN = """
func.func @main(%a: !torch.vtensor<[4,8],f32>, %b: !torch.vtensor<[4,8],f32>) -> !torch.vtensor<[4,8],f32> {
  %int1 = torch.constant.int 1
  %0 = torch.aten.add.Tensor %a, %b, %int1 : !torch.vtensor<[4,8],f32>, !torch.vtensor<[4,8],f32>, !torch.int -> !torch.vtensor<[4,8],f32>
  %1 = torch.aten.relu %0 : !torch.vtensor<[4,8],f32> -> !torch.vtensor<[4,8],f32>
  return %1 : !torch.vtensor<[4,8],f32>
}
"""


def test_inprocess_and_cli_compilers_agree() -> None:
    flags = default_flagset(TARGETS["cpu"]).flags(TARGETS["cpu"])
    a = iree_compile.compile_mlir(HAND_WRITTEN, flags, backend="inprocess")
    b = iree_compile.compile_mlir(HAND_WRITTEN, flags, backend="cli")
    assert a.backend == "inprocess" and b.backend == "cli"
    assert a.summary["dispatch_count"] == b.summary["dispatch_count"] == 1
    assert a.vmfb[:8] == b.vmfb[:8] and len(a.vmfb) > 1000


def test_parse_error_and_bad_flag_are_reported() -> None:
    flags = TARGETS["cpu"].flags()
    with pytest.raises(iree_compile.IreeCompileFailure) as info:
        iree_compile.compile_mlir(HAND_WRITTEN.replace("relu %0", "relu %9"), flags, backend="inprocess")
    assert "undeclared SSA value" in info.value.diagnostic
    with pytest.raises(iree_compile.IreeCompileFailure, match="flags"):
        iree_compile.compile_mlir(HAND_WRITTEN, [*flags, "--no-such-iree-flag"], backend="inprocess")


def test_compile_for_gpu_targets_here() -> None:
    """CUDA (sm_80 PTX) and HIP (gfx942) modules compile on this CPU-only machine."""
    for spec in ("cuda", "hip"):
        t = parse_target(spec)
        r = iree_compile.compile_mlir(HAND_WRITTEN, default_flagset(t).flags(t))
        assert r.summary["dispatch_count"] == 1 and len(r.vmfb) > 1000

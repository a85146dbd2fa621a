"""Layer and RMS norm backward on the Triton engine (engines/triton/norm_backward.py).

CPU: which graphs the kernel pair takes and the reason for each refusal, the generated
text (deterministic column sums: no atomics), and -- where Triton is importable -- the
generated kernels run by Triton's interpreter (TRITON_INTERPRET=1) against the float64
reference. GPU (``pytest -m gpu tests/test_triton_backward.py`` on the GPU machine): the
built plans against the float64 reference, f32/f16/bf16, every knob setting agreeing, and
repeated runs giving the same bits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from engine_fakes import rel_error

import fusegraph as fg
from fusegraph import DataType as DT
from fusegraph.engines.base import EngineConfig
from fusegraph.engines.triton import TritonEngine
from fusegraph.engines.triton.norm_backward import (
    ROW_KERNEL,
    SUM_KERNEL,
    analyze_norm_backward,
    default_tiling,
    norm_backward_source,
    sum_programs,
    workspace_floats,
)
from fusegraph.engines.triton.rows import Access, Refusal
from fusegraph.engines.unsupported import declared_unsupported
from fusegraph.reference.inputs import random_inputs

ENGINE = TritonEngine()
GPU = fg.Handle("cuda:0")
TOL = {DT.FLOAT: 1e-4, DT.HALF: 1e-2, DT.BFLOAT16: 2e-2}  # norms: 1e-4 in f32 (means cancel)


def norm_bwd(
    kind: str,
    dt: DT = DT.HALF,
    xs: tuple[int, ...] = (64, 96),
    ps: tuple[int, ...] | None = None,
    *,
    dbias: bool = True,
    x_strides: list[int] | None = None,
    stats_dt: DT = DT.FLOAT,
) -> fg.Graph:
    """One layernorm_backward ("ln") or rmsnorm_backward ("rms") node, every gradient an output."""
    g = fg.Graph(f"{kind}_bwd_{dt.value}", io_data_type=dt, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    dy, x = g.tensor("dy", list(xs)), g.tensor("x", list(xs), x_strides)
    s = g.tensor("scale", list(ps if ps is not None else (1, *xs[1:])))
    stat = [xs[0]] + [1] * (len(xs) - 1)
    if kind == "ln":
        outs: tuple[Any, ...] = g.layernorm_backward(
            dy, x, s, g.tensor("mean", stat, data_type=stats_dt), g.tensor("inv", stat, data_type=stats_dt), name="lnb"
        )
    else:
        outs = g.rmsnorm_backward(dy, x, s, g.tensor("inv", stat, data_type=stats_dt), has_dbias=dbias, name="rmsb")
    for t in outs:
        if t is not None:
            t.set_output(True)
    return g.validate()


def _refusal(g: fg.Graph) -> str:
    with pytest.raises(Refusal) as info:
        analyze_norm_backward(g)
    return str(info.value)


# ---- CPU ---------------------------------------------------------------------------------------
def test_the_view_of_layer_and_rms_norm_backward() -> None:
    v = analyze_norm_backward(norm_bwd("ln", xs=(4, 8, 16)))
    assert (v.rows, v.cols, v.centred, v.sums) == (4, 128, True, ("dscale", "dbias"))
    assert v.access["x"] == Access("full", 128, 1) and v.access["scale"] == Access("col", 0, 1)
    assert v.access["mean"] == Access("row", 1, 0) and v.access["lnb::dscale"] == Access("col", 0, 1)
    v = analyze_norm_backward(norm_bwd("rms", dbias=False, ps=(96,)))
    assert (v.rows, v.cols, v.centred, v.sums) == (64, 96, False, ("dscale",))
    padded = analyze_norm_backward(norm_bwd("rms", DT.FLOAT, xs=(8, 3, 16), x_strides=[64, 16, 1]))
    assert padded.access["x"] == Access("full", 64, 1)  # rows padded to 64 elements


def test_refusals_say_why() -> None:
    g = fg.Graph("bn", io_data_type=DT.FLOAT)
    x = g.tensor("x", [4, 3, 5])
    c = g.tensor("c", [3])
    for t in g.batchnorm_backward(g.tensor("dy", [4, 3, 5]), x, c, g.tensor("m", [3]), g.tensor("i", [3])):
        t.set_output(True)
    assert "batchnorm_backward" in _refusal(g.validate()) and "one layernorm_backward or rmsnorm_backward" in _refusal(g)
    assert "broadcast within the row" in _refusal(norm_bwd("ln", DT.FLOAT, xs=(2, 3, 4, 5), ps=(1, 1, 4, 5)))
    assert "do not collapse" in _refusal(norm_bwd("ln", DT.FLOAT, xs=(8, 3, 16), x_strides=[96, 32, 1]))
    assert "up to 4096" in _refusal(norm_bwd("rms", xs=(2, 5120)))
    assert "DOUBLE" in _refusal(norm_bwd("rms", DT.DOUBLE))
    g = fg.Graph("halfmath", io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.HALF)
    dx, ds = g.rmsnorm_backward(g.tensor("dy", [4, 8]), g.tensor("x", [4, 8]), g.tensor("s", [8]),
                                g.tensor("i", [4, 1], data_type=DT.FLOAT))[:2]
    dx.set_output(True)
    ds.set_output(True)
    assert "computes in HALF" in _refusal(g.validate())
    # forward and backward in one graph: not one kernel pair
    g = fg.Graph("fwd_bwd", io_data_type=DT.FLOAT)
    x, s, b = g.tensor("x", [4, 6]), g.tensor("s", [6]), g.tensor("b", [6])
    y, mean, inv = g.layernorm(x, s, b, 1e-5, phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv is not None
    y.set_output(True)
    for t in g.layernorm_backward(g.tensor("dy", [4, 6]), x, s, mean, inv):
        t.set_output(True)
    assert "split the graph" in _refusal(g.validate())


def test_the_engine_declares_and_refuses_on_the_cpu() -> None:
    g = norm_bwd("rms")
    assert declared_unsupported("triton", g) is None
    assert declared_unsupported("triton", norm_bwd("ln")) is None
    s = ENGINE.supports(g, fg.Handle("cpu"))
    assert not s and "NVIDIA GPUs only" in s.reason
    names = [k.name for k in ENGINE.knobs(g, fg.Handle("cpu"))]
    assert names == ["rows_per_program", "num_warps", "programs_per_sm", "prefetch"]


def test_default_tiling() -> None:
    # (rows a tile, warps, programs an SM, programs): 8 elements a thread, 16 warps an SM
    assert default_tiling(16384, 4096, 132) == (1, 16, 1, 132)
    assert default_tiling(16384, 1024, 132) == (1, 4, 4, 528)
    assert default_tiling(64, 96, 132) == (8, 4, 4, 8)  # few tiles: one program each
    assert default_tiling(3, 100, 132) == (4, 2, 8, 1)


def test_kernel_text_sums_in_a_fixed_order() -> None:
    g = norm_bwd("ln", DT.BFLOAT16, xs=(16384, 4096))
    v = analyze_norm_backward(g)
    text = norm_backward_source(g, v, 1, 264)
    assert "atomic" not in text  # the column sums are two fixed stages, not arrival-ordered adds
    assert f"def {ROW_KERNEL}(p0, p1, p2, p3, p4, p5, p6, p7, ws):" in text
    assert f"def {SUM_KERNEL}(p0, p1, p2, p3, p4, p5, p6, p7, ws):" in text
    assert "for t in range(pid, 16384, 264):" in text and "cm =" not in text.split(SUM_KERNEL)[0]  # no masks needed
    assert "c2 = tl.sum(g, 1)" in text and ".to(tl.bfloat16)" in text
    assert workspace_floats(v, 264) == 264 * 2 * 4096 and sum_programs(v) == 4096 // 32
    rms = norm_bwd("rms", dbias=False)
    rv = analyze_norm_backward(rms)
    rtext = norm_backward_source(rms, rv, 4, 3, prefetch=0)
    assert "c2" not in rtext and "acc1" not in rtext and "rm = r < 64" not in rtext  # 16 tiles of 4 rows: no row mask
    ahead = norm_backward_source(rms, rv, 4, 3, prefetch=2)
    assert "dy_p1 = tl.load(" in ahead and "rnm = rn < 64" in ahead and "rn = r + 24" in ahead  # tiles ahead are masked


# Run in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported.
_INTERPRET = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_triton_backward import interpret
    print(json.dumps(interpret({cases!r})))
""")


def interpret(cases: list[list[Any]]) -> list[dict[str, float]]:
    """Each case (kind, dtype value, x dims, rows a tile, programs, prefetch) built, its kernels run by
    Triton's interpreter on CPU tensors, and each output's error against the reference."""
    import torch

    from fusegraph.engines.cuda_plan import torch_dtype

    rng = np.random.default_rng(1234)
    errors = []
    for kind, dtv, xs, per, programs, prefetch in cases:
        g = norm_bwd(kind, DT(dtv), tuple(xs))
        v = analyze_norm_backward(g)
        text = norm_backward_source(g, v, per, programs, prefetch)
        path = os.path.join(os.environ["FG_INTERPRET_DIR"], f"k{len(errors)}.py")
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(f"fg_interp_{len(errors)}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        pack = random_inputs(g, rng)
        ins = [torch.from_numpy(np.asarray(pack[t.name], np.float32)).to(torch_dtype(torch, t.dtype)) for t in g.inputs()]
        outs = [torch.empty(t.shape, dtype=torch_dtype(torch, t.dtype)) for t in g.outputs()]
        args = [*ins, *outs, torch.empty(workspace_floats(v, programs), dtype=torch.float32)]
        getattr(mod, ROW_KERNEL)[(programs,)](*args)
        getattr(mod, SUM_KERNEL)[(sum_programs(v),)](*args)
        ref = g.execute(pack, engine="reference")
        errors.append({t.name: rel_error(o.float().numpy(), ref[t.name]) for t, o in zip(g.outputs(), outs, strict=True)})
    return errors


@pytest.mark.slow
def test_kernels_under_the_triton_interpreter(tmp_path: Any) -> None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("Triton's interpreter needs triton and torch importable (not installed here); "
                    "the same kernels run on the GPU in the gpu-marked tests below")
    cases = [
        ["ln", "float", [37, 100], 32, 2, 2],  # masked rows and columns, one tile per program
        ["ln", "bfloat16", [130, 64], 1, 7, 3],  # programs walking several tiles, 3 in flight
        ["ln", "half", [130, 64], 4, 5, 0],
        ["rms", "half", [5, 3, 24], 2, 2, 1],  # rank 3: rows x (3 * 24) columns
        ["rms", "float", [64, 128], 4, 3, 0],
        ["rms", "bfloat16", [67, 128], 4, 3, 2],  # a partial last tile, prefetched
    ]
    code = _INTERPRET.format(tests=os.path.dirname(__file__), cases=cases)
    env = {**os.environ, "TRITON_INTERPRET": "1", "FG_INTERPRET_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    for (kind, dtv, *_), errs in zip(cases, errors, strict=True):
        for name, err in errs.items():
            assert err <= TOL[DT(dtv)], (kind, dtv, name, err)


# ---- GPU ---------------------------------------------------------------------------------------
def _check(g: fg.Graph, rng: np.random.Generator, config: EngineConfig | None = None) -> Any:
    """test_triton_engine's check (supported, built, same strides and numbers as the float64
    reference) at the tolerance of the graph's input type."""
    from test_triton_engine import _check as check

    return check(g, rng, TOL[g.inputs()[0].dtype], config)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("dt", [DT.FLOAT, DT.HALF, DT.BFLOAT16])
@pytest.mark.parametrize("xs", [(64, 96), (1000, 1024), (6, 4, 40)])
def test_norm_backward_against_float64(kind: str, dt: DT, xs: tuple[int, ...], rng: np.random.Generator) -> None:
    _check(norm_bwd(kind, dt, xs), rng)


@pytest.mark.gpu
def test_rmsnorm_backward_without_dbias_and_padded_rows(rng: np.random.Generator) -> None:
    _check(norm_bwd("rms", DT.BFLOAT16, dbias=False), rng)
    _check(norm_bwd("ln", DT.FLOAT, xs=(8, 3, 16), x_strides=[64, 16, 1]), rng)


@pytest.mark.gpu
def test_knob_settings_agree(rng: np.random.Generator) -> None:
    g = norm_bwd("ln", DT.HALF, xs=(300, 512))
    for per, warps, psm in [(1, 4, 1), (4, 8, 2), (8, 2, 8)]:
        _check(g, rng, EngineConfig("triton", (("num_warps", warps), ("programs_per_sm", psm), ("rows_per_program", per))))


@pytest.mark.gpu
def test_repeated_runs_give_the_same_bits(rng: np.random.Generator) -> None:
    import torch

    g = norm_bwd("rms", DT.BFLOAT16, xs=(4096, 1024))
    plan = ENGINE.build(g, GPU)
    dev = {t.name: torch.randn(t.shape, device="cuda").to(torch.bfloat16 if t.dtype == DT.BFLOAT16 else torch.float32)
           for t in g.inputs()}
    first = plan.execute(dev)
    for _ in range(3):
        again = plan.execute(dev)
        for name, t in first.items():
            assert torch.equal(t, again[name]), name


def test_gpu_selection_ranks_cudnn_then_triton_for_norm_backward() -> None:
    """cuDNN first on its published numbers until bench_gpu.py --group backward measures the kernel pair."""
    from fusegraph.select.heuristics import features, matching_rule

    rule = matching_rule(features(norm_bwd("rms", DT.BFLOAT16, xs=(16384, 4096))), GPU)
    assert rule is not None and rule.name == "gpu.norm_backward"
    assert [e for e, _ in rule.order][:2] == ["cudnn", "triton"]

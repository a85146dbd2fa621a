"""Every model of the onnx wheel's conformance data runs through the session and matches
its stored outputs (nodes fusegraph does not claim run on ONNX Runtime).

Claimed subgraphs are built by the reference engine here: these models are tiny, and the
float64 NumPy engine builds instantly (the compiling engines are covered by the light
models and by test_onnx_session.py). The few models ONNX Runtime itself cannot run in this
environment are expected failures, each with the reason.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import fusegraph.onnx as fgo

ENGINE = os.environ.get("FG_TEST_ENGINE", "reference")
DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
DIRS = ("pytorch-converted", "pytorch-operator", "simple")
CASES = [(d, p.name) for d in DIRS for p in sorted((DATA / d).iterdir()) if (p / "model.onnx").is_file()]

# Models that ONNX Runtime (the fallback) cannot run here, whatever fusegraph does.
ORT_CANNOT = {
    "test_gradient_of_add": "Gradient (ai.onnx.preview.training) is a training op: ONNX Runtime's inference build has no kernel for it",
    "test_gradient_of_add_and_mul": "Gradient (ai.onnx.preview.training) is a training op: ONNX Runtime's inference build has no kernel for it",
}
_LOCALE_CASES = {
    "test_strnorm_model_monday_casesensintive_lower",
    "test_strnorm_model_monday_casesensintive_upper",
    "test_strnorm_model_monday_empty_output",
    "test_strnorm_model_monday_insensintive_upper_twodim",
}


def _en_us_locale() -> bool:
    import locale

    try:
        old = locale.setlocale(locale.LC_CTYPE)
        locale.setlocale(locale.LC_CTYPE, "en_US.UTF-8")
        locale.setlocale(locale.LC_CTYPE, old)
        return True
    except locale.Error:
        return False


def _load(path: str, type_proto: onnx.TypeProto) -> object:
    data = Path(path).read_bytes()
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        seq = onnx.SequenceProto()
        seq.ParseFromString(data)
        return numpy_helper.to_list(seq)
    if kind == "optional_type":
        opt = onnx.OptionalProto()
        opt.ParseFromString(data)
        return numpy_helper.to_optional(opt)
    t = onnx.TensorProto()
    t.ParseFromString(data)
    return numpy_helper.to_array(t)


def _compare(got: object, want: object, where: str) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _compare(g, w, f"{where}[{i}]")
        return
    w = np.asarray(want)
    g = np.asarray(got)
    assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
    if w.dtype.kind in "fc":
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
        nan_w, nan_g = np.isnan(w), np.isnan(g)
        assert np.array_equal(nan_w, nan_g), f"{where}: NaN positions differ"
        g64, w64 = np.where(nan_g, 0, g).astype(np.float64), np.where(nan_w, 0, w).astype(np.float64)
        scale = max(float(np.abs(w64).max(initial=0.0)), 1e-30)  # keeps the norms from overflowing
        err = np.linalg.norm((g64 - w64) / scale) / max(np.linalg.norm(w64 / scale), 1e-30)
        # The onnx backend runner's own tolerance (rtol 1e-3); relative-norm error on top.
        np.testing.assert_allclose(g64, w64, rtol=1e-3, atol=1e-5, err_msg=where)
        assert err < 1e-4, f"{where}: relative error {err:.2e}"
    else:
        np.testing.assert_array_equal(g, w, err_msg=where)


@pytest.mark.parametrize(("directory", "case"), CASES, ids=[f"{d}/{c}" for d, c in CASES])
def test_conformance_model(directory: str, case: str) -> None:
    if case in ORT_CANNOT:
        pytest.xfail(ORT_CANNOT[case])
    if case in _LOCALE_CASES and not _en_us_locale():
        pytest.xfail("StringNormalizer needs the en_US.UTF-8 locale, which this machine lacks (ONNX Runtime fails)")
    root = DATA / directory / case
    sess = fgo.InferenceSession(
        str(root / "model.onnx"),
        providers=[(fgo.PROVIDER, {"engine": ENGINE, "torch_mlir_tier": "off"}), "CPUExecutionProvider"],
    )
    model = onnx.load(str(root / "model.onnx"))
    inits = {i.name for i in model.graph.initializer}
    ins = [i for i in model.graph.input if i.name not in inits]
    sets = sorted(glob.glob(os.path.join(root, "test_data_set_*")))
    assert sets, f"{case} has no test data"
    for ds in sets:
        feed = {
            i.name: _load(os.path.join(ds, f"input_{k}.pb"), i.type)
            for k, i in enumerate(ins)
            if os.path.exists(os.path.join(ds, f"input_{k}.pb"))
        }
        got = sess.run(None, feed)
        for k, o in enumerate(model.graph.output):
            want = _load(os.path.join(ds, f"output_{k}.pb"), o.type)
            _compare(got[k], want, f"{case}/{Path(ds).name}/{o.name}")


def test_conformance_coverage() -> None:
    """The conformance models are not all simply handed to ONNX Runtime: most of their
    nodes run on fusegraph."""
    claimed = total = 0
    for directory, case in CASES:
        if case in ORT_CANNOT or case in _LOCALE_CASES:
            continue
        sess = fgo.InferenceSession(
            str(DATA / directory / case / "model.onnx"),
            providers=[(fgo.PROVIDER, {"engine": "reference", "torch_mlir_tier": "off"})],
        )
        try:
            rep = sess.partition_report()
        except RuntimeError:
            continue  # dynamic input shapes: partitioned at the first run
        claimed += rep.fusegraph_nodes
        total += rep.running_nodes
    assert total > 0
    assert claimed / total > 0.6, f"only {claimed}/{total} conformance nodes claimed"

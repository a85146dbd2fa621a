"""Hostile-input catalogue: what a careless or malicious caller can hand fusegraph.

One table, three families: the graph API, variant packs (on every CPU engine), and ONNX
models. Each case either raises the typed fusegraph error it names, with a message naming
what is wrong, or -- where the input is unusual but valid (a broadcast input view, an inf
scalar, a graph changed after build) -- returns the right numbers. None may crash the
interpreter, hang, or touch files outside where it should: cases that could take the
interpreter down run in a subprocess under a timeout. The existing malformed graphs
(tests/test_validation_errors.py) and packs (tests/test_variant_pack.py) are not repeated.

Bugs outside the reliability area are strict xfails whose reason says what is wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.errors import FusegraphError, ValidationError, VariantPackError
from fusegraph.onnx.model import ModelError, load_model, specialize

F32 = DataType.FLOAT
ENGINES = ("reference", "torch", "iree")


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Path], Any]
    error: type[BaseException] | None  # None: must succeed (``run`` checks the numbers)
    match: tuple[str, ...] = ()  # substrings the message must hold (case-insensitive)
    subprocess: bool = False
    timeout: float = 120.0
    xfail: str = ""


CASES: list[Case] = []


def case(name: str, error: type[BaseException] | None, *match: str, subprocess: bool = False,
         timeout: float = 120.0, xfail: str = "") -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    def deco(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        CASES.append(Case(name, fn, error, match, subprocess, timeout, xfail))
        return fn

    return deco


def _rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def relu_graph(dims: list[int] | None = None, dt: DataType = F32) -> tuple[fg.Graph, fg.TensorAttr, fg.TensorAttr]:
    g = fg.Graph(name="hostile", io_data_type=dt)
    x = g.tensor("x", dims or [3, 5])
    y = g.relu(x, name="relu").set_name("y").set_output(True)
    return g, x, y


def add_graph() -> fg.Graph:
    g = fg.Graph(name="hostile_add", io_data_type=F32)
    a = g.tensor("a", [4, 6])
    b = g.tensor("b", [4, 6])
    g.add(a, b, name="plus").set_name("y").set_output(True)
    return g.validate()


def _close(got: np.ndarray, ref: np.ndarray, tol: float = 1e-5) -> None:
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got64.shape == ref64.shape, (got64.shape, ref64.shape)
    assert not np.isnan(got64).any() or np.isnan(ref64).any()
    err = np.linalg.norm(np.nan_to_num(got64 - ref64)) / max(np.linalg.norm(np.nan_to_num(ref64)), 1e-30)
    assert err <= tol, f"rel err {err:.3g}"


# =============================================================================================
# Graph API
# =============================================================================================
@case("graph_dims_2pow40", ValidationError, "'x'")
def _(tmp: Path) -> None:
    g, _, _ = relu_graph([2**40, 2**40])
    g.validate()


@case("graph_dim_2pow40_build_torch", None, subprocess=True)
def _(tmp: Path) -> None:
    """A 2**40-element tensor is valid; building must not allocate it (execute brings the array)."""
    g, _, _ = relu_graph([2**20, 2**20])
    g.validate().build(engine="torch")


@case("graph_dim_2pow40_build_iree", None, subprocess=True)
def _(tmp: Path) -> None:
    g, _, _ = relu_graph([2**20, 2**20])
    g.validate().build(engine="iree")


@case("graph_stride_2pow62", ValidationError, "'x'")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [4, 4], [2**62, 1])
    g.relu(x).set_output(True)
    g.validate()


@case("graph_negative_dim", ValidationError, "'x'", ">= 1")
def _(tmp: Path) -> None:
    relu_graph([4, -3])[0].validate()


@case("graph_dim_is_numpy_float", ValidationError, "'x'")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    g.tensor("x", [np.float64(3.0), 4])  # type: ignore[list-item]


@case("graph_dim_bool", ValidationError, "'x'")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    g.tensor("x", [True, 4])


@case("graph_rank_zero_dims_list", ValidationError, "'x'")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [])
    g.relu(x).set_output(True)
    g.validate()



def _layernorm(eps: Any) -> fg.Graph:
    g = fg.Graph(io_data_type=F32)
    x, s, b = g.tensor("x", [2, 4]), g.tensor("s", [1, 4]), g.tensor("b", [4])
    y, _, _ = g.layernorm(x, s, b, epsilon=eps, name="ln")
    y.set_output(True)
    return g.validate()


@case("graph_epsilon_nan", ValidationError, "ln", "epsilon")
def _(tmp: Path) -> None:
    _layernorm(float("nan"))


@case("graph_epsilon_inf", ValidationError, "ln", "epsilon")
def _(tmp: Path) -> None:
    _layernorm(float("inf"))


@case("graph_epsilon_negative", ValidationError, "ln", "epsilon")
def _(tmp: Path) -> None:
    _layernorm(-1.0)


@case("graph_scalar_nan", ValidationError, "nan")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2, 4])
    g.mul(x, g.scalar(float("nan"))).set_output(True)
    g.validate()


@case("graph_scalar_int_beyond_int64", ValidationError, "int64")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=DataType.INT64)
    x = g.tensor("x", [2, 4])
    g.add(x, g.scalar(2**70)).set_output(True)
    g.validate()


@case("graph_scalar_inf_is_valid", None)
def _(tmp: Path) -> None:
    """An inf constant is valid (masks use it): max(x, -inf) is x on every engine."""
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [3, 4])
    g.max(x, g.scalar(float("-inf"))).set_name("y").set_output(True)
    g.validate()
    a = _rng().standard_normal((3, 4)).astype(np.float32)
    for e in ENGINES:
        _close(g.execute({"x": a}, engine=e)["y"], a, 0.0)


@case("graph_pointwise_param_nan", ValidationError, "elu_alpha")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    g.elu(g.tensor("x", [2, 4]), alpha=float("nan")).set_output(True)
    g.validate()


@case("graph_pointwise_param_inf_clip_is_valid", None)
def _(tmp: Path) -> None:
    """relu_upper_clip=inf is the default: explicit, it changes nothing."""
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [3, 4])
    g.relu(x, upper_clip=float("inf")).set_name("y").set_output(True)
    g.validate()
    a = _rng().standard_normal((3, 4)).astype(np.float32)
    for e in ENGINES:
        _close(g.execute({"x": a}, engine=e)["y"], np.maximum(a, 0), 0.0)


@case("graph_execute_invalid_before_validate", ValidationError, "plus")
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    a, b = g.tensor("a", [2, 3]), g.tensor("b", [4])
    g.add(a, b, name="plus").set_output(True)
    g.execute({"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)})


@case("graph_execute_valid_before_validate", None)
def _(tmp: Path) -> None:
    """execute() validates an unvalidated graph first: the right numbers, no error."""
    g, _, _ = relu_graph()
    a = _rng().standard_normal((3, 5)).astype(np.float32)
    for e in ENGINES:
        _close(g.execute({"x": a}, engine=e)["y"], np.maximum(a, 0), 0.0)


@case("graph_mutate_dims_after_build", None)
def _(tmp: Path) -> None:
    """Changing an input's dims after build: the next execute runs the changed graph."""
    for e in ENGINES:
        g, x, _ = relu_graph()
        g.validate().build(engine=e)
        x.set_dim([4, 2])
        a = _rng().standard_normal((4, 2)).astype(np.float32)
        _close(g.execute({"x": a}, engine=e)["y"], np.maximum(a, 0), 0.0)


@case("graph_add_output_after_build", None)
def _(tmp: Path) -> None:
    for e in ENGINES:
        g, _, y = relu_graph()
        g.validate().build(engine=e)
        g.exp(y).set_name("z").set_output(True)
        a = _rng().standard_normal((3, 5)).astype(np.float32)
        out = g.execute({"x": a}, engine=e)
        _close(out["z"], np.exp(np.maximum(a, 0)), 1e-6)


@case("graph_mutate_stale_pack_after_build", VariantPackError, "'x'")
def _(tmp: Path) -> None:
    """After set_dim, the old-shaped array is refused (never run against the stale plan)."""
    g, x, _ = relu_graph()
    g.validate().build(engine="iree")
    x.set_dim([4, 2])
    g.execute({"x": np.zeros((3, 5), np.float32)}, engine="iree")


@case("graph_name_with_path_separators", None)
def _(tmp: Path) -> None:
    """A graph named like a path cannot steer the cache's or a reproducer's files."""
    g = fg.Graph(name="../../etc/passwd", io_data_type=F32)
    x = g.tensor("x", [2, 3])
    g.exp(x).set_name("y").set_output(True)
    a = _rng().standard_normal((2, 3)).astype(np.float32)
    _close(g.execute({"x": a}, engine="iree")["y"], np.exp(a), 1e-6)
    root = Path(os.environ["FUSEGRAPH_CACHE_DIR"])
    for p in root.rglob("*"):
        assert root in p.resolve().parents or p.resolve() == root


@case("graph_from_json_huge_dims", ValidationError)
def _(tmp: Path) -> None:
    g, _, _ = relu_graph()
    doc = json.loads(g.validate().to_json())
    doc["tensors"][0]["dim"] = [2**100, 5]
    doc["tensors"][1]["dim"] = [2**100, 5]
    fg.Graph.from_json(json.dumps(doc)).validate()


@case("graph_from_json_not_json", ValidationError)
def _(tmp: Path) -> None:
    fg.Graph.from_json("{\"format\": \"fusegraph.graph\", ")


@case("graph_from_json_deep_nesting", ValidationError, subprocess=True)
def _(tmp: Path) -> None:
    fg.Graph.from_json("[" * 100_000 + "]" * 100_000)


@case("graph_tensor_name_not_str", ValidationError)
def _(tmp: Path) -> None:
    g = fg.Graph(io_data_type=F32)
    g.tensor(42, [2, 3])  # type: ignore[arg-type]


# =============================================================================================
# Variant packs (each on every CPU engine)
# =============================================================================================
def _per_engine(name: str, error: type[BaseException] | None, *match: str, xfail: dict[str, str] | None = None,
                subprocess: bool = False) -> Callable[[Callable[[Path, str], Any]], Callable[[Path, str], Any]]:
    def deco(fn: Callable[[Path, str], Any]) -> Callable[[Path, str], Any]:
        for e in ENGINES:
            CASES.append(Case(f"{name}[{e}]", lambda tmp, e=e: fn(tmp, e), error, match, subprocess,
                              xfail=(xfail or {}).get(e, (xfail or {}).get("*", ""))))
        return fn

    return deco


@_per_engine("pack_output_aliases_input", VariantPackError, "'y'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    a = _rng().standard_normal((4, 6)).astype(np.float32)
    b = _rng().standard_normal((4, 6)).astype(np.float32)
    g.execute({"a": a, "b": b, "y": a}, engine=engine)


@_per_engine("pack_output_self_overlapping", VariantPackError, "'y'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    base = np.zeros(6, np.float32)
    y = np.lib.stride_tricks.as_strided(base, (4, 6), (0, 4))  # writable, rows alias each other
    g.execute({"a": np.ones((4, 6), np.float32), "b": np.ones((4, 6), np.float32), "y": y}, engine=engine)


@_per_engine("pack_output_negative_strides", VariantPackError, "'y'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    y = np.zeros((4, 6), np.float32)[::-1]
    g.execute({"a": np.ones((4, 6), np.float32), "b": np.ones((4, 6), np.float32), "y": y}, engine=engine)


@_per_engine("pack_output_read_only_memmap", VariantPackError, "'y'", "read-only")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    path = tmp / "y.bin"
    np.zeros((4, 6), np.float32).tofile(path)
    y = np.memmap(path, np.float32, mode="r", shape=(4, 6))
    try:
        g.execute({"a": np.ones((4, 6), np.float32), "b": np.ones((4, 6), np.float32), "y": y}, engine=engine)
    finally:
        assert not np.fromfile(path, np.float32).any(), "a read-only mapping was written"


@_per_engine("pack_input_view_outside_its_array", VariantPackError, "'a'",
    subprocess=True)  # it reads past the end of an allocation: kept away from the test process
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    base = np.ones(6, np.float32)
    a = np.lib.stride_tricks.as_strided(base, (4, 6), (24, 4), writeable=False)  # rows 1..3 are past the end
    g.execute({"a": a, "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_input_broadcast_view_is_valid", None)
def _(tmp: Path, engine: str) -> None:
    """Issue 16: an overlapping (stride-0) input view is valid when the dense tensor is declared
    packed? No -- it must match the declared strides; a graph that declares it broadcast takes it."""
    g = fg.Graph(io_data_type=F32)
    a = g.tensor("a", [4, 6], [0, 1])
    b = g.tensor("b", [4, 6])
    g.add(a, b).set_name("y").set_output(True)
    row = _rng().standard_normal(6).astype(np.float32)
    bb = _rng().standard_normal((4, 6)).astype(np.float32)
    out = g.validate().execute({"a": np.broadcast_to(row, (4, 6)), "b": bb}, engine=engine)
    _close(out["y"], row + bb, 1e-6)


@_per_engine("pack_input_byteswapped", None)
def _(tmp: Path, engine: str) -> None:
    """A big-endian array is either converted (right numbers) or refused -- never misread."""
    g = add_graph()
    a = _rng().standard_normal((4, 6)).astype(">f4")
    b = _rng().standard_normal((4, 6)).astype(np.float32)
    try:
        out = g.execute({"a": a, "b": b}, engine=engine)
    except VariantPackError as exc:
        assert "'a'" in str(exc)
        return
    _close(out["y"], a.astype(np.float64) + b, 1e-6)


@_per_engine("pack_input_unaligned", None)
def _(tmp: Path, engine: str) -> None:
    """A float32 array at an odd byte address: right numbers or a VariantPackError."""
    g = add_graph()
    raw = np.zeros(4 * 6 * 4 + 1, np.uint8)
    a = raw[1:].view(np.float32).reshape(4, 6)
    a[...] = _rng().standard_normal((4, 6))
    assert not a.flags.aligned
    b = _rng().standard_normal((4, 6)).astype(np.float32)
    try:
        out = g.execute({"a": a, "b": b}, engine=engine)
    except VariantPackError as exc:
        assert "'a'" in str(exc)
        return
    _close(out["y"], a.astype(np.float64) + b, 1e-6)


@_per_engine("pack_input_read_only_aligned", None)  # fixed in iree/plan.py (issue 16, G)
def _(tmp: Path, engine: str) -> None:
    """A read-only input (np.frombuffer of bytes, a read-only memmap) is valid input."""
    from test_fuzz_regressions import aligned_read_only

    g = add_graph()
    a = aligned_read_only(_rng().standard_normal((4, 6)).astype(np.float32))
    b = aligned_read_only(_rng().standard_normal((4, 6)).astype(np.float32))
    _close(g.execute({"a": a, "b": b}, engine=engine)["y"], a.astype(np.float64) + b, 1e-6)


@_per_engine("pack_flat_python_list", VariantPackError, "'a'", "list")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    g.execute({"a": [0.5] * 24, "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_tuple_of_arrays", VariantPackError, "'a'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    g.execute({"a": (np.ones(6, np.float32),) * 4, "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_object_array", VariantPackError, "'a'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    g.execute({"a": np.full((4, 6), None, object), "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_complex_array", VariantPackError, "'a'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    g.execute({"a": np.ones((4, 6), np.complex64), "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_zero_dim_array_for_tensor", VariantPackError, "'a'")
def _(tmp: Path, engine: str) -> None:
    g = add_graph()
    g.execute({"a": np.float32(1.0), "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_torch_tensor_on_meta_device", VariantPackError, "'a'")  # fixed in variant_pack.py (G)
def _(tmp: Path, engine: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is optional; this case needs it")
    g = add_graph()
    g.execute({"a": torch.empty((4, 6), device="meta"), "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_torch_tensor_wrong_dtype", VariantPackError, "'a'")
def _(tmp: Path, engine: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is optional; this case needs it")
    g = add_graph()
    g.execute({"a": torch.ones((4, 6), dtype=torch.float64), "b": np.ones((4, 6), np.float32)}, engine=engine)


@_per_engine("pack_nan_inputs_propagate", None)
def _(tmp: Path, engine: str) -> None:
    """NaN and inf inputs are data, not errors: they come out where IEEE says."""
    g = add_graph()
    a = _rng().standard_normal((4, 6)).astype(np.float32)
    a[0, 0], a[1, 1], a[2, 2] = np.nan, np.inf, -np.inf
    b = np.ones((4, 6), np.float32)
    out = g.execute({"a": a, "b": b}, engine=engine)["y"]
    assert np.isnan(out[0, 0]) and out[1, 1] == np.inf and out[2, 2] == -np.inf
    mask = np.isfinite(a)
    _close(out[mask], (a + b)[mask], 1e-6)


# =============================================================================================
# ONNX models
# =============================================================================================
def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto] | None = None, opset: int = 17,
           extra_opsets: list[onnx.OperatorSetIdProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializer=inits or [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *(extra_opsets or [])],
                             ir_version=8)


def _vi(name: str, shape: list[Any], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _relu_model(opset: int = 17) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2, 3])], [_vi("y", [2, 3])], opset=opset)


def _session(src: Any) -> Any:
    from fusegraph.onnx import InferenceSession

    return InferenceSession(src, providers=["FusegraphExecutionProvider"])


@case("onnx_empty_bytes", ModelError, "no graph")
def _(tmp: Path) -> None:
    load_model(b"")


@case("onnx_truncated_bytes", ModelError)
def _(tmp: Path) -> None:
    data = _relu_model().SerializeToString()
    load_model(data[: len(data) // 2])


@case("onnx_random_bytes", ModelError)
def _(tmp: Path) -> None:
    load_model(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())


@case("onnx_random_bytes_many", None)
def _(tmp: Path) -> None:
    """200 random byte strings: every one a ModelError (none a raw protobuf error)."""
    rng = np.random.default_rng()
    for _ in range(200):
        n = int(rng.integers(1, 512))
        try:
            load_model(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        except ModelError:
            continue
        raise AssertionError("random bytes loaded as a model")


@case("onnx_truncated_file", ModelError, "bad.onnx")
def _(tmp: Path) -> None:
    data = _relu_model().SerializeToString()
    (tmp / "bad.onnx").write_bytes(data[:-7])
    load_model(tmp / "bad.onnx")


@case("onnx_directory_as_path", ModelError, "dir.onnx")
def _(tmp: Path) -> None:
    (tmp / "dir.onnx").mkdir()
    load_model(tmp / "dir.onnx")


@case("onnx_not_a_model_type", ModelError, "int")
def _(tmp: Path) -> None:
    load_model(42)  # type: ignore[arg-type]


@case("onnx_cycle", ModelError)
def _(tmp: Path) -> None:
    nodes = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Add", ["x", "b"], ["y"])]
    load_model(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))


@case("onnx_missing_initializer", ModelError, "w")
def _(tmp: Path) -> None:
    load_model(_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", [2, 3])], [_vi("y", [2, 4])]))


@case("onnx_unknown_domain_without_opset", ModelError)
def _(tmp: Path) -> None:
    load_model(_model([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.evil")],
                      [_vi("x", [2])], [_vi("y", [2])]))


@case("onnx_unknown_domain_session", FusegraphError, "Frobnicate")
def _(tmp: Path) -> None:
    m = _model([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.evil")], [_vi("x", [2])], [_vi("y", [2])],
               extra_opsets=[helper.make_opsetid("com.evil", 1)])
    s = _session(m.SerializeToString())
    s.run(None, {"x": np.ones(2, np.float32)})


@case("onnx_unknown_op_default_domain", ModelError, "Frobnicate")
def _(tmp: Path) -> None:
    load_model(_model([helper.make_node("Frobnicate", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])]))


@case("onnx_opset_0", ModelError, "opset 0")
def _(tmp: Path) -> None:
    load_model(_relu_model(opset=0))


@case("onnx_opset_3_upgraded_or_refused", None)
def _(tmp: Path) -> None:
    """An old opset (< 7) is upgraded to 7 or refused with a ModelError; never half-loaded."""
    try:
        m = load_model(_relu_model(opset=3))
    except ModelError:
        return
    assert any(o.domain in ("", "ai.onnx") and o.version >= 7 for o in m.opset_import)


@case("onnx_opset_above_newest", ModelError, "opset 10000")
def _(tmp: Path) -> None:
    load_model(_relu_model(opset=10_000))


@case("onnx_absurd_declared_input_dims", None)
def _(tmp: Path) -> None:
    """A declared input of 2**40 x 2**40: loading allocates nothing; a small actual input is
    refused by the session with a typed error or run correctly."""
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2**40, 2**40])], [_vi("y", [2**40, 2**40])])
    load_model(m)


@case("onnx_constant_of_shape_2pow40", ModelError, "big", subprocess=True, timeout=120)
def _(tmp: Path) -> None:
    """ConstantOfShape([2**40]) feeding an Add: specializing must not try to allocate 4 TB."""
    shape = numpy_helper.from_array(np.array([2**40], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=numpy_helper.from_array(np.array([1.0], np.float32))),
             helper.make_node("Add", ["x", "big"], ["y"])]
    m = load_model(_model(nodes, [_vi("x", [1])], [_vi("y", [2**40])], inits=[shape]))
    specialize(m, {"x": [1]})


@case("onnx_constant_of_shape_2pow30_bounded_memory", None, subprocess=True, timeout=120)
def _(tmp: Path) -> None:
    """A 4 GiB ConstantOfShape (big but possible) is neither folded nor materialized by shape
    inference: specialize stays within the child's memory limit."""
    shape = numpy_helper.from_array(np.array([2**30], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=numpy_helper.from_array(np.array([1.0], np.float32))),
             helper.make_node("Add", ["x", "big"], ["y"])]
    m = load_model(_model(nodes, [_vi("x", [1])], [_vi("y", [2**30])], inits=[shape]))
    og = specialize(m, {"x": [1]})
    assert "big" not in og.constants


@case("onnx_initializer_count_mismatch", ModelError, "'w'")
def _(tmp: Path) -> None:
    """An initializer declaring [4] with 3 values."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], float_data=[1.0, 2.0, 3.0])
    load_model(_model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [4])], [_vi("y", [4])], inits=[w]))


@case("onnx_initializer_raw_data_short", ModelError, "'w'")
def _(tmp: Path) -> None:
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], raw_data=b"\0" * 10)
    load_model(_model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [4])], [_vi("y", [4])], inits=[w]))


@case("onnx_initializer_dims_lie", ModelError, "'w'")
def _(tmp: Path) -> None:
    """An initializer declaring [2**40] with 3 floats of data."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**40], float_data=[1.0, 2.0, 3.0])
    load_model(_model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [3])], [_vi("y", [3])], inits=[w]))


@case("onnx_string_tensors_session", None)
def _(tmp: Path) -> None:
    """String tensors are valid ONNX: the session hands them to ONNX Runtime, right values."""
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x", [2], TensorProto.STRING)],
               [_vi("y", [2], TensorProto.STRING)])
    s = _session(m.SerializeToString())
    (y,) = s.run(None, {"x": np.array(["a", "bc"], object)})
    assert list(y) == ["a", "bc"]


@case("onnx_string_initializer", None)
def _(tmp: Path) -> None:
    """A string initializer nobody reads: loads (it is valid ONNX) without error."""
    st_ = helper.make_tensor("names", TensorProto.STRING, [2], [b"a", b"b"])
    load_model(_model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])], inits=[st_]))


@case("onnx_10000_nodes_bounded_time", None, subprocess=True, timeout=300)
def _(tmp: Path) -> None:
    """A chain of 10,000 nodes loads and specializes in bounded time (< 120 s here)."""
    nodes = []
    prev = "x"
    for i in range(10_000):
        op = "Relu" if i % 2 else "Neg"
        nodes.append(helper.make_node(op, [prev], [f"v{i}"]))
        prev = f"v{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    t0 = time.perf_counter()
    m = load_model(_model(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])]))
    specialize(m, {"x": [2, 3]})
    assert time.perf_counter() - t0 < 120


def _external_model(tmp: Path, location: str) -> Path:
    w = numpy_helper.from_array(np.ones(3, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "12")):
        entry = w.external_data.add()
        entry.key, entry.value = k, v
    m = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [3])], [_vi("y", [3])], inits=[w])
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "m.onnx").write_bytes(m.SerializeToString())
    return d / "m.onnx"


def _secret(tmp: Path) -> Path:
    p = tmp / "secret.bin"
    p.write_bytes(np.full(3, 7.0, np.float32).tobytes())
    return p


@case("onnx_external_data_absolute_path", ModelError, "external", "w")
def _(tmp: Path) -> None:
    load_model(_external_model(tmp, str(_secret(tmp))))


@case("onnx_external_data_dotdot", ModelError, "external", "w")
def _(tmp: Path) -> None:
    _secret(tmp)
    load_model(_external_model(tmp, "../secret.bin"))


@case("onnx_external_data_dotdot_inside", ModelError, "external", "w")
def _(tmp: Path) -> None:
    _secret(tmp)
    (tmp / "model" / "sub").mkdir(parents=True)
    load_model(_external_model(tmp, "sub/../../secret.bin"))


@case("onnx_external_data_symlink_out", ModelError, "external", "w")
def _(tmp: Path) -> None:
    secret = _secret(tmp)
    path = _external_model(tmp, "w.bin")
    (path.parent / "w.bin").symlink_to(secret)
    load_model(path)


@case("onnx_external_data_symlinked_dir_out", ModelError, "external", "w")
def _(tmp: Path) -> None:
    secret = _secret(tmp)
    path = _external_model(tmp, "data/secret.bin")
    (path.parent / "data").symlink_to(secret.parent)
    load_model(path)


@case("onnx_external_data_missing_file", ModelError, "external", "w")
def _(tmp: Path) -> None:
    load_model(_external_model(tmp, "nope.bin"))


@case("onnx_external_data_past_end", ModelError, "external", "w")
def _(tmp: Path) -> None:
    path = _external_model(tmp, "w.bin")
    (path.parent / "w.bin").write_bytes(b"\0" * 4)  # 4 bytes, 12 declared
    load_model(path)


@case("onnx_external_data_device_file", ModelError, "external", "w", subprocess=True, timeout=60)
def _(tmp: Path) -> None:
    """A location naming /dev/zero-like special files (via a symlink inside) never blocks."""
    path = _external_model(tmp, "w.bin")
    (path.parent / "w.bin").symlink_to("/dev/zero")
    load_model(path)


@case("onnx_external_data_from_bytes", ModelError, "external", "w")
def _(tmp: Path) -> None:
    """External data in a model given as bytes: there is no directory to resolve it in."""
    load_model(_external_model(tmp, "w.bin").read_bytes())


@case("onnx_external_data_inside_is_valid", None)
def _(tmp: Path) -> None:
    path = _external_model(tmp, "w.bin")
    (path.parent / "w.bin").write_bytes(np.arange(3, dtype=np.float32).tobytes())
    m = load_model(path)
    w = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w"))
    assert np.array_equal(w, np.arange(3, dtype=np.float32))


@case("onnx_graph_output_not_produced", ModelError)
def _(tmp: Path) -> None:
    load_model(_model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("z", [2])]))


@case("onnx_duplicate_output_names", ModelError)
def _(tmp: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["y"])]
    load_model(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))


@case("onnx_session_wrong_input_shape", FusegraphError, "x")
def _(tmp: Path) -> None:
    s = _session(_relu_model().SerializeToString())
    s.run(None, {"x": np.ones((5, 7), np.float32)})


@case("onnx_session_wrong_input_dtype", FusegraphError, "x")
def _(tmp: Path) -> None:
    s = _session(_relu_model().SerializeToString())
    s.run(None, {"x": np.ones((2, 3), np.int64)})


# =============================================================================================
# The harness
# =============================================================================================
BY_NAME = {c.name: c for c in CASES}
CHILD_MEMORY = 12 * 1024**3  # address-space limit of a subprocess case


def run_case_in_child(name: str, tmp: str) -> None:
    """Entry point of a subprocess case: prints one JSON line saying what happened."""
    import resource

    # a case that tries to allocate the impossible fails here instead of swapping the machine
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    c = BY_NAME[name]
    try:
        c.run(Path(tmp))
        print(json.dumps({"raised": None}))
    except BaseException as exc:
        print(json.dumps({"raised": type(exc).__name__, "mro": [k.__name__ for k in type(exc).__mro__],
                          "message": str(exc)[:2000]}))


def test_catalogue_has_at_least_60_cases() -> None:
    assert len(CASES) >= 60, len(CASES)
    assert len(BY_NAME) == len(CASES), "duplicate case names"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEGRAPH_CACHE", raising=False)


def _params() -> list[Any]:
    out = []
    for c in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


@pytest.mark.parametrize("c", _params())
def test_hostile_input(c: Case, tmp_path: Path) -> None:
    if c.subprocess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-c", f"import test_hostile_inputs as t; t.run_case_in_child({c.name!r}, {str(tmp_path)!r})"],
            capture_output=True, text=True, timeout=c.timeout, env=env, cwd=tmp_path,
        )
        assert proc.returncode == 0, f"the interpreter died (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if c.error is None:
            assert result["raised"] is None, result
            return
        assert c.error.__name__ in result.get("mro", []), result
        msg = result["message"]
    elif c.error is None:
        c.run(tmp_path)
        return
    else:
        with pytest.raises(BaseException) as info:
            c.run(tmp_path)
        assert isinstance(info.value, c.error), f"{type(info.value).__name__}: {info.value}"
        msg = str(info.value)
    for m in c.match:
        assert m.lower() in msg.lower(), f"{m!r} not in: {msg}"

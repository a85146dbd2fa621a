"""io_binding with the data on the device (fusegraph/onnx/iobinding.py, issue 24 item 5).

On the CPU: CUDA values (a DLPack object on a CUDA device, a raw 'cuda' pointer, an output
asked on 'cuda') refused by name on a host session, a value on another GPU refused on a GPU
session; the host paths unchanged (NumPy, torch CPU tensors through DLPack, an output tensor
written in place) against ONNX Runtime on fresh random inputs; wrong dtype / shape named; the
report's host-copy note of a unit left to ONNX Runtime. GPU-marked (run by the lead on the
GPU machine): torch CUDA tensors, DLPack objects and raw pointers in and out without a host
copy, outputs allocated on the device handed out as torch CUDA tensors, typed errors for
CUDA feeds, a unit on ONNX Runtime in the middle, reduced precision through the binding."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusegraph as fg
import fusegraph.onnx as fgo
from fusegraph.onnx import iobinding, session
from fusegraph.onnx.ort_errors import InvalidFeedError

torch = pytest.importorskip("torch", reason="tensors on the device are torch tensors (fusegraph[torch])")
pytestmark = pytest.mark.usefixtures("own_cache")

PROVIDERS = ["FusegraphExecutionProvider", "CPUExecutionProvider"]
CPU: dict[str, Any] = {"device": "cpu", "regions": "on", "engine": "torch", "floor": "off", "runners": "off"}
GPU: dict[str, Any] = {"device": "cuda:0", "floor": "off", "runners": "off"}
X, Y = (8, 32), (8, 16)


def _model(rng: np.random.Generator, middle: str = "Relu") -> onnx.ModelProto:
    """Gemm -> ``middle`` -> Gemm -> Tanh."""
    def w(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node(middle, ["h"], ["r"], name="mid"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["g"], name="fc2"),
             helper.make_node("Tanh", ["g"], ["y"], name="tanh")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(Y))],
                          [w("w1", (32, 64)), w("b1", (64,)), w("w2", (64, 16)), w("b2", (16,))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # the GPU machine's ORT reads <= 13


def _session(model: onnx.ModelProto, opts: dict[str, Any], **more: Any) -> fgo.InferenceSession:
    return fgo.InferenceSession(model.SerializeToString(), providers=PROVIDERS, provider_options=[{**opts, **more}, {}])


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out: np.ndarray = ref.run(None, {"x": x})[0]
    return out


def _close(got: Any, want: np.ndarray, rel: float) -> None:
    g = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    assert g.shape == want.shape and g.dtype == want.dtype and np.isfinite(g).all()
    err = float(np.linalg.norm(g - want) / np.linalg.norm(want))
    assert err <= rel, f"relative error {err:.2e} (max abs {np.abs(g - want).max():.2e})"


class _OnCuda:
    """A DLPack producer that says its memory is on cuda:``index`` (no GPU needed to be refused)."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.index)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise BufferError("not a real tensor")


# ---- CPU: refusals ---------------------------------------------------------------------------------
def test_a_host_session_refuses_cuda_values_by_name(rng: np.random.Generator) -> None:
    sess = _session(_model(rng), CPU)
    assert sess.device == "cpu"
    b = sess.io_binding()
    with pytest.raises(fg.VariantPackError, match=r"'x'.*cuda:0.*reads host memory.*device='cuda:0'"):
        b.bind_input("x", _OnCuda())
    with pytest.raises(InvalidFeedError, match=r"'x'.*host memory"):
        b.bind_input("x", "cuda", 0, np.float32, list(X), 1234)
    with pytest.raises(InvalidFeedError, match=r"'y'.*host memory"):
        b.bind_output("y", "cuda")
    with pytest.raises(InvalidFeedError, match=r"'y'.*host memory"):
        b.bind_output("y", "cuda", 0, np.float32, list(Y), 1234)
    with pytest.raises(InvalidFeedError, match=r"'x'.*reads host memory"):
        sess.run(None, {"x": _OnCuda()})
    with pytest.raises(InvalidFeedError, match=r"'x'.*expected 'cpu' or 'cuda'"):
        b.bind_input("x", "npu", 0, np.float32, list(X), 1234)


def test_a_gpu_session_refuses_a_value_on_another_gpu() -> None:
    with pytest.raises(InvalidFeedError, match=r"'x'.*on cuda:1, but the session runs on cuda:0"):
        iobinding.feed_value(_OnCuda(1), "x", "cuda:0")
    with pytest.raises(InvalidFeedError, match=r"'x'.*on cuda:1, but the session runs on cuda:0"):
        iobinding._pointer_value("x", "cuda", 1, np.float32, X, 1234, "cuda:0")
    arr = np.zeros(X, np.float32)
    assert iobinding.feed_value(arr, "x", "cuda:0") is arr  # host arrays pass as they are


# ---- CPU: the host paths unchanged --------------------------------------------------------------------
def test_host_bindings_agree_with_onnx_runtime(rng: np.random.Generator) -> None:
    model = _model(rng)
    sess = _session(model, CPU)
    x = rng.standard_normal(X).astype(np.float32)
    want = _ort(model, x)
    _close(sess.run(None, {"x": x})[0], want, 1e-5)
    xt = torch.from_numpy(x.copy())
    yt = torch.full(Y, float("nan"))
    b = sess.io_binding()
    b.bind_input("x", xt)  # a torch CPU tensor, viewed through DLPack
    b.bind_output("y", yt)  # written in place
    sess.run_with_iobinding(b)
    _close(yt, want, 1e-5)
    assert b.get_outputs()[0].numpy() is not None and b.copy_outputs_to_cpu()[0].shape == Y
    b2 = sess.io_binding()
    b2.bind_cpu_input("x", x)
    b2.bind_output("y")
    sess.run_with_iobinding(b2)
    out = b2.get_outputs()[0]
    assert isinstance(out, ort.OrtValue)
    _close(out.numpy(), want, 1e-5)


def test_wrong_dtype_and_shape_are_named(rng: np.random.Generator) -> None:
    sess = _session(_model(rng), CPU)
    b = sess.io_binding()
    b.bind_cpu_input("x", rng.standard_normal(X))  # float64
    b.bind_output("y")
    with pytest.raises(InvalidFeedError, match=r"'x'.*dtype float64, the model expects float32"):
        sess.run_with_iobinding(b)
    b.bind_cpu_input("x", rng.standard_normal((4, 32)).astype(np.float32))
    with pytest.raises(InvalidFeedError, match=r"'x'.*shape \[4, 32\]"):
        sess.run_with_iobinding(b)
    b.bind_cpu_input("x", rng.standard_normal(X).astype(np.float32))
    b.bind_output("y", np.zeros((8, 15), np.float32))
    with pytest.raises(InvalidFeedError, match=r"'y'.*bound output is float32\[8, 15\]"):
        sess.run_with_iobinding(b)


def test_the_report_names_the_host_copies_of_a_unit_left_to_onnx_runtime(rng: np.random.Generator) -> None:
    """The note a GPU plan gets (session._note_host_copies), made on a CPU plan run region by
    region: the Relu left to ONNX Runtime reads a region unit's result and feeds one."""
    model = _model(rng)
    sess = _session(model, CPU, op_types_to_exclude="Relu")
    x = rng.standard_normal(X).astype(np.float32)
    _close(sess.run(None, {"x": x})[0], _ort(model, x), 1e-5)
    plan = sess._last
    assert plan is not None
    session._note_host_copies(plan)
    report = sess.partition_report()
    (ort_unit,) = [s for s in report.subgraphs if s.kind == "onnxruntime"]
    assert "host copies (this unit reads host memory): 1 value(s) copied from the GPU to the host (h); " \
           "1 result(s) copied back to the GPU (r;" in ort_unit.note, str(report)
    assert not any("host copies" in s.note for s in report.subgraphs if s.kind == "fusegraph")


# ---- GPU --------------------------------------------------------------------------------------------
def _count_host_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls of torch's host copies (``.cpu()``, ``.numpy()`` of a CUDA tensor) from now on."""
    seen: list[str] = []
    for meth in ("cpu", "numpy"):
        real = getattr(torch.Tensor, meth)

        def spy(self: Any, *a: Any, _real: Any = real, _m: str = meth, **k: Any) -> Any:
            if self.is_cuda or _m == "cpu":
                seen.append(_m)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, meth, spy)
    return seen


@pytest.mark.gpu
def test_cuda_pointers_in_and_out_without_host_copies(rng: np.random.Generator) -> None:
    model = _model(rng)
    sess = _session(model, GPU)
    assert sess.device == "cuda:0"
    for k in range(3):  # the first run captures; the later ones replay
        x = torch.from_numpy(rng.standard_normal(X).astype(np.float32)).cuda()
        y = torch.full(Y, float("nan"), device="cuda")
        b = sess.io_binding()
        b.bind_input("x", "cuda", 0, np.float32, list(X), x.data_ptr())
        b.bind_output("y", "cuda", 0, np.float32, list(Y), y.data_ptr())
        with pytest.MonkeyPatch.context() as mp:
            seen = _count_host_copies(mp) if k == 2 else []
            sess.run_with_iobinding(b)
            b.synchronize_outputs()
        assert seen == [], f"host copies on a warm run: {seen}"
        assert b.get_outputs()[0].data_ptr() == y.data_ptr()
        _close(y, _ort(model, x.cpu().numpy()), 1e-3)
    assert not any("host copies" in s.note for s in sess.partition_report().subgraphs)


@pytest.mark.gpu
def test_torch_and_dlpack_values_and_outputs_allocated_on_the_device(rng: np.random.Generator) -> None:
    class Producer:  # a DLPack producer that is not a torch tensor (as cupy's, jax's)
        def __init__(self, t: Any) -> None:
            self.t = t

        def __dlpack__(self, **kw: Any) -> Any:
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self) -> Any:
            return self.t.__dlpack_device__()

    model = _model(rng)
    sess = _session(model, GPU)
    x = torch.from_numpy(rng.standard_normal(X).astype(np.float32)).cuda()
    want = _ort(model, x.cpu().numpy())
    for bound in (x, Producer(x)):
        b = sess.io_binding()
        b.bind_input("x", bound)
        b.bind_output("y", "cuda")
        sess.run_with_iobinding(b)
        (out,) = b.get_outputs()
        assert isinstance(out, torch.Tensor) and out.device == torch.device("cuda:0") and out.is_contiguous()
        _close(out, want, 1e-3)
        _close(b.copy_outputs_to_cpu()[0], want, 1e-3)
    y = torch.empty(Y, device="cuda")
    b = sess.io_binding()
    b.bind_input("x", x)
    b.bind_output("y", y)  # a tensor written in place
    sess.run_with_iobinding(b)
    _close(y, want, 1e-3)
    got = sess.run(None, {"x": x})[0]  # run() takes a CUDA tensor too, and returns NumPy
    assert isinstance(got, np.ndarray)
    _close(got, want, 1e-3)
    _close(sess.run(None, {"x": x.cpu().numpy()})[0], want, 1e-3)  # NumPy as before


@pytest.mark.gpu
def test_cuda_feed_errors_are_typed_and_named(rng: np.random.Generator) -> None:
    sess = _session(_model(rng), GPU)
    b = sess.io_binding()
    b.bind_input("x", torch.zeros(X, dtype=torch.float64, device="cuda").normal_())
    b.bind_output("y", "cuda")
    with pytest.raises(InvalidFeedError, match=r"'x'.*dtype float64 on cuda:0, the model expects float32"):
        sess.run_with_iobinding(b)
    b.bind_input("x", torch.randn(4, 32, device="cuda"))
    with pytest.raises(InvalidFeedError, match=r"'x'.*shape \[4, 32\] on cuda:0"):
        sess.run_with_iobinding(b)
    b.bind_input("x", torch.randn(*X, device="cuda"))
    b.bind_output("y", torch.empty(8, 15, device="cuda"))
    with pytest.raises(InvalidFeedError, match=r"'y'.*bound output is float32\[8, 15\]"):
        sess.run_with_iobinding(b)


@pytest.mark.gpu
def test_a_unit_on_onnx_runtime_in_the_middle_copies_only_there(rng: np.random.Generator) -> None:
    model = _model(rng)
    sess = _session(model, GPU, op_types_to_exclude="Relu")
    x = torch.from_numpy(rng.standard_normal(X).astype(np.float32)).cuda()
    y = torch.empty(Y, device="cuda")
    b = sess.io_binding()
    b.bind_input("x", x)
    b.bind_output("y", y)
    sess.run_with_iobinding(b)
    _close(y, _ort(model, x.cpu().numpy()), 1e-3)
    report = sess.partition_report()
    (ort_unit,) = [s for s in report.subgraphs if s.kind == "onnxruntime"]
    assert "copied from the GPU to the host (h)" in ort_unit.note and "copied back to the GPU (r" in ort_unit.note


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["fp16", "bf16"])
def test_reduced_precision_through_the_binding(prec: str, rng: np.random.Generator) -> None:
    model = _model(rng, middle="Sigmoid")
    sess = _session(model, GPU, precision=prec)
    x = torch.from_numpy(rng.standard_normal(X).astype(np.float32)).cuda()
    b = sess.io_binding()
    b.bind_input("x", x)
    b.bind_output("y", "cuda")
    sess.run_with_iobinding(b)
    (out,) = b.get_outputs()
    assert out.dtype == torch.float32  # the model's declared type
    _close(out, _ort(model, x.cpu().numpy()), {"fp16": 1e-2, "bf16": 2e-2}[prec])

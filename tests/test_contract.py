"""One input contract on every engine (issue 16, item 1): the same graphs and the same packs
-- NumPy writable, read-only, broadcast views, non-contiguous views, torch tensors -- through
every available engine give the same results (against float64 NumPy on the logical data),
and outputs come back as the type that went in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from engine_fakes import DLPackOnly

import fusegraph as fg
from fusegraph.engines.registry import active_registry

F32 = fg.DataType.FLOAT


def _host_engines() -> list[str]:
    """Every available engine that runs on the host (a GPU-only engine is tested on the GPU)."""
    g = fg.Graph("probe", io_data_type=F32)
    g.relu(g.tensor("x", [2, 3])).set_output(True)
    g.validate()
    return [e.name for e in active_registry().available_engines() if e.supports(g, fg.Handle("cpu"))]


ENGINES = _host_engines()


def _add_relu() -> tuple[fg.Graph, Callable[[dict[str, np.ndarray]], np.ndarray]]:
    g = fg.Graph("contract_add_relu", io_data_type=F32)
    a, b = g.tensor("a", [4, 6]), g.tensor("b", [4, 6])
    g.relu(g.add(a, b)).set_name("y").set_output(True)
    return g.validate(), lambda v: np.maximum(v["a"] + v["b"], 0.0)


def _matmul() -> tuple[fg.Graph, Callable[[dict[str, np.ndarray]], np.ndarray]]:
    g = fg.Graph("contract_matmul", io_data_type=F32, compute_data_type=F32)
    a, b = g.tensor("a", [2, 4, 5]), g.tensor("b", [2, 5, 3])
    g.matmul(a, b).set_name("y").set_output(True)
    return g.validate(), lambda v: v["a"] @ v["b"]


GRAPHS = {"add_relu": _add_relu, "matmul": _matmul}


def _pack(kind: str, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator,
          dtype: type = np.float32) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        if kind == "broadcast":  # a stride-0 view: every row the same memory
            row = rng.standard_normal(shape[-1]).astype(dtype)
            out[name] = np.broadcast_to(row, shape)
            continue
        if kind == "non_contiguous":  # every other element of a larger array, then transposed back
            big = rng.standard_normal((*shape[:-2], shape[-1], 2 * shape[-2])).astype(dtype)
            out[name] = np.swapaxes(big[..., ::2], -1, -2)
            continue
        arr = rng.standard_normal(shape).astype(dtype)
        if kind == "read_only":
            arr.flags.writeable = False
        out[name] = arr
    return out


PACKS = ["writable", "read_only", "broadcast", "non_contiguous", "torch"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_same_pack_same_result_on_every_engine(engine: str, graph: str, rng: np.random.Generator) -> None:
    g, want_of = GRAPHS[graph]()
    shapes = {t.name: t.shape for t in g.inputs()}
    for kind in PACKS:
        if kind == "torch":
            torch = pytest.importorskip("torch", reason="torch is optional; the torch-tensor pack needs it")
            host = _pack("writable", shapes, rng)
            pack: dict[str, Any] = {k: torch.from_numpy(v) for k, v in host.items()}
        else:
            host = pack = _pack(kind, shapes, rng)
        logical = {k: np.asarray(v, np.float64) for k, v in host.items()}
        out = g.execute(pack, engine=engine)["y"]
        if kind == "torch":
            assert isinstance(out, torch.Tensor), f"{engine}/{kind}: got {type(out).__name__}"
            got = out.numpy().astype(np.float64)
        else:
            assert isinstance(out, np.ndarray), f"{engine}/{kind}: got {type(out).__name__}"
            got = out.astype(np.float64)
        want = want_of(logical)
        assert not np.isnan(got).any()
        rel = float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), 1e-30)
        assert rel <= 1e-5, f"{engine}/{graph}/{kind}: relative error {rel:.2e}"
        for k, v in host.items():  # the caller's arrays are never written
            np.testing.assert_array_equal(np.asarray(v, np.float64), logical[k])


@pytest.mark.parametrize("engine", ENGINES)
def test_same_refusal_on_every_engine(engine: str, rng: np.random.Generator) -> None:
    g, _ = _add_relu()
    good = _pack("writable", {"a": (4, 6), "b": (4, 6)}, rng)
    for bad, match in (
        ({"a": good["a"][:3]}, "shape"),
        ({"a": good["a"].astype(np.float64)}, "dtype"),
        ({"a": [[1.0] * 6] * 4}, "must be a numpy array"),
    ):
        with pytest.raises(fg.VariantPackError, match=match):
            g.execute({**good, **bad}, engine=engine)
    y = np.empty((6, 4), np.float32).T  # an output in another layout: written in place, so refused
    with pytest.raises(fg.VariantPackError, match="strides"):
        g.execute({**good, "y": y}, engine=engine)
    ro = np.empty((4, 6), np.float32)
    ro.flags.writeable = False
    with pytest.raises(fg.VariantPackError, match="read-only"):
        g.execute({**good, "y": ro}, engine=engine)


# ---- the same contract on the GPU engines (issue 26, item 5) -----------------------------------
def _softmax() -> tuple[fg.Graph, Callable[[dict[str, np.ndarray]], np.ndarray]]:
    g = fg.Graph("contract_softmax", io_data_type=F32)
    a, b = g.tensor("a", [4, 6]), g.tensor("b", [4, 6])
    g.softmax(g.add(a, b), axis=-1).set_name("y").set_output(True)

    def want(v: dict[str, np.ndarray]) -> np.ndarray:
        z = v["a"] + v["b"]
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]

    return g.validate(), want


def _conv_relu() -> tuple[fg.Graph, Callable[[dict[str, np.ndarray]], np.ndarray]]:
    """Half I/O, float32 accumulation, channels-last: on the H100 cuDNN proposed no plan for
    this convolution with its ReLU in float32 (none without TF32 rounding) nor in NCHW order
    (its fused convolutions run channels-last)."""
    g = fg.Graph("contract_conv_relu", io_data_type=fg.DataType.HALF, compute_data_type=F32)
    x = g.tensor("x", [2, 16, 6, 6], fg.strides_for([2, 16, 6, 6], "NHWC"))
    w = g.tensor("w", [32, 16, 3, 3], fg.strides_for([32, 16, 3, 3], "KRSC"))
    g.relu(g.conv_fprop(x, w, padding=[1, 1])).set_name("y").set_output(True)

    def want(v: dict[str, np.ndarray]) -> np.ndarray:
        xp = np.pad(v["x"], ((0, 0), (0, 0), (1, 1), (1, 1)))
        win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # n c h w r s
        return np.maximum(np.einsum("nchwrs,kcrs->nkhw", win, v["w"]), 0.0)  # type: ignore[no-any-return]

    return g.validate(), want


# what each GPU engine claims of these graphs (cudnn has no softmax node, and cuDNN
# proposed no plan without TF32 rounding for these small float32 graphs on the H100, so its
# supports() refuses them and its case is a half channels-last convolution; triton's row kernels need a
# softmax, norm or reduction; cuDNN's float32 matmul rounds to TF32)
GPU_GRAPHS = {"cudnn": ["conv_relu"], "triton": ["softmax"], "torch": ["add_relu", "matmul", "softmax"]}


@pytest.mark.gpu
@pytest.mark.parametrize(("engine", "graph"), [(e, g) for e, gs in GPU_GRAPHS.items() for g in gs])
def test_same_pack_same_result_on_every_gpu_engine(engine: str, graph: str, rng: np.random.Generator) -> None:
    """NumPy packs (writable, read-only, broadcast, non-contiguous), torch CUDA tensors (dense
    and strided views) and DLPack objects through each GPU engine on cuda:0: the same numbers
    as float64 NumPy, outputs of the type that went in, the caller's inputs unwritten; a
    device tensor in a layout other than the declared one is run or refused naming its
    strides (a plan reads the declared layout), never misread."""
    import torch

    g, want_of = {**GRAPHS, "softmax": _softmax, "conv_relu": _conv_relu}[graph]()
    shapes = {t.name: t.shape for t in g.inputs()}
    declared = {t.name: t.strides for t in g.inputs()}
    half = all(t.dtype == fg.DataType.HALF for t in g.inputs())
    dtype, tol = (np.float16, 2e-3) if half else (np.float32, 1e-5)  # half: the output's rounding
    for kind in [*PACKS[:-1], "cuda", "cuda_strided", "dlpack"]:
        host = _pack("writable" if kind in ("cuda", "cuda_strided", "dlpack") else kind, shapes, rng, dtype)
        pack: dict[str, Any]
        def on_device(k: str, v: np.ndarray) -> Any:  # dense, in the declared layout
            src = torch.from_numpy(np.ascontiguousarray(v))
            return torch.empty_strided(src.shape, declared[k], dtype=src.dtype, device="cuda").copy_(src)

        if kind == "cuda":
            pack = {k: on_device(k, v) for k, v in host.items()}
        elif kind == "cuda_strided":  # every other column of a wider tensor: a view, not a copy
            pack = {}
            for k, v in host.items():
                wide = torch.zeros((*v.shape[:-1], 2 * v.shape[-1]), dtype=torch.from_numpy(v[:0]).dtype, device="cuda")
                wide[..., ::2] = torch.from_numpy(np.ascontiguousarray(v)).cuda()
                pack[k] = wide[..., ::2]
        elif kind == "dlpack":
            pack = {k: DLPackOnly(on_device(k, v)) for k, v in host.items()}
        else:
            pack = host
        logical = {k: np.asarray(v, np.float64) for k, v in host.items()}
        try:
            out = g.execute(pack, engine=engine, handle="cuda:0")["y"]
        except fg.VariantPackError as exc:  # a device tensor in another layout: refused, never copied silently
            assert kind == "cuda_strided" and "strides" in str(exc), f"{engine}/{kind}: {exc}"
            continue
        if kind in ("cuda", "cuda_strided", "dlpack"):
            assert isinstance(out, torch.Tensor) and out.is_cuda, f"{engine}/{kind}: got {type(out).__name__}"
            got = out.cpu().numpy().astype(np.float64)
        else:
            assert isinstance(out, np.ndarray), f"{engine}/{kind}: got {type(out).__name__}"
            got = out.astype(np.float64)
        want = want_of(logical)
        rel = float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), 1e-30)
        assert not np.isnan(got).any() and rel <= tol, f"{engine}/{graph}/{kind}: relative error {rel:.2e}"
        for k, v in host.items():
            np.testing.assert_array_equal(np.asarray(v, np.float64), logical[k])

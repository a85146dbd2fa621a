"""What a user would otherwise call, made ready to time: PyTorch eager, torch.compile of the
same function, cuDNN's frontend called directly, ONNX Runtime.

Each maker returns a no-argument callable or raises Unavailable with the reason (torch not
installed, no GPU, the case has no PyTorch or ONNX form...), which the driver prints. The
PyTorch baselines and fusegraph's torch-facing plans share one set of device tensors, laid
out with the graph's strides (channels-last stays channels-last), filled from the same
host values every contender gets.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fusegraph.dtypes import DataType

if TYPE_CHECKING:
    from fusegraph.bench.cases import Case
    from fusegraph.graph.graph import Graph


class Unavailable(Exception):
    """A baseline that cannot run here; the message says why."""


def have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def torch_dtype(torch: Any, dt: DataType) -> Any:
    table = {DataType.FLOAT: torch.float32, DataType.HALF: torch.float16, DataType.BFLOAT16: torch.bfloat16,
             DataType.DOUBLE: torch.float64, DataType.BOOLEAN: torch.bool, DataType.INT32: torch.int32,
             DataType.INT64: torch.int64, DataType.INT8: torch.int8, DataType.UINT8: torch.uint8}
    if dt not in table:
        raise Unavailable(f"no PyTorch dtype for {dt}")
    return table[dt]


def torch_inputs(g: Graph, host: Mapping[str, np.ndarray], device: str) -> dict[str, Any]:
    """The graph's inputs as PyTorch tensors on ``device`` with the graph's strides."""
    import torch

    out = {}
    for t in g.inputs():
        a = np.ascontiguousarray(host[t.name])
        src = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if t.dtype == DataType.BFLOAT16
               else torch.from_numpy(a))
        x = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(torch, t.dtype), device=device)
        x.copy_(src.reshape(t.shape))
        out[t.name] = x
    return out


def device_inputs(g: Graph, rng: np.random.Generator, device: str = "cuda") -> dict[str, Any]:
    """Uniform(-1, 1) inputs made straight on the device (benchmarks/bench_gpu.py's)."""
    import torch

    out = {}
    for t in g.inputs():
        dt = torch_dtype(torch, t.dtype)
        x = torch.empty_strided(t.shape, t.strides, dtype=dt, device=device)
        x.copy_(torch.from_numpy(rng.uniform(-1, 1, t.shape).astype(np.float32)).to(dt))
        out[t.name] = x
    return out


def _need_torch() -> None:
    if not have_torch():
        raise Unavailable("PyTorch is not installed (pip install 'fusegraph[torch]')")


def eager(case: Case, tensors: dict[str, Any]) -> Callable[[], Any]:
    _need_torch()
    fn = case.eager
    if fn is None:
        raise Unavailable(case.no_eager or "this case has no PyTorch form")
    with contextlib.suppress(Exception):  # as a user benchmarking cuDNN convolutions would
        import torch

        torch.backends.cudnn.benchmark = True
    return lambda: fn(tensors)


def compiled(case: Case, tensors: dict[str, Any]) -> Callable[[], Any]:
    _need_torch()
    fn = case.eager
    if fn is None:
        raise Unavailable(case.no_eager or "this case has no PyTorch form")
    import torch

    try:
        c = torch.compile(fn)
        c(tensors)  # compiles here, so a compiler that is missing says so now
    except Exception as exc:
        raise Unavailable(f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    return lambda: c(tensors)


def cudnn_direct(g: Graph, tensors: dict[str, Any], device: str) -> Callable[[], Any]:
    """cuDNN's frontend as its users call it: the same cuDNN graph fusegraph's cudnn engine
    lowers, built with cuDNN's heuristic (A, then FALLBACK) and run with
    ``graph.execute(pack, workspace)`` on outputs allocated once."""
    if not device.startswith("cuda"):
        raise Unavailable("cuDNN's frontend runs on NVIDIA GPUs only (--device cuda:0)")
    _need_torch()
    import torch

    from fusegraph.engines.registry import active_registry

    try:
        eng: Any = active_registry().get("cudnn")
    except (KeyError, ValueError) as exc:
        raise Unavailable(f"no cudnn engine: {exc}") from None
    avail = eng.available()
    if not avail:
        raise Unavailable(f"cuDNN's frontend is not available: {avail.reason}")
    from fusegraph.engines.cudnn import lower, rules

    cudnn, _ = eng._load()
    index = torch.device(device).index or 0
    h = eng.cudnn_handle(index)
    b = rules.binding(g)
    if b.preps:
        raise Unavailable("the graph needs fusegraph's own preparation steps (batchnorm), not part of a direct call")
    cg = lower.lower(g, b, cudnn, h)
    cg.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    ws = torch.empty(max(1, cg.get_workspace_size()), dtype=torch.uint8, device=device)
    pack: dict[int, Any] = {b.uids[n]: v for n, v in tensors.items()}
    for t in g.outputs():
        pack[b.uids[t.name]] = torch.empty_strided(t.shape, t.strides, dtype=torch_dtype(torch, t.dtype), device=device)
    for uid, (value, dt) in b.scalars.items():
        pack[uid] = torch.full([1] * b.rank, value, dtype=torch_dtype(torch, dt))
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
    out = pack[b.uids[g.outputs()[0].name]]

    def call() -> Any:
        cg.execute(pack, ws, handle=h)
        return out

    return call


def ort_session(case: Case, host: Mapping[str, np.ndarray], device: str) -> Callable[[], Any]:
    """ONNX Runtime on the case's ONNX form, on its CPU provider (or CUDA's where installed)."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable("this ONNX Runtime has no CUDA provider (the CPU build); --compare ort is for --device cpu")
        providers = ["CUDAExecutionProvider"]
    if case.onnx is None:
        raise Unavailable(case.no_onnx or "this case has no ONNX form")
    try:
        model = case.onnx()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=providers)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"ONNX Runtime cannot run it: {first}") from None
    names = [i.name for i in sess.get_inputs()]
    feed = {n: np.ascontiguousarray(host[n]) for n in names}
    return lambda: sess.run(None, feed)[0]

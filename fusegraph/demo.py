"""`fusegraph demo`: the main job, end to end on one fused graph.

Builds conv + bias + ReLU (NHWC, f16 I/O, f32 compute), runs it on the chosen engine and
checks it against an independent computation (PyTorch when installed, else a direct
NumPy loop-nest over the definition).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import fusegraph as fg
from fusegraph.graph.layout import empty_strided


def build_graph(n: int = 4, c: int = 32, hw: int = 28, k: int = 64) -> tuple[fg.Graph, dict[str, Any]]:
    g = fg.Graph(
        name="conv_bias_relu",
        io_data_type=fg.DataType.HALF,
        intermediate_data_type=fg.DataType.FLOAT,
        compute_data_type=fg.DataType.FLOAT,
    )
    x = g.tensor("x", [n, c, hw, hw], fg.strides_for([n, c, hw, hw], "NHWC"))
    w = g.tensor("w", [k, c, 3, 3], fg.strides_for([k, c, 3, 3], "KRSC"))
    b = g.tensor("b", [1, k, 1, 1])
    conv = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv")
    y = g.relu(g.bias(conv, b, name="bias"), name="relu").set_name("y").set_output(True)
    g.validate()
    return g, {"x": x, "w": w, "b": b, "y": y}


def random_like(t: fg.TensorAttr, rng: np.random.Generator) -> np.ndarray:
    arr = empty_strided(t.shape, t.strides, t.dtype.numpy)
    arr[...] = rng.standard_normal(t.shape).astype(np.float32)
    return arr


def independent_conv_bias_relu(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Same math, computed without fusegraph (PyTorch in float64 if present, else einsum)."""
    x64, w64, b64 = (np.asarray(a, dtype=np.float64) for a in (x, w, b))
    try:
        import torch

        out = torch.nn.functional.conv2d(torch.from_numpy(x64), torch.from_numpy(w64), padding=1)
        y = out.numpy() + b64
    except ImportError:
        xp = np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)))
        h, wd = x64.shape[2:]
        y = np.zeros((x64.shape[0], w64.shape[0], h, wd))
        for r in range(3):
            for s in range(3):
                y += np.einsum("nchw,kc->nkhw", xp[:, :, r : r + h, s : s + wd], w64[:, :, r, s])
        y += b64
    return np.maximum(y, 0.0)


def main(engine: str | None = None, device: str = "cpu") -> int:
    rng = np.random.default_rng()
    g, t = build_graph()
    print(f"graph '{g.name}': {len(g.nodes)} nodes, key {g.key()[:16]}")
    for node in g.nodes:
        print(f"  {node.name:6s} {node.kind.value:12s} -> {node.outputs[next(iter(node.outputs))].dim}")
    arrays = {name: random_like(t[name], rng) for name in ("x", "w", "b")}
    y = empty_strided(t["y"].shape, t["y"].strides, t["y"].dtype.numpy)
    pack = {t[n]: a for n, a in arrays.items()} | {t["y"]: y}
    handle = fg.Handle(device)
    t0 = time.perf_counter()
    plan = g.build(handle, engine=engine)
    plan.execute(pack)
    dt = time.perf_counter() - t0
    ref = independent_conv_bias_relu(arrays["x"], arrays["w"], arrays["b"])
    out = y.astype(np.float64)
    rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    max_abs = float(np.max(np.abs(out - ref)))
    how = "asked for" if engine else "chosen by fusegraph"
    print(f"engine: {plan.engine} ({how}) on {handle.device}, build + first execute {dt * 1e3:.1f} ms")
    print(f"output {t['y'].dim} {t['y'].dtype.name} NHWC, checksum (sum) {float(out.sum()):.4f}")
    print(f"error vs independent computation: relative {rel:.2e}, max abs {max_abs:.2e}")
    ok = rel <= 1e-2 and bool(np.isfinite(out).all())
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1

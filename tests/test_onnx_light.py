"""The nine light_*.onnx architectures of the onnx wheel run through the session and match
ONNX Runtime on random inputs.

The light models' weights are ConstantOfShape fills of one value, which makes every class
score equal and would hide most errors; so each model is also run with random weights
(same graph, the fills replaced by random initializers) and compared on its logits too.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import fusegraph.onnx as fgo

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = sorted(p.stem.removeprefix("light_") for p in LIGHT.glob("light_*.onnx"))
# Cold-cache compiles of 20-75 s each (weights of up to half a gigabyte): marked slow, so
# that the default run keeps three architectures (~1 minute with a cold compile cache).
HEAVY = {"vgg19", "zfnet512", "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2"}


def randomized(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """The model with every ConstantOfShape weight replaced by a random initializer
    (He-scaled filters and matrices, positive variances), plus the softmax's input as an
    extra output so that the logits are compared too."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    shapes = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    role: dict[str, tuple[str, int]] = {}
    for n in g.node:
        for k, i in enumerate(n.input):
            role.setdefault(i, (n.op_type, k))
    keep = []
    for n in g.node:
        if n.op_type != "ConstantOfShape" or n.input[0] not in shapes:
            keep.append(n)
            continue
        shape = tuple(int(d) for d in shapes[n.input[0]])
        op, k = role.get(n.output[0], ("", 0))
        if op in ("Conv", "Gemm") and k == 1:
            fan_in = math.prod(shape[1:]) if op == "Conv" else min(shape)
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(math.sqrt(2.0 / fan_in))
        elif op == "BatchNormalization" and k in (1, 4):
            arr = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            arr = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        g.initializer.append(numpy_helper.from_array(arr, n.output[0]))
        g.input.append(helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, list(shape)))
    del g.node[:]
    g.node.extend(keep)
    soft = [n for n in g.node if n.op_type == "Softmax"]
    if soft:
        inferred = onnx.shape_inference.infer_shapes(m)
        vi = [v for v in inferred.graph.value_info if v.name == soft[-1].input[0]]
        g.output.extend(vi)
    return m


def _check(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} output {k}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        assert not np.isnan(g).any(), f"{what} output {k}: NaN"
        err = np.linalg.norm(g.astype(np.float64) - w) / np.linalg.norm(w.astype(np.float64))
        mx = float(np.abs(g.astype(np.float64) - w).max())
        # Tens of f32 layers: 1e-4 relative (per-op f32 ~1e-5 accumulates over the depth).
        assert err < 1e-4, f"{what} output {k}: relative error {err:.2e}, max abs {mx:.2e}"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in MODELS]
)
def test_light_model_matches_onnxruntime(name: str, rng: np.random.Generator, tmp_path: Path) -> None:
    path = LIGHT / f"light_{name}.onnx"
    sess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {"cache_dir": str(_cache())})])
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
    feed = {sess.get_inputs()[0].name: x}
    _check(sess.run(None, feed), ref.run(None, feed), name)
    report = sess.partition_report()
    assert report.running_nodes > 0 and report.fusegraph_nodes > 0, str(report)

    model = randomized(onnx.load(str(path)), rng)
    sess = fgo.InferenceSession(model, providers=[(fgo.PROVIDER, {"cache_dir": str(_cache())})])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    _check(sess.run(None, feed), ref.run(None, feed), f"{name} (random weights)")


def _cache() -> Path:
    """One compile cache shared by the runs (and by later test sessions on this machine)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusegraph"))

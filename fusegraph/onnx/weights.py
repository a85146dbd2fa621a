"""Random weights for ONNX models that ship without real ones.

The light models of the onnx wheel (``onnx/backend/test/data/light``) keep their
architecture but not their weights: every weight is a ``ConstantOfShape`` fill of one
value. Run as shipped, every class score is equal (the softmax is uniform) and most
numerical errors cancel out, so a comparison against ONNX Runtime says little. The tests
and the benchmark therefore run them with random weights of a sensible scale -- He-scaled
filters and matrices, so that activations neither vanish nor explode through tens of
layers; positive batch-norm scales and variances -- and compare the logits (the softmax's
input) as well as the probabilities.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["WEIGHT_INPUTS", "expose_logits", "randomize_weights"]

log = logging.getLogger("fusegraph.onnx")

#: Input positions that hold weights, per op type: the plain float initializers read there
#: are the ones :func:`randomize_weights` replaces when asked to (``initializers``).
WEIGHT_INPUTS: dict[str, frozenset[int]] = {
    "Conv": frozenset({1, 2}),
    "ConvTranspose": frozenset({1, 2}),
    "Gemm": frozenset({1, 2}),
    "MatMul": frozenset({1}),
    "BatchNormalization": frozenset({1, 2, 3, 4}),
    "InstanceNormalization": frozenset({1, 2}),
    "LayerNormalization": frozenset({1, 2}),
}

# Ops that only move or re-type a weight on its way to the op that uses it (ONNX exports
# of Caffe2 models reshape the classifier's matrix, unsqueeze batch-norm affines, ...):
# a weight's role is the one of the first reader past them.
_PASS_THROUGH = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast"})

# The fills of positive per-channel parameters (scales and variances): uniform on
# [0.5, 1.5], so that normalization neither blows up nor flips signs.
_POSITIVE = frozenset({("BatchNormalization", 1), ("BatchNormalization", 4),
                       ("InstanceNormalization", 1), ("LayerNormalization", 1)})

_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                          onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def randomize_weights(
    model: onnx.ModelProto,
    rng: np.random.Generator,
    *,
    expose_logits: bool = True,
    initializers: bool | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with random weights of a sensible scale; ``model`` is left as is.

    Weights are (a) the outputs of float ``ConstantOfShape`` nodes whose shape is a
    constant (an initializer or a ``Constant`` node) -- the light models' convention --,
    which become initializers of the same name; and (b) when ``initializers`` is true,
    the float initializers read at a weight position of a known op (:data:`WEIGHT_INPUTS`),
    replaced in place. ``initializers=None`` (the default) means (b) only for a model
    that has no weight of kind (a), so that models with real weights get random ones
    too while the light models keep the few small real vectors they ship.

    A weight's values depend on its role, i.e. on the first node that reads it (past
    reshapes, unsqueezes and casts): filters of ``Conv``/``ConvTranspose`` and matrices of
    ``Gemm``/``MatMul`` are normal with He's variance ``2 / fan_in`` (``fan_in`` read
    from the weight's own shape and, for ``Gemm``, ``transB``); normalization scales and
    batch-norm variances are uniform on [0.5, 1.5]; everything else (biases, means,
    per-channel affines) is normal with standard deviation 0.1. Values keep the fill's or
    initializer's dtype.

    With ``expose_logits``, the input of the model's last ``Softmax`` is appended to the
    graph outputs (typed by shape inference) unless it is one already, so that a
    comparison sees the logits: the probabilities of a softmax hide most logit errors.

    Shape initializers left unread by the removed fills are dropped. For IR versions
    below 4, where an initializer must also be a graph input, the new initializers are
    listed as inputs too.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    consts = _constant_values(g)
    readers = _first_readers(g.node)
    legacy_inputs = m.ir_version < 4

    fills = []
    for n in g.node:
        if n.op_type == "ConstantOfShape" and _fill_dtype(n) in _FLOAT_TYPES and n.input[0] in consts:
            fills.append(n)
    if initializers is None:
        initializers = not fills

    dropped = {id(n) for n in fills}
    new_inits: list[onnx.TensorProto] = []
    for n in fills:
        shape = tuple(int(d) for d in consts[n.input[0]].ravel())
        arr = _random(shape, _role(n.output[0], readers), rng)
        new_inits.append(numpy_helper.from_array(arr.astype(_np_dtype(_fill_dtype(n))), n.output[0]))
    kept = [n for n in g.node if id(n) not in dropped]
    del g.node[:]
    g.node.extend(kept)

    replaced = 0
    if initializers:
        for k, t in enumerate(g.initializer):
            if t.data_type not in _FLOAT_TYPES:
                continue
            op, pos, reader = _role(t.name, readers)
            if pos not in WEIGHT_INPUTS.get(op, frozenset()):
                continue
            arr = _random(tuple(t.dims), (op, pos, reader), rng)
            g.initializer[k].CopyFrom(numpy_helper.from_array(arr.astype(_np_dtype(t.data_type)), t.name))
            replaced += 1

    _drop_unread(g, {n.input[0] for n in fills})
    g.initializer.extend(new_inits)
    if legacy_inputs:
        listed = {i.name for i in g.input}
        for t in new_inits:
            if t.name not in listed:
                g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    if expose_logits:
        _expose_logits(m)
    log.debug("randomize_weights: %d fills and %d initializers replaced", len(fills), replaced)
    return m


def _constant_values(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    out = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def _first_readers(nodes: Iterable[onnx.NodeProto]) -> dict[str, tuple[onnx.NodeProto, int]]:
    readers: dict[str, tuple[onnx.NodeProto, int]] = {}
    for n in nodes:
        for k, name in enumerate(n.input):
            if name:
                readers.setdefault(name, (n, k))
    return readers


def _role(
    name: str, readers: dict[str, tuple[onnx.NodeProto, int]]
) -> tuple[str, int, onnx.NodeProto | None]:
    """(op type, input position, node) of the first reader of ``name`` past pass-through ops."""
    seen = set()
    while name in readers and name not in seen:
        seen.add(name)
        node, k = readers[name]
        if node.op_type in _PASS_THROUGH and k == 0 and node.output:
            name = node.output[0]
            continue
        return node.op_type, k, node
    return "", 0, None


def _fan_in(shape: tuple[int, ...], op: str, node: onnx.NodeProto | None) -> int:
    if not shape:
        return 1
    if op == "Conv":
        return math.prod(shape[1:])
    if op == "ConvTranspose":  # (C_in, C_out / groups, k...): each output reads C_in * k taps at most
        return shape[0] * math.prod(shape[2:])
    if op == "Gemm":
        trans_b = 0
        if node is not None:
            trans_b = next((int(a.i) for a in node.attribute if a.name == "transB"), 0)
        return shape[-1] if trans_b else math.prod(shape) // max(shape[-1], 1)
    # MatMul: (..., K, N)
    return shape[-2] if len(shape) >= 2 else shape[0]


def _random(
    shape: tuple[int, ...], role: tuple[str, int, onnx.NodeProto | None], rng: np.random.Generator
) -> np.ndarray:
    op, pos, node = role
    if op in ("Conv", "ConvTranspose", "Gemm", "MatMul") and pos == 1:
        std = math.sqrt(2.0 / max(_fan_in(shape, op, node), 1))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if (op, pos) in _POSITIVE:
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)


def _fill_dtype(n: onnx.NodeProto) -> int:
    for a in n.attribute:
        if a.name == "value":
            return int(a.t.data_type)
    return onnx.TensorProto.FLOAT  # ConstantOfShape's default fill: float32 zero


def _np_dtype(data_type: int) -> np.dtype[np.generic]:
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))


def _drop_unread(g: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers (and their graph-input entries) among ``names`` that no
    node and no graph output reads any more."""
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    gone = names - read
    if not gone:
        return
    inits = [t for t in g.initializer if t.name not in gone]
    del g.initializer[:]
    g.initializer.extend(inits)
    inputs = [i for i in g.input if i.name not in gone]
    del g.input[:]
    g.input.extend(inputs)


def expose_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with the last Softmax's input (the logits) as an extra output.

    Why: a softmax of large, nearly equal logits (the light models as shipped: constant
    weights, logits ~1e8 in SqueezeNet) turns summation-order noise of one ulp into a
    different winner, so only the logits -- and the softmax with a bound derived from
    them -- can be compared across runtimes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _expose_logits(m)
    return m


def _expose_logits(m: onnx.ModelProto) -> None:
    soft = [n for n in m.graph.node if n.op_type == "Softmax"]
    if not soft:
        return
    name = soft[-1].input[0]
    if any(o.name == name for o in m.graph.output):
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(m).graph.value_info
    except Exception as err:  # shape inference gives up on some models; the dtype is enough
        log.debug("randomize_weights: shape inference failed (%s); logits output left untyped", err)
        inferred = []
    vi = next((v for v in inferred if v.name == name), None)
    if vi is None:
        elem = next((o.type.tensor_type.elem_type for o in m.graph.output if o.name == soft[-1].output[0]),
                    onnx.TensorProto.FLOAT)
        vi = helper.make_tensor_value_info(name, elem, None)
    m.graph.output.append(vi)

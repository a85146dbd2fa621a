"""Types of ONNX Runtime contrib-op outputs, so that what follows them can be claimed.

ONNX shape inference knows no ``com.microsoft`` op: in a model ONNX Runtime's transformer
optimizer wrote (``SkipLayerNormalization``, ``BiasGelu``, ``Attention``, ...), every value
after the first contrib op has no inferred shape, and each node reading one stays on ONNX
Runtime ("the shape of ... is unknown"). Here the output types of the contrib ops the op
table lowers (or refuses with a reason) are derived from their inputs as ONNX Runtime's
schemas define them, and ONNX shape inference runs again from there, in rounds until no
contrib op gains a type (one contrib op can read another's output).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import onnx
from onnx import helper, numpy_helper

from fusegraph.onnx.ir import OnnxGraph, ONode, TypeInfo

log = logging.getLogger("fusegraph.onnx")

CONTRIB = "com.microsoft"
_SAME_AS_INPUT = frozenset({"BiasGelu", "FastGelu", "Gelu", "QuickGelu", "RotaryEmbedding", "BiasAdd"})
_SKIP_NORMS = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})


def _known(og: OnnxGraph, name: str) -> TypeInfo | None:
    if not name:
        return None
    shape = og.shape(name)
    elem = og.elem(name)
    return TypeInfo(elem, shape) if elem and shape is not None else None


def _attention(og: OnnxGraph, n: ONode) -> dict[str, TypeInfo]:
    x, w = _known(og, n.inputs[0]), _known(og, n.inputs[1]) if len(n.inputs) > 1 else None
    if x is None or w is None or x.shape is None or w.shape is None or len(x.shape) != 3 or len(w.shape) != 2:
        return {}
    sizes = [int(s) for s in n.attr("qkv_hidden_sizes", [])]
    v = sizes[2] if len(sizes) == 3 else w.shape[1] // 3
    return {n.outputs[0]: TypeInfo(x.elem, (x.shape[0], x.shape[1], v))}


def _mha(og: OnnxGraph, n: ONode) -> dict[str, TypeInfo]:
    q = _known(og, n.inputs[0])
    v = _known(og, n.inputs[2]) if len(n.inputs) > 2 else None
    if q is None or v is None or q.shape is None or v.shape is None or len(q.shape) != 3 or len(v.shape) != 3:
        return {}
    return {n.outputs[0]: TypeInfo(q.elem, (q.shape[0], q.shape[1], v.shape[2]))}


def _gqa(og: OnnxGraph, n: ONode) -> dict[str, TypeInfo]:
    q = _known(og, n.inputs[0])
    heads, kv = int(n.attr("num_heads", 0)), int(n.attr("kv_num_heads", 0))
    if q is None or q.shape is None or len(q.shape) != 3 or heads < 1 or kv < 1:
        return {}
    b, s, width = q.shape
    packed = len(n.inputs) < 2 or not n.inputs[1]
    parts = heads + 2 * kv if packed else heads
    if width % parts:
        return {}
    head = width // parts
    out = {n.outputs[0]: TypeInfo(q.elem, (b, s, heads * head))}
    past = n.inputs[3] if len(n.inputs) > 3 else ""
    pk = _known(og, past) if past else None
    if not past or (pk is not None and pk.shape is not None and len(pk.shape) == 4 and pk.shape[2] == 0):
        # no cached positions: present_key/present_value are the new keys/values, BNSH
        out.update({o: TypeInfo(q.elem, (b, kv, s, head)) for o in n.outputs[1:3] if o})
    return out


def _rule(n: ONode) -> Callable[[OnnxGraph, ONode], dict[str, TypeInfo]] | None:
    if n.domain in ("", "ai.onnx") and n.op_type == "SimplifiedLayerNormalization":
        return lambda og, n: {n.outputs[0]: t} if (t := _known(og, n.inputs[0])) else {}
    if n.domain != CONTRIB:
        return None
    if n.op_type in _SAME_AS_INPUT:
        return lambda og, n: {n.outputs[0]: t} if (t := _known(og, n.inputs[0])) else {}
    if n.op_type in _SKIP_NORMS:
        def skip(og: OnnxGraph, n: ONode) -> dict[str, TypeInfo]:
            t = _known(og, n.inputs[0])
            if t is None:
                return {}
            return {o: t for k, o in enumerate(n.outputs) if o and k in (0, 3)}
        return skip
    return {"Attention": _attention, "MultiHeadAttention": _mha, "GroupQueryAttention": _gqa}.get(n.op_type)


def infer_contrib_types(og: OnnxGraph) -> int:
    """Gives contrib outputs their types and infers the values after them; returns how many
    contrib outputs gained a type."""
    gained = 0
    while True:
        new: dict[str, TypeInfo] = {}
        for n in og.nodes:
            rule = _rule(n)
            if rule is None or all(_known(og, o) is not None for o in n.outputs if o):
                continue
            for name, t in rule(og, n).items():
                if _known(og, name) is None:
                    new[name] = t
        if not new:
            return gained
        og.types.update(new)
        gained += len(new)
        _reinfer(og)


def _reinfer(og: OnnxGraph) -> None:
    """ONNX shape inference over the graph with every typed contrib output as an input."""
    ruled = {o for n in og.nodes if _rule(n) is not None for o in n.outputs if o}
    typed = {o for o in ruled if _known(og, o) is not None}
    nodes = [n for n in og.nodes if not (set(n.outputs) & typed)]
    ins: list[onnx.ValueInfoProto] = []
    for name in [*og.inputs, *sorted(typed)]:
        t = og.types.get(name)
        if t is not None and t.elem and t.shape is not None:
            ins.append(helper.make_tensor_value_info(name, t.elem, list(t.shape)))
    used = {i for n in nodes for i in n.all_inputs()}
    inits = [numpy_helper.from_array(a, k) for k, a in og.constants.items() if k in used and a.size <= 64]
    ins += [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
        for k, a in og.constants.items() if k in used and a.size > 64
    ]
    graph = helper.make_graph([n.to_proto() for n in nodes], "contrib_types", ins,
                              [onnx.ValueInfoProto(name=o) for o in og.outputs], inits)
    model = helper.make_model(graph, opset_imports=og.opset_imports, ir_version=max(og.ir_version, 4))
    model.functions.extend(og.functions)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # what is known stays known; the rest stays on ONNX Runtime
        log.info("shape inference after contrib ops failed: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if not vi.name or vi.name in og.constants or _known(og, vi.name) is not None:
            continue
        tt = vi.type.tensor_type
        if not tt.elem_type or not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if all(d >= 0 for d in dims):
            og.types[vi.name] = TypeInfo(tt.elem_type, tuple(dims))

"""Specializing a loaded model: the input shapes fixed, ONNX shape inference run, and every
constant computation (Constant, ConstantOfShape, and shape subgraphs such as Shape ->
Gather -> Unsqueeze -> Concat feeding a Reshape) folded into arrays, leaving the nodes that
really run on each call (an ``OnnxGraph``).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusegraph.onnx.ir import OnnxGraph, ONode, TypeInfo
from fusegraph.onnx.load import (
    MAX_ELEMENTS,
    ModelError,
    _element_count,
    _first_line,
    _subgraphs,
    default_opset,
)

log = logging.getLogger("fusegraph.onnx")

# Constants up to this many elements stay initializers during shape inference (so that
# data propagation sees shape tensors); bigger ones are passed as typed inputs, which
# keeps shape inference from copying hundreds of megabytes of weights.
_SMALL_CONST = 4096

# Rounds of shape inference + folding before giving up on a fixed point (a safety bound only).
_MAX_FOLD_ROUNDS = 256

# A fold whose result has more elements than this is skipped when it would duplicate a weight
# (its big constant input is read elsewhere too), so constant folding never doubles weights.
FOLD_MAX_ELEMENTS = 1 << 20

# No fold produces more elements than this (a ConstantOfShape of 2**40 is left to run, where
# the absurd-size check refuses it): folding must never be how a model exhausts memory.
FOLD_LIMIT = 1 << 26

# Never folded even when every input is constant: their output is not a function of it.
_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)



# ---- parsing ---------------------------------------------------------------------------------
def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {i.values.name for i in graph.sparse_initializer}
    reads: set[str] = set()
    for n in graph.node:
        for i in n.input:
            if i and i not in defined:
                reads.add(i)
        for a in n.attribute:
            for g in _subgraphs(a):
                reads |= {r for r in _outer_reads(g) if r not in defined}
        defined |= set(n.output)
    for o in graph.output:
        if o.name not in defined:
            reads.add(o.name)
    return reads


def _node_names(graph: onnx.GraphProto) -> list[str]:
    """Every node's name, made unique (a missing or repeated name gets a numbered one)."""
    taken: set[str] = set()
    names = []
    for i, p in enumerate(graph.node):
        name = p.name
        if not name or name in taken:
            base = p.name or f"{p.op_type}_{i}"
            name, k = base, 0
            while name in taken:
                k += 1
                name = f"{base}_{k}"
        taken.add(name)
        names.append(name)
    return names


def _parse_node(p: onnx.NodeProto, name: str) -> ONode:
    attrs: dict[str, Any] = {}
    implicit: set[str] = set()
    for a in p.attribute:
        subs = _subgraphs(a)
        if subs:
            for g in subs:
                implicit |= _outer_reads(g)
            attrs[a.name] = a  # kept as the proto: only ORT runs these
        else:
            attrs[a.name] = helper.get_attribute_value(a)
    return ONode(
        name, p.op_type, p.domain, tuple(p.input), tuple(p.output), attrs, p,
        sources=(name,), implicit_inputs=tuple(sorted(implicit - set(p.input))),
    )


def _parse_nodes(graph: onnx.GraphProto) -> list[ONode]:
    return [_parse_node(p, name) for p, name in zip(graph.node, _node_names(graph), strict=True)]


def _constant_value(node: ONode) -> np.ndarray | None:
    """The value of a Constant node (every attribute form), or None for string/sparse kinds."""
    a = node.attrs
    if "value" in a:
        return numpy_helper.to_array(a["value"])
    if "value_float" in a:
        return np.array(a["value_float"], dtype=np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], dtype=np.float32)
    if "value_int" in a:
        return np.array(a["value_int"], dtype=np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], dtype=np.int64)
    if "sparse_value" in a:
        return _sparse_to_dense(a["sparse_value"])
    return None


def _type_info(t: onnx.TypeProto) -> TypeInfo:
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        shape: tuple[int, ...] | None = None
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            shape = None if any(d < 0 for d in dims) else tuple(dims)
        return TypeInfo(int(tt.elem_type), shape, t)
    return TypeInfo(0, None, t)


# ---- specialization: shapes fixed, constants folded -------------------------------------------
def specialize(
    model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]],
    initializers: Mapping[str, np.ndarray] | None = None, *, cache_dir: str | os.PathLike[str] | None = None,
) -> OnnxGraph:
    """The model's graph for these input shapes, with every constant computation folded.
    ``initializers``: values of the model's initializers already at hand (read-only views of
    the bytes it was parsed from: ``load.initializer_views``); the others are converted.
    Where the cache is on, the result is kept in ``cache_dir`` (else the default cache
    directory) and a later call for the same model and shapes loads it
    (``specialized_cache``)."""
    from fusegraph.onnx import specialized_cache

    g = model.graph
    constants: dict[str, np.ndarray] = {}
    given = initializers or {}
    for init in g.initializer:
        arr = given.get(init.name)
        constants[init.name] = arr if arr is not None else numpy_helper.to_array(init)
    for sp in g.sparse_initializer:
        constants[sp.values.name] = _sparse_to_dense(sp)
    entry = specialized_cache.entry_for(model, input_shapes, constants, cache_dir)
    if entry is not None:
        kept = entry.load(model, constants)
        if kept is not None:
            return kept
    model_constants = dict(constants)
    inputs = [i.name for i in g.input if i.name not in constants]
    input_types: dict[str, TypeInfo] = {}
    for i in g.input:
        if i.name in constants:
            continue
        info = _type_info(i.type)
        if i.name in input_shapes:
            info = TypeInfo(info.elem, tuple(int(d) for d in input_shapes[i.name]), info.proto)
        input_types[i.name] = info
    nodes = _parse_nodes(g)
    all_names = [n.name for n in nodes]
    opset = default_opset(model)
    og = OnnxGraph(
        nodes=nodes,
        inputs=inputs,
        outputs=[o.name for o in g.output],
        constants=constants,
        types=dict(input_types),
        opset=opset,
        opset_imports=list(model.opset_import),
        ir_version=int(model.ir_version),
        functions=list(model.functions),
        all_node_names=all_names,
    )
    # Each round infers shapes, then folds what became constant, to a fixed point: a value's
    # shape can hang on the previous block's folded Reshape target, so a deep model needs a
    # round per block (torchvision Swin-T: 17 rounds, ~0.07 s each; 8 left 1,100 shape nodes).
    _check_shape_constants(og)
    for _ in range(_MAX_FOLD_ROUNDS):
        _infer_types(og, model, input_types)
        if not _fold_constants(og):
            break
    _prune_dead(og)
    _check_sizes(og)
    if entry is not None:
        entry.store(og, model, model_constants)
    return og


# Ops whose output size is read from a shape-like constant input (input index).
_SHAPED_BY = {"ConstantOfShape": 0, "Expand": 1}


def _shape_constant_sizes(og: OnnxGraph) -> Iterable[tuple[ONode, str, int]]:
    for node in og.nodes:
        i = _SHAPED_BY.get(node.op_type)
        if i is None or not node.is_default_domain or len(node.inputs) <= i:
            continue
        arr = og.constants.get(node.inputs[i])
        if arr is None or arr.dtype.kind not in "iu" or arr.ndim != 1:
            continue
        yield node, node.inputs[i], _element_count(abs(int(d)) for d in arr) or 0


def _check_shape_constants(og: OnnxGraph) -> None:
    """Refuses a ConstantOfShape/Expand to an absurd constant shape before ONNX shape
    inference sees it: its data propagation materializes such values (std::bad_alloc at
    best; with memory overcommit, the process is killed)."""
    for node, name, n in _shape_constant_sizes(og):
        if n > MAX_ELEMENTS:
            raise ModelError(
                f"{node.op_type} to the constant shape '{name}' {og.constants[name].tolist()} "
                f"would make {n} elements (more than {MAX_ELEMENTS})",
                node=node.name, tensor=node.outputs[0] if node.outputs else name,
            )


def _check_sizes(og: OnnxGraph) -> None:
    """Refuses values whose inferred static size no machine could hold (see MAX_ELEMENTS)."""
    producers = og.producers()
    for name, info in og.types.items():
        if info.shape is None:
            continue
        n = _element_count(info.shape) or 0
        if n > MAX_ELEMENTS:
            node = producers.get(name)
            raise ModelError(
                f"value '{name}' would have shape {list(info.shape)} ({n} elements, more than "
                f"{MAX_ELEMENTS})", node=node.name if node is not None else None, tensor=name,
            )


def _sparse_to_dense(sp: onnx.SparseTensorProto) -> np.ndarray:
    vals = numpy_helper.to_array(sp.values)
    dense = np.zeros(tuple(sp.dims), dtype=vals.dtype)
    idx = numpy_helper.to_array(sp.indices)
    if idx.ndim == 1:
        dense.reshape(-1)[idx] = vals
    else:
        dense[tuple(idx.T)] = vals
    return dense


def _infer_types(og: OnnxGraph, model: onnx.ModelProto, input_types: Mapping[str, TypeInfo]) -> None:
    """Runs ONNX shape inference on the remaining nodes; records every value's type."""
    graph_inputs = []
    for name in og.inputs:
        t = input_types[name]
        if t.elem and t.shape is not None:
            graph_inputs.append(helper.make_tensor_value_info(name, t.elem, list(t.shape)))
        elif t.proto is not None:
            vi = onnx.ValueInfoProto()
            vi.name = name
            vi.type.CopyFrom(t.proto)
            graph_inputs.append(vi)
    used = {i for n in og.nodes for i in n.all_inputs()} | set(og.outputs)
    # shapes of big ConstantOfShape/Expand results stay unknown rather than materialized by
    # data propagation (see _check_shape_constants)
    hidden = {name for _, name, n in _shape_constant_sizes(og) if n > FOLD_LIMIT}
    inits = []
    for name, arr in og.constants.items():
        if name not in used:
            continue
        if (arr.size <= _SMALL_CONST or arr.dtype == object) and name not in hidden:
            inits.append(numpy_helper.from_array(arr, name))
        else:
            graph_inputs.append(
                helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))
            )
    outs = [onnx.ValueInfoProto(name=o) for o in og.outputs]
    graph = helper.make_graph([n.to_proto() for n in og.nodes], "infer", graph_inputs, outs, inits)
    m = helper.make_model(graph, opset_imports=og.opset_imports, ir_version=max(og.ir_version, 4))
    m.functions.extend(og.functions)
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception as exc:  # a partial answer is still useful; nodes with unknown shapes stay on ORT
        log.info("ONNX shape inference failed (%s); continuing with what is known", _first_line(exc))
        inferred = m
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name and vi.name not in og.constants:
            info = _type_info(vi.type)
            old = og.types.get(vi.name)
            if old is None or (old.shape is None and info.shape is not None) or not old.elem:
                og.types[vi.name] = info
    for name, t in input_types.items():
        og.types[name] = t


def _fold_constants(og: OnnxGraph) -> bool:
    """Evaluates nodes whose inputs are all known; True when anything was folded."""
    changed = False
    keep: list[ONode] = []
    readers = collections.Counter(i for n in og.nodes for i in set(n.all_inputs()))
    readers.update(og.outputs)
    for node in og.nodes:
        if _would_duplicate(og, node, readers):
            keep.append(node)
            continue
        value = _try_fold(og, node)
        if value is None:
            keep.append(node)
            continue
        for name, arr in zip(node.outputs, value, strict=False):
            if name:
                og.constants[name] = arr
                og.types.pop(name, None)
        og.folded.extend(node.sources)
        changed = True
    og.nodes = keep
    return changed


def _would_duplicate(og: OnnxGraph, node: ONode, readers: Mapping[str, int]) -> bool:
    """Folding would keep a big constant alive beside a big derived copy of it (a Transpose or
    Cast of a weight something else also reads): such nodes run instead. A constant with no
    other reader is dropped after the fold (``_prune_dead``), so that fold copies nothing."""
    shared = [
        i for i in node.inputs
        if i in og.constants and og.constants[i].size > FOLD_MAX_ELEMENTS and readers.get(i, 0) > 1
    ]
    if not shared:
        return False
    for o in node.outputs:
        shape = og.shape(o) if o else ()
        if shape is None or int(np.prod(shape)) > FOLD_MAX_ELEMENTS:
            return True
    return False


def _try_fold(og: OnnxGraph, node: ONode) -> list[np.ndarray] | None:
    if not node.is_default_domain or node.op_type in _NONDETERMINISTIC or node.implicit_inputs:
        return None
    if any(isinstance(v, onnx.AttributeProto) for v in node.attrs.values()):
        return None
    if node.op_type == "Constant":
        v = _constant_value(node)
        return [v] if v is not None else None
    if node.op_type in ("Shape", "Size") and node.inputs and node.inputs[0]:
        shape = og.shape(node.inputs[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        start, end = node.attr("start", 0), node.attr("end", None)
        return [np.array(shape[slice(start, end)], dtype=np.int64)]
    present = [i for i in node.inputs if i]
    if not present and node.op_type not in ("ConstantOfShape",):
        return None
    if any(i not in og.constants for i in present):
        return None
    args = [og.constants[i] if i else None for i in node.inputs]
    for o in node.outputs:  # never materialize a huge constant (shape inference knows its size)
        shape = og.shape(o) if o else None
        if shape is not None and (_element_count(shape) or 0) > FOLD_LIMIT:
            return None
    try:
        out = _evaluate(og, node, args)
    except Exception as exc:  # leave it to run; ORT will report a real problem
        log.debug("could not fold %s (%s): %s", node.name, node.op_type, exc)
        return None
    if out is None:
        return None
    out = [np.asarray(o) if isinstance(o, np.ndarray | np.generic) else o for o in out]
    if any(not isinstance(o, np.ndarray) or o.dtype == object for o in out):
        return None
    return out


def _evaluate(og: OnnxGraph, node: ONode, args: Sequence[np.ndarray | None]) -> list[np.ndarray] | None:
    """Fast paths for the shape-computing ops; everything else through onnx.reference."""
    op = node.op_type
    x = args[0] if args else None
    if op == "ConstantOfShape":
        t = node.attr("value")
        fill = numpy_helper.to_array(t).reshape(-1) if t is not None else np.zeros(1, np.float32)
        shape = tuple(int(d) for d in (x if x is not None else []))
        if (_element_count(shape) or 0) > FOLD_LIMIT:
            return None  # left to run (specialize refuses absurd sizes)
        return [np.full(shape, fill[0], dtype=fill.dtype)]
    if op == "Identity" and x is not None:
        return [x]
    if op == "Unsqueeze" and x is not None:
        axes = node.attr("axes") if og.opset < 13 else (args[1] if len(args) > 1 else None)
        if axes is None:
            return None
        rank = x.ndim + len(axes)
        out = x
        for a in sorted(int(a) % rank for a in axes):
            out = np.expand_dims(out, a)
        return [out]
    if op == "Concat":
        arrs = [a for a in args if a is not None]
        return [np.concatenate(arrs, axis=int(node.attr("axis", 0)))]
    if op == "Gather" and x is not None and args[1] is not None:
        axis = int(node.attr("axis", 0))
        idx = args[1].astype(np.int64)
        idx = np.where(idx < 0, idx + x.shape[axis], idx)
        return [np.take(x, idx, axis=axis)]
    if op == "GatherElements" and x is not None and args[1] is not None:
        # onnx.reference's GatherElements goes through np.choose, which takes at most 32
        # choices, and its fallback is wrong (BERT's token-type ids over 128 positions)
        axis = int(node.attr("axis", 0)) % x.ndim
        idx = args[1].astype(np.int64)
        return [np.take_along_axis(x, np.where(idx < 0, idx + x.shape[axis], idx), axis=axis)]
    return _reference_eval(og, node, args)


def _reference_eval(og: OnnxGraph, node: ONode, args: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if a is not None else "" for i, a in enumerate(args)]
    outs = [f"out{i}" if o else "" for i, o in enumerate(node.outputs)]
    p = helper.make_node(node.op_type, names, outs, domain=node.domain or None, **node.attrs)
    vis = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
        for n, a in zip(names, args, strict=True)
        if a is not None
    ]
    ovis = [onnx.ValueInfoProto(name=o) for o in outs if o]
    graph = helper.make_graph([p], "fold", vis, ovis)
    model = helper.make_model(graph, opset_imports=og.opset_imports, ir_version=max(og.ir_version, 4))
    ev = ReferenceEvaluator(model)
    feeds = {n: a for n, a in zip(names, args, strict=True) if a is not None}
    res = ev.run(None, feeds)
    return [np.asarray(r) for r in res]


def _prune_dead(og: OnnxGraph) -> None:
    """Drops nodes none of whose outputs is read or returned (after folding, many are)."""
    while True:
        live = set(og.outputs) | {i for n in og.nodes for i in n.all_inputs()}
        keep = [n for n in og.nodes if any(o and o in live for o in n.outputs)]
        if len(keep) == len(og.nodes):
            break
        og.nodes = keep
    live = set(og.outputs) | {i for n in og.nodes for i in n.all_inputs()}
    for name in [c for c in og.constants if c not in live]:
        del og.constants[name]



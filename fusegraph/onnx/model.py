"""The ONNX model as the provider sees it: loaded, checked, upgraded, specialized.

``load_model`` turns whatever the user handed to the session (a path, bytes, a
ModelProto) into a checked ModelProto at opset >= 7, or raises :class:`ModelError` that
says what is wrong -- never a raw protobuf traceback. ``specialize`` fixes the input
shapes, runs ONNX shape inference and folds every constant computation (Constant,
ConstantOfShape, and shape subgraphs such as Shape -> Gather -> Unsqueeze -> Concat
feeding a Reshape) into arrays, leaving the nodes that really run on each call.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusegraph.errors import ValidationError

log = logging.getLogger("fusegraph.onnx")

MIN_OPSET = 7  # older models are upgraded to this with onnx.version_converter
MAX_OPSET = 22  # newest default-domain opset whose semantics the importer knows
DEFAULT_DOMAINS = ("", "ai.onnx")

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


class ModelError(ValidationError):
    """The ONNX model cannot be read or is malformed; says what and, when known, where."""


@dataclass(frozen=True)
class TypeInfo:
    """What shape inference knows of one value."""

    elem: int  # onnx.TensorProto data type; 0 when not a tensor or unknown
    shape: tuple[int, ...] | None  # static dims, None when unknown or symbolic
    proto: onnx.TypeProto | None = None  # the full type (sequences, optionals), for sub-models

    @property
    def is_tensor(self) -> bool:
        return self.elem != 0

    @property
    def numpy_dtype(self) -> np.dtype[Any] | None:
        if not self.elem:
            return None
        try:
            return np.dtype(helper.tensor_dtype_to_np_dtype(self.elem))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class ONode:
    """One ONNX node, attributes parsed; ``sources`` names the original nodes it stands for."""

    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]  # "" marks an absent optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    proto: onnx.NodeProto | None  # the original node; None once a rewrite changed it
    sources: tuple[str, ...] = ()
    implicit_inputs: tuple[str, ...] = ()  # outer-scope values read by subgraph attributes
    source_ops: tuple[str, ...] = ()  # op types of ``sources`` when a rewrite merged nodes

    def origin(self) -> list[tuple[str, str]]:
        """(name, op type) of every original node this one stands for."""
        ops = self.source_ops or (self.op_type,) * len(self.sources)
        return list(zip(self.sources, ops, strict=True))

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    @property
    def is_default_domain(self) -> bool:
        return self.domain in DEFAULT_DOMAINS

    def all_inputs(self) -> tuple[str, ...]:
        """Every value the node reads: its inputs (absent ones dropped) and outer-scope reads."""
        return tuple(i for i in self.inputs if i) + self.implicit_inputs

    def to_proto(self) -> onnx.NodeProto:
        if self.proto is not None:
            p = onnx.NodeProto()
            p.CopyFrom(self.proto)
            p.name = self.name
            return p
        return helper.make_node(
            self.op_type, list(self.inputs), list(self.outputs), name=self.name,
            domain=self.domain or None, **self.attrs,
        )


@dataclass
class OnnxGraph:
    """An ONNX graph specialized to concrete input shapes, constants folded away."""

    nodes: list[ONode]  # topological order; only what runs on each call
    inputs: list[str]  # graph inputs fed by the caller
    outputs: list[str]
    constants: dict[str, np.ndarray]
    types: dict[str, TypeInfo]
    opset: int  # of the default domain
    opset_imports: list[onnx.OperatorSetIdProto]
    ir_version: int
    functions: list[onnx.FunctionProto] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)  # original nodes folded into constants
    all_node_names: list[str] = field(default_factory=list)  # every original node

    def producers(self) -> dict[str, ONode]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[ONode]]:
        out: dict[str, list[ONode]] = {}
        for n in self.nodes:
            for i in n.all_inputs():
                out.setdefault(i, []).append(n)
        return out

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.constants:
            return tuple(self.constants[name].shape)
        t = self.types.get(name)
        return t.shape if t is not None else None

    def elem(self, name: str) -> int:
        if name in self.constants:
            return int(helper.np_dtype_to_tensor_dtype(self.constants[name].dtype))
        t = self.types.get(name)
        return t.elem if t is not None else 0


# ---- loading ---------------------------------------------------------------------------------
def load_model(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """A checked ModelProto at opset >= MIN_OPSET, or ModelError saying what is wrong.

    Hostile models are refused before anything is read on their behalf: external data must
    lie in regular files inside the model's directory (no absolute locations, no ``..``, no
    symlink leading out; offset and length within the file), opsets must be ones ONNX
    defines, and every initializer must hold as many values as its dims say.
    """
    base_dir: Path | None = None
    if isinstance(source, onnx.ModelProto):
        model = source
    elif isinstance(source, bytes | bytearray | memoryview):
        try:
            model = onnx.load_from_string(bytes(source))
        except Exception as exc:
            raise ModelError(f"the bytes are not an ONNX model (protobuf decode failed: {exc})") from None
    elif isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise ModelError(f"no ONNX model file at '{path}'")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:
            raise ModelError(f"'{path}' is not an ONNX model (protobuf decode failed: {exc})") from None
        base_dir = path.parent
    else:
        raise ModelError(
            f"expected a path, bytes or onnx.ModelProto, got {type(source).__name__}"
        )
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError("the model has no graph (no nodes and no outputs)")
    _check_opsets(model)
    _check_domains(model)
    _load_external_data(model, base_dir)
    _check_initializers(model)
    try:
        onnx.checker.check_model(model)
    except ValueError as exc:  # over 2 GB: the checker wants a path; check what we can
        log.debug("checker skipped: %s", exc)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the ONNX checker rejects the model: {_first_line(exc)}") from None
    version = default_opset(model)
    if version < MIN_OPSET:
        _fix_legacy_prelu(model)
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as exc:
            raise ModelError(
                f"opset {version} is older than {MIN_OPSET} and onnx.version_converter could "
                f"not upgrade it: {_first_line(exc)}"
            ) from None
        log.info("upgraded the model from opset %d to %d", version, MIN_OPSET)
    return model


# ---- hostile-model checks ----------------------------------------------------------------------
# A tensor with more elements than this cannot exist on any machine fusegraph runs on
# (2**36 f32 values are 256 GiB): declaring one is a malformed model, not a big one.
MAX_ELEMENTS = 1 << 36


def _check_opsets(model: onnx.ModelProto) -> None:
    newest = onnx.defs.onnx_opset_version()
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS and not 1 <= o.version <= newest:
            raise ModelError(
                f"the model imports default-domain opset {o.version}; ONNX {onnx.__version__} "
                f"defines opsets 1 to {newest}"
            )


# Operator domains ONNX Runtime's CPU build registers kernels or schemas for.
KNOWN_DOMAINS = frozenset({
    *DEFAULT_DOMAINS, "ai.onnx.ml", "ai.onnx.preview.training", "com.microsoft",
    "com.microsoft.nchwc", "com.microsoft.experimental", "com.ms.internal.nhwc", "org.pytorch.aten",
})


def _check_domains(model: onnx.ModelProto) -> None:
    """A node in a domain neither ONNX Runtime nor the model (its local functions) defines
    cannot run anywhere: ONNX Runtime would open it and fail in run() with a raw error."""
    local = {(f.domain, f.name) for f in model.functions}
    for i, n in enumerate(model.graph.node):
        if n.domain not in KNOWN_DOMAINS and (n.domain, n.op_type) not in local:
            raise ModelError(
                f"node '{n.name or f'{n.op_type}_{i}'}' ({n.domain}:{n.op_type}) is in domain "
                f"'{n.domain}', which neither ONNX Runtime nor the model's local functions define"
            )


def _all_tensors(graph: onnx.GraphProto) -> Iterable[onnx.TensorProto]:
    """Every TensorProto of a graph: initializers, sparse values, node attributes, subgraphs."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
            for sub in _subgraphs(a):
                yield from _all_tensors(sub)


def _load_external_data(model: onnx.ModelProto, base_dir: Path | None) -> None:
    """Reads external tensor data from inside ``base_dir`` only (see :func:`load_model`)."""
    tensors = [t for t in _all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    for f in model.functions:
        for node in f.node:
            for a in node.attribute:
                if a.HasField("t") and a.t.data_location == onnx.TensorProto.EXTERNAL:
                    tensors.append(a.t)
    if not tensors:
        return
    if base_dir is None:
        raise ModelError(
            f"tensor '{tensors[0].name}' keeps its data in an external file, but the model was "
            "given in memory: pass the model's path so that its external data can be found",
            tensor=tensors[0].name,
        )
    real_base = os.path.realpath(base_dir)
    for t in tensors:
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")

        def bad(why: str, t: onnx.TensorProto = t, location: str = location) -> ModelError:
            return ModelError(f"external data '{location}' of tensor '{t.name}' {why}", tensor=t.name)

        if not location:
            raise bad("names no location")
        if os.path.isabs(location) or Path(location).drive or location.startswith(("/", "\\")):
            raise bad("is an absolute path; external data must lie in the model's directory")
        if ".." in Path(location.replace("\\", "/")).parts:
            raise bad("contains '..'; external data must lie in the model's directory")
        real = os.path.realpath(os.path.join(real_base, location))
        if os.path.commonpath([real, real_base]) != real_base:
            raise bad(f"resolves to '{real}', outside the model's directory {real_base} (a symlink?)")
        if not os.path.isfile(real):
            raise bad(f"is missing or not a regular file (looked for '{real}')")
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError:
            raise bad(f"has a malformed offset/length ({info.get('offset')!r}, {info.get('length')!r})") from None
        size = os.path.getsize(real)
        if offset < 0 or (length is not None and length < 0):
            raise bad(f"has a negative offset or length ({offset}, {length})")
        end = size if length is None else offset + length
        if end > size:
            raise bad(f"asks for bytes {offset}..{end} of a {size}-byte file")
        want = _element_count(t.dims)
        itemsize = _itemsize(t.data_type)
        if want is not None and itemsize and end - offset != want * itemsize:
            raise bad(f"holds {end - offset} bytes; dims {list(t.dims)} need {want * itemsize}")
        with open(real, "rb") as fh:
            fh.seek(offset)
            t.raw_data = fh.read(end - offset)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def _element_count(dims: Iterable[int]) -> int | None:
    n = 1
    for d in dims:
        if d < 0:
            return None
        n *= int(d)
    return n


def _itemsize(data_type: int) -> int:
    try:
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        return 0


_FIELD_OF: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float_data", onnx.TensorProto.DOUBLE: "double_data",
    onnx.TensorProto.INT64: "int64_data", onnx.TensorProto.UINT64: "uint64_data",
    onnx.TensorProto.STRING: "string_data",
}


# Sub-byte types pack values into bytes: their counts are left to the checker.
_UNCHECKED = frozenset(
    getattr(onnx.TensorProto, n) for n in ("UNDEFINED", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, n)
)


def _check_initializers(model: onnx.ModelProto) -> None:
    """Each initializer holds as many values as its dims say, and no absurd count."""
    for t in _all_tensors(model.graph):
        if any(d < 0 for d in t.dims):
            raise ModelError(f"tensor '{t.name}' has negative dims {list(t.dims)}", tensor=t.name)
        n = _element_count(t.dims) or 0
        if n > MAX_ELEMENTS:
            raise ModelError(
                f"tensor '{t.name}' declares dims {list(t.dims)} ({n} elements, more than "
                f"{MAX_ELEMENTS}): a malformed model", tensor=t.name,
            )
        if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type in _UNCHECKED:
            continue
        if t.HasField("raw_data"):
            itemsize = _itemsize(t.data_type)
            if not itemsize:
                continue
            have = len(t.raw_data) // itemsize
        else:
            have = len(getattr(t, _FIELD_OF.get(t.data_type, "int32_data")))
            if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
                have //= 2
        if have != n:
            raise ModelError(
                f"tensor '{t.name}' declares dims {list(t.dims)} ({n} values) but holds {have}",
                tensor=t.name,
            )


def _fix_legacy_prelu(model: onnx.ModelProto) -> None:
    """Before opset 7, PRelu's slope of shape [C] applied per channel (axis 1); the version
    converter keeps [C], which numpy-broadcasts against the last axis instead. Reshapes such
    slopes to [C, 1, ...] so that the upgraded model means what the old one did."""
    ranks = {
        i.name: len(i.type.tensor_type.shape.dim)
        for i in list(model.graph.input) + list(model.graph.value_info)
        if i.type.HasField("tensor_type") and i.type.tensor_type.HasField("shape")
    }
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        slope = inits[node.input[1]]
        rank = ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            arr = numpy_helper.to_array(slope).reshape((-1,) + (1,) * (rank - 2))
            slope.CopyFrom(numpy_helper.from_array(arr, slope.name))
            for i in model.graph.input:
                if i.name == slope.name:
                    i.CopyFrom(helper.make_tensor_value_info(slope.name, slope.data_type, list(arr.shape)))


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    return 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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


def _subgraphs(a: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if a.type == onnx.AttributeProto.GRAPH:
        return [a.g]
    if a.type == onnx.AttributeProto.GRAPHS:
        return list(a.graphs)
    return []


def _parse_nodes(graph: onnx.GraphProto) -> list[ONode]:
    taken: set[str] = set()
    nodes = []
    for i, p in enumerate(graph.node):
        name = p.name
        if not name or name in taken:
            base = p.name or f"{p.op_type}_{i}"
            name, k = base, 0
            while name in taken:
                k += 1
                name = f"{base}_{k}"
        taken.add(name)
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
        nodes.append(
            ONode(
                name, p.op_type, p.domain, tuple(p.input), tuple(p.output), attrs, p,
                sources=(name,), implicit_inputs=tuple(sorted(implicit - set(p.input))),
            )
        )
    return nodes


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


def input_signature(model: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...] | None]:
    """Declared dims of the caller-fed inputs (ints, symbolic names or None)."""
    inits = {i.name for i in model.graph.initializer} | {
        i.values.name for i in model.graph.sparse_initializer
    }
    out: dict[str, tuple[int | str | None, ...] | None] = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        if not i.type.HasField("tensor_type") or not tt.HasField("shape"):
            out[i.name] = None
            continue
        out[i.name] = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
    return out


# ---- specialization: shapes fixed, constants folded -------------------------------------------
def specialize(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> OnnxGraph:
    """The model's graph for these input shapes, with every constant computation folded."""
    g = model.graph
    constants: dict[str, np.ndarray] = {}
    for init in g.initializer:
        constants[init.name] = numpy_helper.to_array(init)
    for sp in g.sparse_initializer:
        constants[sp.values.name] = _sparse_to_dense(sp)
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


def iter_values(nodes: Iterable[ONode]) -> Iterable[str]:
    for n in nodes:
        yield from n.all_inputs()
        yield from (o for o in n.outputs if o)

"""Loading an ONNX model: whatever the user handed to the session (a path, bytes, a
ModelProto) becomes a checked ModelProto at opset >= 7, or :class:`ModelError` says what
is wrong -- never a raw protobuf traceback. Hostile models (external data outside the
model's directory, unknown opsets or domains, initializers contradicting their dims) are
refused before anything is read on their behalf.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusegraph import __version__
from fusegraph.errors import ValidationError
from fusegraph.onnx.ir import DEFAULT_DOMAINS
from fusegraph.runtime.cache_dir import cache_enabled, cache_root, read_table, update_table

log = logging.getLogger("fusegraph.onnx")

MIN_OPSET = 7  # older models are upgraded to this with onnx.version_converter
MAX_OPSET = 22  # newest default-domain opset whose semantics the importer knows


class ModelError(ValidationError):
    """The ONNX model cannot be read or is malformed; says what and, when known, where."""



# ---- loading ---------------------------------------------------------------------------------
def load_model(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto, cache_dir: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """A checked ModelProto at opset >= MIN_OPSET, or ModelError saying what is wrong
    (:func:`load_model_with_views`, without the views)."""
    return _load(source, cache_dir, views=False)[0]


def load_model_with_views(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """:func:`load_model`, and the initializers it could read without a copy: read-only
    NumPy views of the bytes the model was parsed from (:func:`initializer_views`; none
    for a ModelProto, external data or an upgraded opset), for ``specialize``. A file that
    passed the checks before comes back lean (lean_model.py): its initializers of 4 KiB or
    more hold no data in the ModelProto, and their views are their only values -- keep the
    views for as long as anything reads the model's initializers."""
    return _load(source, cache_dir, views=True)


def _load(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto, cache_dir: str | os.PathLike[str] | None, *, views: bool
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A checked ModelProto at opset >= MIN_OPSET, or ModelError saying what is wrong.

    Hostile models are refused before anything is read on their behalf: external data must
    lie in regular files inside the model's directory (no absolute locations, no ``..``, no
    symlink leading out; offset and length within the file), opsets must be ones ONNX
    defines, and every initializer must hold as many values as its dims say.

    A file this fusegraph and ONNX version already checked, unchanged since (the same
    resolved path, size and mtime), skips ``onnx.checker`` and the initializer counts: a
    record in the cache directory (``cache_dir``, else the default one) says it passed.
    """
    base_dir: Path | None = None
    data: bytes | None = None  # the model's serialized bytes as read, where the checker may take them
    checked: CheckedRecord | None = None  # the file's record, where the model came as a file
    passed = False  # the file as read passed the checks before
    lean: dict[str, np.ndarray] | None = None  # the views of a model parsed without its weights' bytes
    if isinstance(source, onnx.ModelProto):
        model = source
    elif isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        try:
            model = onnx.load_from_string(data)
        except Exception as exc:
            raise ModelError(f"the bytes are not an ONNX model (protobuf decode failed: {exc})") from None
    elif isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise ModelError(f"no ONNX model file at '{path}'")
        binary = (onnx.serialization.registry.get_format_from_file_extension(path.suffix) or "protobuf") == "protobuf"
        try:
            if binary:  # read once: the bytes are parsed here and handed to the checker as they are
                checked = CheckedRecord.of(path, cache_dir)
                data = path.read_bytes()
                if checked is not None and not checked.unchanged(len(data)):
                    checked = None  # the file changed while it was read: checked, and not recorded
                passed = checked is not None and checked.passed()
                model, lean = _lean_or_whole(data, views and passed)
            else:  # a text format (.onnxtxt, .json): onnx.load picks its parser by the extension
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
    if _load_external_data(model, base_dir):
        data = None  # the model now holds its external data: the bytes read are not all of it
        checked = None  # the external files are not in the record's key: checked every time
    if checked is not None and passed:
        log.debug("%s: checked before (same size and mtime), not checked again", checked.path)
    else:
        _check_initializers(model)
        _check(model, data)
        if checked is not None:
            checked.record()
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
        return model, {}
    if lean is not None:
        return model, lean
    return model, (initializer_views(data, model) if views and data is not None else {})


def _lean_or_whole(data: bytes, lean: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray] | None]:
    """The model in ``data``, and where ``lean`` (a file that passed the checks before, read
    with views) and the bytes allow it, parsed without its large initializers' bytes with
    the views that stand for them (lean_model.py; ~0.2 s of ViT-B/16's warm open). Only a
    model the session can open as a file again and needs no conversion of is lean: external
    data and opsets up to MIN_OPSET (upgraded, or run whole on ONNX Runtime from the proto)
    are parsed whole."""
    if lean:
        from fusegraph.onnx.lean_model import lean_parse

        found = lean_parse(data)
        if found is None:
            log.debug("parsed whole: the model's bytes did not walk as lean_model expects")
        else:
            model, views = found
            external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
            if not external and default_opset(model) > MIN_OPSET:
                return model, views
            log.debug("parsed whole: %s", "external data" if external else f"opset {default_opset(model)}")
    return onnx.load_model_from_string(data), None


# ---- initializers as views of the model's bytes -------------------------------------------------
# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer,
# TensorProto.name / raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_NAME, _TENSOR_RAW = 7, 5, 8, 9
# dtypes whose raw_data is the array's bytes as they are (sub-byte and string types are not)
_VIEWABLE = frozenset(
    getattr(onnx.TensorProto, n) for n in (
        "FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
        "UINT32", "UINT64", "BOOL", "COMPLEX64", "COMPLEX128", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2",
        "FLOAT8E5M2FNUZ",
    ) if hasattr(onnx.TensorProto, n)
)


class _Wire(Exception):
    """The bytes are not laid out as the walk expects: no views (the copies are made)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Wire("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _spans(data: bytes, start: int, end: int) -> Iterable[tuple[int, int, int, int, int]]:
    """(field number, wire type, tag start, payload start, payload end) of one message's
    fields; for a varint field the payload is the varint itself."""
    pos = start
    while pos < end:
        tag_at = pos
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, after = _varint(data, pos)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            after = pos + length
        elif wire == 5:
            after = pos + 4
        else:  # groups: not in onnx.proto
            raise _Wire(f"wire type {wire}")
        if after > end:
            raise _Wire("a field runs past its message")
        yield number, wire, tag_at, pos, after
        pos = after


def _fields(data: bytes, start: int, end: int) -> Iterable[tuple[int, int, int, int]]:
    """:func:`_spans` without the tag's start."""
    for number, wire, _, payload, after in _spans(data, start, end):
        yield number, wire, payload, after


def _one(data: bytes, start: int, end: int, number: int) -> tuple[int, int] | None:
    """The payload of the message field ``number`` where it occurs once (protobuf merges
    repeated occurrences of a message field: those are left to the parser)."""
    found = [(a, b) for n, w, a, b in _fields(data, start, end) if n == number and w == 2]
    if len(found) > 1:
        raise _Wire(f"field {number} occurs {len(found)} times")
    return found[0] if found else None


def initializer_views(data: bytes, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The model's initializers that hold their values in ``raw_data`` as read-only NumPy
    views of ``data``, the bytes ``model`` was parsed from, instead of copies:
    ``numpy_helper.to_array`` copies each (``raw_data`` comes out of protobuf as new
    bytes), 0.22 s of a warm ViT-B/16 session's setup for 346 MB (H200 host). The bytes'
    protobuf fields are walked to find each tensor's ``raw_data``; a view is made only
    where the walk agrees with the parsed model (the same initializers in the same order,
    names equal, one ``raw_data`` of exactly the bytes its dims and type need) and the host
    is little-endian (ONNX's byte order); anything else (typed fields such as
    ``float_data``, external data, sub-byte or string types) is left to ``to_array``.
    The views keep ``data`` alive while any of them lives, and may be unaligned (NumPy and
    torch read such arrays; anything that writes into an initializer copies it first)."""
    if sys.byteorder != "little":
        return {}
    inits = model.graph.initializer
    try:
        graph = _one(data, 0, len(data), _MODEL_GRAPH)
        if graph is None:
            return {}
        spans = [(a, b) for n, w, a, b in _fields(data, *graph) if n == _GRAPH_INITIALIZER and w == 2]
        if len(spans) != len(inits):
            return {}
        out: dict[str, np.ndarray] = {}
        for (a, b), t in zip(spans, inits, strict=True):
            name = raw = None
            count_raw = 0
            for n, w, x, y in _fields(data, a, b):
                if n == _TENSOR_NAME and w == 2:
                    name = (x, y)
                elif n == _TENSOR_RAW and w == 2:
                    raw, count_raw = (x, y), count_raw + 1
            if name is None or data[name[0]:name[1]].decode("utf-8", "replace") != t.name:
                return {}  # not the parsed model's order: trust nothing of the walk
            if raw is None or count_raw != 1 or t.data_type not in _VIEWABLE or t.HasField("segment"):
                continue
            if t.data_location != onnx.TensorProto.DEFAULT or not t.HasField("raw_data"):
                continue
            found = raw_view(data, t, *raw)
            if found is not None:
                out[t.name] = found
        return out
    except _Wire as exc:
        log.debug("initializers copied: the model's bytes did not walk (%s)", exc)
        return {}


def raw_view(data: bytes, t: onnx.TensorProto, start: int, end: int) -> np.ndarray | None:
    """``data[start:end]`` as ``t``'s array, a read-only view (None where those bytes are not
    exactly what its dims and type need)."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    n_el = _element_count(t.dims)
    if n_el is None or n_el * dtype.itemsize != end - start:
        return None
    return np.frombuffer(data, dtype=dtype, count=n_el, offset=start).reshape(tuple(t.dims))


# ---- files checked before ------------------------------------------------------------------------
CHECKED_FILE = "onnx-checked.json"
CHECKED_KEEP = 512  # records kept (the oldest go): one per model file version opened
CHECKS = 1  # bump when the checks below change within one fusegraph version


class CheckedRecord:
    """Whether a model file, as it is now, passed the checker and the initializer counts
    under this fusegraph and ONNX version: ``onnx.checker`` took 0.25 s of a warm ViT-B/16
    session's setup (H200 host) and says the same of the same bytes every time. The file's
    identity is its resolved path, size and mtime (ns), as the floor's verdicts key it; a
    file rewritten in place gets a new mtime and is checked again."""

    def __init__(self, path: str, key: str, table: Path, size: int, mtime_ns: int) -> None:
        self.path, self.key, self.table = path, key, table
        self.size, self.mtime_ns = size, mtime_ns

    @classmethod
    def of(cls, path: Path, cache_dir: str | os.PathLike[str] | None) -> CheckedRecord | None:
        """The file's record handle; None where caching is off or the file cannot be stat'ed."""
        if not cache_enabled():
            return None
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            return None
        ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|fusegraph {__version__}|onnx {onnx.__version__}|checks {CHECKS}"
        table = (Path(cache_dir) if cache_dir else cache_root()) / CHECKED_FILE
        return cls(real, hashlib.sha256(ident.encode()).hexdigest(), table, st.st_size, st.st_mtime_ns)

    def unchanged(self, size_read: int) -> bool:
        """The file still is what its key says after it was read (``size_read`` bytes)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return size_read == self.size == st.st_size and st.st_mtime_ns == self.mtime_ns

    def passed(self) -> bool:
        return self.key in read_table(self.table)

    def record(self) -> None:
        """Notes that the file passed; a cache that cannot be written only costs the next check."""
        def add(table: dict[str, object]) -> None:
            table[self.key] = time.time()
            if len(table) > CHECKED_KEEP:
                for old in sorted(table, key=lambda k: _stamp(table[k]))[: len(table) - CHECKED_KEEP]:
                    del table[old]

        try:
            update_table(self.table, add)
        except OSError as exc:
            log.debug("could not record that %s passed the checks: %s", self.path, exc)


def _stamp(v: object) -> float:
    return float(v) if isinstance(v, int | float) else 0.0


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


def _subgraphs(a: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if a.type == onnx.AttributeProto.GRAPH:
        return [a.g]
    if a.type == onnx.AttributeProto.GRAPHS:
        return list(a.graphs)
    return []


def _load_external_data(model: onnx.ModelProto, base_dir: Path | None) -> bool:
    """Reads external tensor data from inside ``base_dir`` only (see :func:`load_model`);
    True where it read any (the model changed)."""
    tensors = [t for t in _all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    for f in model.functions:
        for node in f.node:
            for a in node.attribute:
                if a.HasField("t") and a.t.data_location == onnx.TensorProto.EXTERNAL:
                    tensors.append(a.t)
    if not tensors:
        return False
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
    return True


def _check(model: onnx.ModelProto, data: bytes | None) -> None:
    """``onnx.checker`` on the model, or ModelError with its first line. Given the bytes the
    model was parsed from (nothing changed it since), the checker reads those: handed a
    ModelProto it serializes it first, which took 0.65 s of a warm ViT-B/16 session's
    setup (344 MB of weights, H200 host). Where the checker's own parser refuses bytes that
    the Python one read, the ModelProto is checked as before."""
    if data is not None and len(data) <= onnx.checker.MAXIMUM_PROTOBUF:
        try:
            onnx.checker.check_model(data)
            return
        except onnx.checker.ValidationError as exc:
            raise ModelError(f"the ONNX checker rejects the model: {_first_line(exc)}") from None
        except Exception as exc:  # its parser's refusal (a ValueError): the parsed model decides
            log.debug("the checker did not parse the bytes (%s): checking the parsed model", _first_line(exc))
    try:
        onnx.checker.check_model(model)
    except ValueError as exc:  # over 2 GB: the checker wants a path; check what we can
        log.debug("checker skipped: %s", exc)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the ONNX checker rejects the model: {_first_line(exc)}") from None


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



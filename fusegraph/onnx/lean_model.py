"""A model file parsed without its weights' bytes (issue 24 item 6, a warm session's open):
``onnx.load_model_from_string`` copies every initializer's ``raw_data`` out of the bytes read
(ViT-B/16's 346 MB: 0.21 s of a warm open on an H100, 0.24 s on the 2-core CPU), and the
session then reads those weights as views of the same bytes (``load.initializer_views``)
anyway. ``lean_parse`` hands protobuf a copy of the bytes without the large ``raw_data``
fields (164 KB for that model: parsed in 0.1 ms) and returns each initializer's value as a
read-only NumPy view of the bytes read, found by the same walk of the wire format.

A lean model's large initializers hold their dims and type but no data: only a caller that
keeps the views for as long as it reads the model's initializers may ask for one (the
session does: ``load.load_model_with_views``, files checked before). ``stripped`` tells a
lean model. Anything the walk does not expect (a field repeated, typed data, external data,
a type whose bytes are not its array's, a big-endian host) gives None: the caller parses
the bytes whole, as before.

Why a module: the wire-level surgery is one idea, apart from loading and checking (load.py).
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from fusegraph.onnx.load import (
    _GRAPH_INITIALIZER,
    _MODEL_GRAPH,
    _TENSOR_NAME,
    _TENSOR_RAW,
    _VIEWABLE,
    _element_count,
    _spans,
    _Wire,
    raw_view,
)

LEAN_MIN_BYTES = 4096  # raw_data at least this long is left out of the parse (the rest costs nothing to copy)
_TYPED = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def lean_parse(data: bytes, min_bytes: int = LEAN_MIN_BYTES) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The model in ``data`` parsed without the ``raw_data`` of initializers of at least
    ``min_bytes``, and every initializer ``load.initializer_views`` would view, as such a
    view of ``data``; None where the bytes are not laid out as expected, or where what is
    left out is less than half of them (parse them whole)."""
    if sys.byteorder != "little":
        return None
    try:
        return _lean(data, min_bytes)
    except (_Wire, UnicodeDecodeError, DecodeError):
        return None


def _lean(data: bytes, min_bytes: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    top = list(_spans(data, 0, len(data)))
    graphs = [s for s in top if s[0] == _MODEL_GRAPH and s[1] == 2]
    if len(graphs) != 1:  # protobuf merges repeated message fields: left to the parser
        return None
    _, _, g_tag, g_start, g_end = graphs[0]
    view = memoryview(data)  # slices without copies: the join below is the one copy
    parts: list[bytes | memoryview] = []
    found: list[tuple[str, tuple[int, int], bool]] = []  # initializer name, raw_data span, left out
    for number, wire, tag_at, start, end in _spans(data, g_start, g_end):
        if number != _GRAPH_INITIALIZER or wire != 2:
            parts.append(view[tag_at:end])
            continue
        fields = list(_spans(data, start, end))
        names = [(a, b) for n, w, _, a, b in fields if n == _TENSOR_NAME and w == 2]
        raws = [(t, a, b) for n, w, t, a, b in fields if n == _TENSOR_RAW and w == 2]
        if len(names) != 1 or len(raws) > 1:
            return None
        name = data[names[0][0]:names[0][1]].decode("utf-8")
        if not raws:
            found.append((name, (0, 0), False))
            parts.append(view[tag_at:end])
            continue
        raw_tag, a, b = raws[0]
        out = b - a >= min_bytes
        found.append((name, (a, b), out))
        parts.append(_field(_GRAPH_INITIALIZER, data[start:raw_tag] + data[b:end]) if out else view[tag_at:end])
    left_out = sum(b - a for _, (a, b), out in found if out)
    if 2 * left_out < len(data):  # the weights are elsewhere (Constant nodes, say): a lean parse
        return None  # would copy the rest twice to save less than half
    graph = b"".join(parts)
    lean_bytes = b"".join((view[:g_tag], _field(_MODEL_GRAPH, graph), view[g_end:]))
    model = onnx.ModelProto.FromString(lean_bytes)
    inits = model.graph.initializer
    if len(inits) != len(found):
        return None
    views: dict[str, np.ndarray] = {}
    for t, (name, (a, b), out) in zip(inits, found, strict=True):
        if t.name != name:
            return None
        viewable = (t.data_type in _VIEWABLE and not t.HasField("segment")
                    and t.data_location == onnx.TensorProto.DEFAULT and not any(len(getattr(t, f)) for f in _TYPED))
        if out and not viewable:
            return None  # its value is not its raw bytes: only the whole parse can give it
        if not viewable or not (out or t.HasField("raw_data")):
            continue
        array = raw_view(data, t, a, b)
        if array is None:
            if out:
                return None
            continue
        views[t.name] = array
    return model, views


def stripped(model: onnx.ModelProto) -> bool:
    """Whether ``model`` came from ``lean_parse`` with initializers left out (a tensor of a
    raw type with elements, no external data, and no data at all: a whole parse never gives
    one that the checker passed)."""
    for t in model.graph.initializer:
        if (t.data_location == onnx.TensorProto.DEFAULT and t.data_type in _VIEWABLE and not t.HasField("raw_data")
                and not any(len(getattr(t, f)) for f in _TYPED) and (_element_count(t.dims) or 0) > 0):
            return True
    return False


__all__ = ["LEAN_MIN_BYTES", "lean_parse", "stripped"]

"""What ``specialize`` produced for a model and input shapes, kept in the cache directory so
that a later session (in this process or another) loads it instead of inferring types and
folding constants again: for a warm torchvision Swin-T session that work was half of its
setup (5,680 nodes folded in 7 rounds of shape inference).

The result depends only on the model's content, the input shapes and the code that
computed it, so that is the key: the model's nodes, inputs, outputs, functions and opsets
as serialized, every initializer's name, dtype and shape, the bytes of the small ones, the
input shapes, and the versions of fusegraph, ONNX, NumPy and ml_dtypes with a digest of
the modules that specialize. Hashing every weight would cost a tenth of a second per
100 MB; instead an entry records the big initializers folding read values from (rarely
any: a weight transposed or cast ahead of time) with their digests, checked at load.

One file per entry (``onnx-specialized/<key>.fgspec``): a JSON header (the nodes kept, as
indices into the model's nodes; inputs; outputs; the order of the constants; every
value's type, protos serialized; the folded nodes) and the folded constants' bytes. The
model's own initializers are not stored (they are in the model's bytes); nor is a folded
value that is the memory of one of them (an Identity of a weight, a reshaped view): it is
rebuilt as a view of it. A damaged, truncated or foreign file is a miss (logged), never a
wrong graph.
"""

from __future__ import annotations

import base64
import bisect
import functools
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from fusegraph import __version__
from fusegraph.onnx.ir import OnnxGraph, TypeInfo
from fusegraph.runtime import cache_limit
from fusegraph.runtime.cache_dir import (
    atomic_write_bytes,
    cache_enabled,
    cache_root,
    ensure_dir,
    warn_unavailable,
)

log = logging.getLogger("fusegraph.onnx")

SUBDIR = "onnx-specialized"  # under the cache directory (fusegraph.commands.cache.PARTS)
SUFFIX = ".fgspec"
MAGIC = b"FGSPEC\x01\n"  # bump the digit when the layout changes
FORMAT = 1
ALIGN = 64  # every stored array starts at a multiple of this in the file

# Initializers up to this many bytes (or elements: shape inference sees their values) are
# hashed into the key; bigger ones by name, dtype and shape only (see ``deps``).
INLINE_BYTES = 1 << 16
INLINE_ELEMENTS = 4096

# A folded value at least this big that lies in an initializer's memory is stored as a view
# of it (offset, shape, strides) rather than its bytes.
VIEW_MIN_BYTES = 4096

# Folds reading only a value's shape, not its data.
_SHAPE_ONLY = frozenset({"Shape", "Size"})

# The modules whose code decides what ``specialize`` returns (their digest is in the key).
_CODE = ("specialize.py", "specialized_cache.py", "ir.py", "load.py")


class Entry:
    """One model and input shapes' place in the store: ``load`` it, or ``store`` a result."""

    def __init__(self, key: str, root: Path, big: frozenset[str]) -> None:
        self.key = key
        self.root = root  # the cache directory
        self.path = root / SUBDIR / f"{key}{SUFFIX}"
        self.big = big  # initializers not hashed into the key

    # ---- loading ---------------------------------------------------------------------------
    def load(self, model: onnx.ModelProto, constants: Mapping[str, np.ndarray]) -> OnnxGraph | None:
        """The stored graph, or None (a miss: absent, damaged, foreign, or a big initializer
        folding read has other values now). ``constants``: the model's initializers."""
        try:
            with open(self.path, "rb") as f:
                blob = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(blob) != len(blob):
                    raise ValueError("file shorter than its size")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.info("specialized graph %s unreadable (%s): specializing again", self.path, exc)
            return None
        try:
            og = self._decode(blob, model, constants)
        except Exception as exc:  # a damaged or foreign file: a miss, never a wrong graph
            log.info("specialized graph %s not used (%s): specializing again", self.path, _line(exc))
            return None
        if og is not None:
            cache_limit.touch(self.path)
            log.debug("specialized graph loaded from %s", self.path)
        return og

    def _decode(self, blob: bytearray, model: onnx.ModelProto, constants: Mapping[str, np.ndarray]) -> OnnxGraph | None:
        from fusegraph.onnx.specialize import _node_names, _parse_node

        if blob[: len(MAGIC)] != MAGIC:
            raise ValueError("not a specialized-graph file")
        n = int.from_bytes(blob[len(MAGIC) : len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        head = json.loads(bytes(blob[start : start + n]))
        if head.get("key") != self.key or head.get("format") != FORMAT:
            raise ValueError("another key or format")
        base = _aligned(start + n)
        for name, digest in head["deps"].items():
            if _digest(constants[name]) != digest:
                log.info("specialized graph %s: initializer '%s' changed; specializing again", self.path, name)
                return None
        g = model.graph
        names = _node_names(g)
        kept, folded = head["nodes"], head["folded"]
        if not _indices(kept, len(names), increasing=True) or not _indices(folded, len(names)):
            raise ValueError("node indices out of range or order")
        nodes = [_parse_node(g.node[i], names[i]) for i in kept]
        out: dict[str, np.ndarray] = {}
        for c in head["constants"]:
            kind, name = c[0], c[1]
            if kind == "i":
                out[name] = constants[name]
            elif kind == "a":
                out[name] = constants[c[2]]
            elif kind == "s":
                out[name] = out[c[2]]
            elif kind == "v":
                src, dtype, shape, offset, strides = c[2:]
                out[name] = _view(constants[src], _dtype(dtype), shape, offset, strides)
            elif kind == "d":
                dtype_s, shape, offset = c[2:]
                dt = _dtype(dtype_s)
                count = int(np.prod(shape, dtype=np.int64))
                if base + offset + count * dt.itemsize > len(blob):
                    raise ValueError(f"constant '{name}' runs past the end of the file")
                out[name] = np.frombuffer(blob, dtype=dt, count=count, offset=base + offset).reshape(shape)
            else:
                raise ValueError(f"unknown constant kind {kind!r}")
        protos = [base64.b64decode(p) for p in head["protos"]]
        types: dict[str, TypeInfo] = {}
        for name, elem, shape, proto in head["types"]:
            tp = onnx.TypeProto.FromString(protos[proto]) if proto >= 0 else None
            types[name] = TypeInfo(int(elem), None if shape is None else tuple(int(d) for d in shape), tp)
        from fusegraph.onnx.load import default_opset

        return OnnxGraph(
            nodes=nodes,
            inputs=list(head["inputs"]),
            outputs=list(head["outputs"]),
            constants=out,
            types=types,
            opset=default_opset(model),
            opset_imports=list(model.opset_import),
            ir_version=int(model.ir_version),
            functions=list(model.functions),
            folded=[names[i] for i in folded],
            all_node_names=names,
        )

    # ---- storing ---------------------------------------------------------------------------
    def store(self, og: OnnxGraph, model: onnx.ModelProto, initializers: Mapping[str, np.ndarray]) -> None:
        """Keeps ``og`` (just computed by ``specialize``) for later calls; a cache that cannot
        be written only costs the next call the work again."""
        try:
            data = self._encode(og, model, initializers)
        except _Unstorable as exc:
            log.debug("specialized graph not stored: %s", exc)
            return
        except Exception as exc:  # a cache never fails the session: the next call computes it again
            log.info("specialized graph not stored (%s: %s)", type(exc).__name__, _line(exc))
            return
        if not ensure_dir(self.path.parent, self.root):
            return
        try:
            atomic_write_bytes(self.path, data)
        except OSError as exc:
            warn_unavailable(self.root, exc)
            return
        cache_limit.enforce(self.root, keep=[self.path])

    def _encode(self, og: OnnxGraph, model: onnx.ModelProto, initializers: Mapping[str, np.ndarray]) -> bytes:
        g = model.graph
        names = og.all_node_names
        index = {n: i for i, n in enumerate(names)}
        if len(names) != len(g.node):
            raise _Unstorable("node names do not match the model's nodes")
        kept = []
        for node in og.nodes:
            i = index.get(node.name)
            if i is None or node.proto is not g.node[i] or node.sources != (node.name,):
                raise _Unstorable(f"node {node.name} is not one of the model's own")
            kept.append(i)
        parts: list[bytes] = []
        offset = 0
        entries: list[list[Any]] = []
        seen: dict[int, str] = {}  # id of a stored folded array -> its first name
        views = _Views(initializers)
        for name, arr in og.constants.items():
            if name in initializers and arr is initializers[name]:
                entries.append(["i", name])
                continue
            if id(arr) in seen:
                entries.append(["s", name, seen[id(arr)]])
                continue
            seen[id(arr)] = name
            same = views.alias(arr)
            if same is not None:
                entries.append(["a", name, same])
                continue
            view = views.find(arr)
            if view is not None:
                entries.append(["v", name, *view])
                continue
            if arr.dtype.hasobject:
                raise _Unstorable(f"constant '{name}' holds Python objects")
            raw = np.ascontiguousarray(arr).tobytes()
            entries.append(["d", name, _dtype_name(arr.dtype), list(arr.shape), offset])
            pad = _aligned(len(raw)) - len(raw)
            parts += [raw, b"\0" * pad]
            offset += len(raw) + pad
        protos: dict[bytes, int] = {}
        types: list[list[Any]] = []
        for name, t in og.types.items():
            p = -1
            if t.proto is not None:
                p = protos.setdefault(t.proto.SerializeToString(), len(protos))
            types.append([name, t.elem, None if t.shape is None else list(t.shape), p])
        head = {
            "key": self.key,
            "format": FORMAT,
            "deps": {n: _digest(initializers[n]) for n in sorted(self._deps(og, g, index))},
            "nodes": kept,
            "inputs": og.inputs,
            "outputs": og.outputs,
            "constants": entries,
            "types": types,
            "protos": [base64.b64encode(p).decode() for p in protos],
            "folded": [index[n] for n in og.folded],
        }
        text = json.dumps(head, separators=(",", ":")).encode()
        start = len(MAGIC) + 8
        lead = MAGIC + len(text).to_bytes(8, "little") + text
        return lead + b"\0" * (_aligned(start + len(text)) - len(lead)) + b"".join(parts)

    def _deps(self, og: OnnxGraph, g: onnx.GraphProto, index: Mapping[str, int]) -> set[str]:
        """The big initializers whose values some fold read (their shapes are in the key)."""
        deps: set[str] = set()
        for name in og.folded:
            p = g.node[index[name]]
            if p.op_type not in _SHAPE_ONLY:
                deps.update(i for i in p.input if i in self.big)
        return deps


class _Unstorable(Exception):
    """The graph cannot be kept faithfully (it is then computed every time)."""


class _Views:
    """Finds where a folded array is the memory of an initializer: the initializer itself (an
    Identity of a weight, or two equal weights an exporter merged) or a view of it (a Reshape
    or Slice that NumPy made a view); it is then kept as that, not as bytes."""

    def __init__(self, initializers: Mapping[str, np.ndarray]) -> None:
        self.same = {id(a): name for name, a in initializers.items()}
        spans = []
        for name, a in initializers.items():
            if a.nbytes >= VIEW_MIN_BYTES and a.flags.c_contiguous and not a.dtype.hasobject:
                spans.append((_address(a), name, a))
        spans.sort(key=lambda t: t[0])
        self.starts = [t[0] for t in spans]
        self.spans = spans

    def alias(self, arr: np.ndarray) -> str | None:
        """The initializer ``arr`` is (the same object)."""
        return self.same.get(id(arr))

    def find(self, arr: np.ndarray) -> list[Any] | None:
        """[initializer, dtype, shape, byte offset, strides] rebuilding ``arr`` over the same memory."""
        if arr.nbytes < VIEW_MIN_BYTES or arr.dtype.hasobject:
            return None
        lo, hi = _bounds(arr)
        k = bisect.bisect_right(self.starts, lo) - 1
        if k < 0:
            return None
        s_lo, name, src = self.spans[k]
        if hi > s_lo + src.nbytes:
            return None
        offset = _address(arr) - s_lo
        shape, strides = [int(d) for d in arr.shape], [int(d) for d in arr.strides]
        try:
            again = _view(src, arr.dtype, shape, offset, strides)
        except (TypeError, ValueError):
            return None
        if _address(again) != _address(arr) or again.strides != arr.strides:
            return None
        return [name, _dtype_name(arr.dtype), shape, offset, strides]


def _view(src: np.ndarray, dtype: np.dtype[Any], shape: Sequence[int], offset: int, strides: Sequence[int]) -> np.ndarray:
    """An array over ``src``'s memory (C-contiguous) from ``offset`` bytes on."""
    return np.ndarray(tuple(shape), dtype=dtype, buffer=_raw(src), offset=int(offset), strides=tuple(strides))


def _raw(a: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 array (a view where it is C-contiguous): every dtype
    exports its memory this way, ml_dtypes' included."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _bounds(a: np.ndarray) -> tuple[int, int]:
    lo = hi = _address(a)
    for n, s in zip(a.shape, a.strides, strict=True):
        if n == 0:
            return lo, lo
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


def _indices(values: Any, n: int, *, increasing: bool = False) -> bool:
    """A list of ints in [0, n) (strictly increasing where asked: nodes keep the model's order)."""
    if not isinstance(values, list) or not all(type(v) is int and 0 <= v < n for v in values):
        return False
    return not increasing or all(a < b for a, b in itertools.pairwise(values))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(dt: np.dtype[Any]) -> str:
    """NumPy's own dtypes by their exact string (byte order included); ml_dtypes' by name."""
    if dt.kind == "V":
        import ml_dtypes

        if getattr(ml_dtypes, dt.name, None) is None or dt.fields is not None:
            raise _Unstorable(f"dtype {dt} has no name to store")
        return "ml_dtypes." + dt.name
    return dt.str


def _dtype(name: str) -> np.dtype[Any]:
    if name.startswith("ml_dtypes."):
        import ml_dtypes

        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name.removeprefix("ml_dtypes.")))
        return dt
    dt = np.dtype(name)
    if dt.hasobject:
        raise ValueError(f"dtype {name} holds Python objects")
    return dt


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(_raw(a))).hexdigest()  # type: ignore[arg-type]


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


# ---- the key ------------------------------------------------------------------------------------
@functools.cache
def _code_digest() -> str:
    """A digest of the modules whose code decides the result: a change to them within one
    fusegraph version (a development checkout) is a new key, not a stale graph."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _CODE:
        try:
            h.update((here / name).read_bytes())
        except OSError:  # no source at hand (a frozen install): the versions decide alone
            h.update(name.encode())
    return h.hexdigest()


def _context() -> str:
    import ml_dtypes

    from fusegraph.onnx import load, specialize

    knobs = (specialize.FOLD_LIMIT, specialize.FOLD_MAX_ELEMENTS, specialize._SMALL_CONST,
             specialize._MAX_FOLD_ROUNDS, load.MAX_ELEMENTS)
    return (f"fgspec {FORMAT}|fusegraph {__version__}|onnx {onnx.__version__}|numpy {np.__version__}|"
            f"ml_dtypes {ml_dtypes.__version__}|code {_code_digest()}|knobs {knobs}")


def entry_for(
    model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]], constants: Mapping[str, np.ndarray],
    cache_dir: str | os.PathLike[str] | None = None,
) -> Entry | None:
    """The store's entry for this model (``constants``: its initializers, read) and these
    input shapes; None where caching is off (``FUSEGRAPH_CACHE=0``)."""
    if not cache_enabled():
        return None
    h = hashlib.sha256()

    def put(b: bytes | memoryview) -> None:  # length-prefixed: no two sequences run together
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    put(_context().encode())
    try:
        shapes = sorted((str(k), tuple(int(d) for d in v)) for k, v in input_shapes.items())
    except (TypeError, ValueError):  # not shapes: specialize says what is wrong
        return None
    put(repr(shapes).encode())
    put(f"ir {model.ir_version}".encode())
    for o in model.opset_import:
        put(o.SerializeToString())
    g = model.graph
    for part in (g.node, g.input, g.output, model.functions):
        put(f"{len(part)}".encode())
        for p in part:
            put(p.SerializeToString())
    big: set[str] = set()
    for name, arr in constants.items():
        put(f"{name}|{arr.dtype.str}|{arr.dtype.name}|{arr.shape}".encode())
        if arr.dtype.hasobject:
            put(repr(arr.tolist()).encode())
        elif arr.nbytes <= INLINE_BYTES or arr.size <= INLINE_ELEMENTS:
            put(memoryview(_raw(arr)))  # type: ignore[arg-type]
        else:
            big.add(name)
    root = Path(cache_dir) if cache_dir else cache_root()
    return Entry(h.hexdigest(), root, frozenset(big))

"""Self-describing compiled artifacts: compile on one machine, run on another.

Format (version 1)::

    b"FGIREE\\x00\\x01" | u32 little-endian header length | header JSON (UTF-8) | vmfb

The header carries the graph's JSON, the function's inputs/outputs (names, buffer shapes,
types), the target, the exact flags and the vmfb's sha256, so loading needs nothing but
the bytes and a Handle. A CPU machine can compile for ``"cuda"`` (PTX for sm_80) and a
GPU machine load the result without IREE's compiler installed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

from fusegraph import __version__
from fusegraph.engines.base import EngineConfig
from fusegraph.errors import UnsupportedError, ValidationError
from fusegraph.graph import layout
from fusegraph.runtime.handle import Handle, as_handle

if TYPE_CHECKING:
    from fusegraph.engines.iree.cache import CacheEntry
    from fusegraph.engines.iree.plan import IreePlan
    from fusegraph.graph.graph import Graph

MAGIC = b"FGIREE\x00\x01"
FORMAT = "fusegraph.iree.artifact"
VERSION = 1
_LEN = struct.Struct("<I")


def compile_to_artifact(graph: Graph, target: str = "cpu", **options: Any) -> bytes:
    """Compiles ``graph`` for ``target`` ("cpu", "cpu:znver4", "cuda", "cuda:sm_80",
    "hip:gfx942"...) with knob values ``options``; returns the artifact's bytes.

    A ``"cpu"`` artifact is compiled for this host's CPU and only loads on a host with the
    same CPU features; name an architecture (``"cpu:x86-64-v3"``) to ship it elsewhere.
    """
    from fusegraph.engines.iree.engine import IreeEngine
    from fusegraph.engines.iree.targets import parse_target

    graph.ensure_valid()
    engine = IreeEngine()
    entry = engine.compile_entry(graph, parse_target(target), options)
    return pack_artifact(graph, entry)


def pack_artifact(graph: Graph, entry: CacheEntry) -> bytes:
    m = entry.meta

    def io(names: list[str]) -> list[dict[str, Any]]:
        out = []
        for n in names:
            t = graph.tensor_by_name(n)
            out.append({
                "name": n,
                "dim": list(t.shape),
                "stride": list(t.strides),
                "data_type": t.dtype.value,
                "buffer_shape": list(layout.physical_shape(t.shape, t.strides)),
            })
        return out

    header = {
        "format": FORMAT,
        "version": VERSION,
        "fusegraph": __version__,
        "iree": m.get("iree_version"),
        "target": m.get("target"),
        "target_identity": m.get("target_identity"),
        "flags": m.get("flags"),
        "knobs": m.get("knobs"),
        "func_name": m.get("func_name"),
        "inputs": io(m["inputs"]),
        "outputs": io(m["outputs"]),
        "statistics": m.get("statistics"),
        "graph": graph.to_json(),
        "vmfb_sha256": hashlib.sha256(entry.vmfb).hexdigest(),
        "vmfb_size": len(entry.vmfb),
    }
    blob = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(blob)) + blob + entry.vmfb


def read_artifact(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and vmfb of an artifact; raises ValidationError on a damaged one."""
    data = bytes(data)
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise ValidationError("not a fusegraph IREE artifact (bad magic)")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(data[start : start + n])
    except ValueError as exc:
        raise ValidationError(f"artifact header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValidationError("artifact header has the wrong format tag")
    if header.get("version") != VERSION:
        raise ValidationError(f"artifact format version {header.get('version')} (this fusegraph reads {VERSION})")
    vmfb = data[start + n :]
    if len(vmfb) != header.get("vmfb_size") or hashlib.sha256(vmfb).hexdigest() != header.get("vmfb_sha256"):
        raise ValidationError("artifact is truncated or damaged (module checksum mismatch)")
    return header, vmfb


def load_artifact(data: bytes, handle: Handle | str | None = None) -> IreePlan:
    """An executable plan from artifact bytes, on ``handle`` (default: the CPU)."""
    from fusegraph.engines.iree.cache import CacheEntry
    from fusegraph.engines.iree.engine import compiler_version, iree_version
    from fusegraph.engines.iree.plan import IreePlan
    from fusegraph.engines.iree.runtime import runtime_for
    from fusegraph.engines.iree.targets import parse_target
    from fusegraph.graph.graph import Graph

    header, vmfb = read_artifact(data)
    h = as_handle(handle)
    target = parse_target(str(header["target"]))
    if target.kind != h.device.kind:
        raise UnsupportedError(f"artifact was compiled for {header['target']}; it cannot run on {h.device}")
    if target.kind == "cpu" and header.get("target_identity") != target.cache_identity():
        raise UnsupportedError(
            f"artifact was compiled for another host CPU ({header.get('target_identity')}, this is "
            f"{target.cache_identity()}); compile with an explicit architecture, e.g. 'cpu:x86-64-v3'"
        )
    built_with = str(header.get("iree"))
    if built_with.split(".")[:2] != compiler_version().split(".")[:2]:
        raise UnsupportedError(f"artifact was compiled by IREE {built_with}; this runtime is {iree_version()}")
    graph = Graph.from_json(header["graph"]).validate()
    for io in (*header["inputs"], *header["outputs"]):
        t = graph.tensor_by_name(io["name"])
        if list(t.shape) != io["dim"] or list(t.strides) != io["stride"]:
            raise ValidationError("artifact header and graph disagree", tensor=io["name"])
    meta = {
        "graph_name": graph.name,
        "target": header["target"],
        "target_identity": header.get("target_identity"),
        "flags": header.get("flags"),
        "knobs": header.get("knobs") or {},
        "func_name": header["func_name"],
        "inputs": [io["name"] for io in header["inputs"]],
        "outputs": [io["name"] for io in header["outputs"]],
        "statistics": header.get("statistics") or {},
        "iree_version": built_with,
    }
    key = "artifact-" + str(header["vmfb_sha256"])
    entry = CacheEntry(key, vmfb, meta, None, "artifact")
    runtime = runtime_for(h)
    loaded = runtime.load(key, vmfb, meta["func_name"], len(meta["outputs"]))
    knobs = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in meta["knobs"].items()))
    return IreePlan(graph, h, EngineConfig("iree", knobs), runtime=runtime, loaded=loaded, entry=entry)

"""Shape and data movement: Reshape and its kin, Transpose, Concat, Slice, Split, Gather,
DepthToSpace/SpaceToDepth, Pad, Identity/Dropout.

Target shapes come from ONNX shape inference after constant folding, so the shape inputs of
these ops must be constants (``model.specialize`` folds shape subgraphs into them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fusegraph.graph.tensor import TensorAttr
from fusegraph.onnx.ops.common import broadcast_to, ints, is_read, out_dims, reshape
from fusegraph.onnx.ops.table import Unmappable, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


@lowers("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def lower_reshape_like(imp: Importer, node: ONode) -> None:
    """Reshape, Flatten, Squeeze, Unsqueeze: a row-major reshape to the inferred dims.

    The target comes from ONNX shape inference, which already resolved 0 / -1 / axes; the
    shape input of Reshape (and axes of Squeeze/Unsqueeze) must be constant for that.
    """
    op = node.op_type
    if op == "Reshape" and not imp.is_const(node.inputs[1]):
        raise Unmappable("Reshape: the target shape is computed at run time (not a constant)")
    if op in ("Squeeze", "Unsqueeze") and len(node.inputs) > 1 and node.inputs[1] and not imp.is_const(node.inputs[1]):
        raise Unmappable(f"{op}: axes are computed at run time")
    out = out_dims(imp, node)
    if not out or 0 in out:
        raise Unmappable(f"{op}: output dims {list(out)} (rank-0 or empty)")
    x = imp.tensor(node.inputs[0], "plain")
    y = imp.g.reshape(x, list(out))
    if imp.channels_last and len(out) == 4:
        y.set_stride(imp._strides(out, "act"))  # back to NHWC after e.g. a channel shuffle
    imp.set(node.outputs[0], y)


@lowers("Transpose")
def lower_transpose(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    perm = ints(node.attr("perm", list(reversed(range(len(xs))))))
    imp.set(node.outputs[0], imp.g.transpose(imp.tensor(node.inputs[0], "plain"), perm))


@lowers("Concat")
def lower_concat(imp: Importer, node: ONode) -> None:
    names = [i for i in node.inputs if i]
    rank = len(imp.shape(names[0]))
    axis = int(node.attr("axis", 1)) % rank
    parts = [imp.tensor(n) for n in names]
    y = imp.g.concatenate(parts, axis=axis) if len(parts) > 1 else imp.g.identity(parts[0])
    imp.set(node.outputs[0], y)


@lowers("Slice")
def lower_slice(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if imp.og.opset < 10:
        starts, ends = ints(node.attr("starts")), ints(node.attr("ends"))
        axes = ints(node.attr("axes", list(range(len(starts)))))
        steps = [1] * len(starts)
    else:
        starts = ints(imp.const(node.inputs[1], "starts").reshape(-1))
        ends = ints(imp.const(node.inputs[2], "ends").reshape(-1))
        axes = (
            ints(imp.const(node.inputs[3], "axes").reshape(-1))
            if len(node.inputs) > 3 and node.inputs[3] else list(range(len(starts)))
        )
        steps = (
            ints(imp.const(node.inputs[4], "steps").reshape(-1))
            if len(node.inputs) > 4 and node.inputs[4] else [1] * len(starts)
        )
    if any(s < 1 for s in steps):
        raise Unmappable(f"Slice: steps={steps} (fusegraph slices with positive steps only)")
    big = 2**62
    ends = [min(max(e, -big), big) for e in ends]
    starts = [min(max(s, -big), big) for s in starts]
    x = imp.tensor(node.inputs[0])
    imp.set(node.outputs[0], imp.g.slice(x, starts, ends, steps, axes=[a % len(xs) for a in axes]))


@lowers("Split")
def lower_split(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", 0)) % len(xs)
    outs = [o for o in node.outputs]
    sizes: list[int] = []
    for o in outs:
        s = imp.og.shape(o) if o else None
        if s is None:
            raise Unmappable(f"Split: the shape of output '{o}' is unknown")
        sizes.append(s[axis])
    x = imp.tensor(node.inputs[0])
    start = 0
    for o, size in zip(outs, sizes, strict=True):
        imp.set(o, imp.g.slice(x, [start], [start + size], [1], axes=[axis]))
        start += size


GATHER_MAX_RUNS = 32  # constant Gather indices split into at most this many slices


@lowers("Gather")
def lower_gather(imp: Importer, node: ONode) -> None:
    """Gather. Indices computed at run time (an embedding lookup: the ids are a model input)
    become the graph's gather op. Constant indices (what shape folding left: a row or a
    few picked from an activation) become slices instead -- each increasing arithmetic run
    of them one slice, the runs concatenated along the axis, then reshaped to the output --
    which every engine runs; past GATHER_MAX_RUNS runs they are a gather of a constant."""
    xs = imp.shape(node.inputs[0])
    axis = int(node.attr("axis", 0)) % len(xs)
    out = out_dims(imp, node)
    if not out:
        raise Unmappable("Gather: rank-0 output")
    if not imp.is_const(node.inputs[1]):
        ids = imp.tensor(node.inputs[1], "plain")
        imp.set(node.outputs[0], imp.g.gather(imp.tensor(node.inputs[0]), ids, axis=axis))
        return
    idx = imp.const(node.inputs[1], "indices").astype(np.int64)
    flat = np.where(idx < 0, idx + xs[axis], idx).reshape(-1)
    if flat.size == 0:
        raise Unmappable("Gather: empty indices")
    if flat.min() < 0 or flat.max() >= xs[axis]:
        raise Unmappable(f"Gather: indices out of range for axis {axis} of dims {list(xs)}")
    runs = arithmetic_runs(flat)
    x = imp.tensor(node.inputs[0])
    if len(runs) > GATHER_MAX_RUNS:
        ids = imp.constant(flat.reshape(idx.shape) if idx.ndim else flat, node.inputs[1], "plain")
        imp.set(node.outputs[0], reshape(imp, imp.g.gather(x, ids, axis=axis), out))
        return
    parts = [imp.g.slice(x, [first], [last + 1], [step], axes=[axis]) for first, last, step in runs]
    y = parts[0] if len(parts) == 1 else imp.g.concatenate(parts, axis=axis)
    imp.set(node.outputs[0], reshape(imp, y, out))


def arithmetic_runs(flat: np.ndarray) -> list[tuple[int, int, int]]:
    """(first, last, step > 0) of consecutive increasing arithmetic runs covering ``flat``."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, flat.size
    while i < n:
        first = int(flat[i])
        if i + 1 < n and flat[i + 1] > flat[i]:
            step = int(flat[i + 1] - flat[i])
            j = i + 1
            while j + 1 < n and int(flat[j + 1] - flat[j]) == step:
                j += 1
            runs.append((first, int(flat[j]), step))
            i = j + 1
        else:
            runs.append((first, first, 1))
            i += 1
    return runs


@lowers("Expand")
def lower_expand(imp: Importer, node: ONode) -> None:
    """A broadcast (``common.broadcast_to``), the output dims from shape inference. Not
    select(mask, x, x) with a broadcast mask: IREE's torch-mlir path does not compile it
    ("'tensor.cast' op operand type ... are cast incompatible")."""
    if not imp.is_const(node.inputs[1]):
        raise Unmappable("Expand: the target shape is computed at run time (not a constant)")
    out = out_dims(imp, node)
    if not out or 0 in out:
        raise Unmappable(f"Expand: output dims {list(out)} (rank-0 or empty)")
    x = imp.tensor(node.inputs[0])
    y = broadcast_to(imp, x, out)
    imp.set(node.outputs[0], y if y is not x else imp.g.identity(x))


@lowers("GatherElements", "GatherND", "ScatterElements", "ScatterND", "Range", "NonZero")
def lower_data_dependent(imp: Importer, node: ONode) -> None:
    """Ops whose result is shaped or indexed by values: with constant inputs they were folded
    before partitioning, so what is left depends on run-time data, which no graph op expresses."""
    raise Unmappable(
        f"{node.op_type}: depends on values computed at run time (no fusegraph graph op for it; "
        "with constant inputs it would have been folded)"
    )


@lowers("DepthToSpace", "SpaceToDepth")
def lower_depth_space(imp: Importer, node: ONode) -> None:
    xs = imp.shape(node.inputs[0])
    if len(xs) != 4:
        raise Unmappable(f"{node.op_type}: input rank {len(xs)} != 4")
    b = int(node.attr("blocksize"))
    n, c, h, w = xs
    x = imp.tensor(node.inputs[0], "plain")
    if node.op_type == "DepthToSpace":
        mode = node.attr("mode", b"DCR")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode == "DCR":
            t = imp.g.reshape(x, [n, b, b, c // (b * b), h, w])
            t = imp.g.transpose(t, [0, 3, 4, 1, 5, 2])
        else:
            t = imp.g.reshape(x, [n, c // (b * b), b, b, h, w])
            t = imp.g.transpose(t, [0, 1, 4, 2, 5, 3])
        y = imp.g.reshape(t, [n, c // (b * b), h * b, w * b])
    else:
        t = imp.g.reshape(x, [n, c, h // b, b, w // b, b])
        t = imp.g.transpose(t, [0, 3, 5, 1, 2, 4])
        y = imp.g.reshape(t, [n, c * b * b, h // b, w // b])
    imp.set(node.outputs[0], y)


@lowers("Pad")
def lower_pad(imp: Importer, node: ONode) -> None:
    """Constant-mode Pad as a concatenation with constant slabs (negative pads crop)."""
    mode = node.attr("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode != "constant":
        raise Unmappable(f"Pad: mode={mode!r} (only 'constant' is lowered)")
    xs = imp.shape(node.inputs[0])
    rank = len(xs)
    if imp.og.opset < 11:
        pads = ints(node.attr("pads"))
        value = float(node.attr("value", 0.0))
        axes = list(range(rank))
    else:
        pads = ints(imp.const(node.inputs[1], "pads").reshape(-1))
        value = 0.0
        if len(node.inputs) > 2 and node.inputs[2]:
            value = imp.const(node.inputs[2], "constant_value").reshape(-1)[0].item()
        axes = (
            [a % rank for a in ints(imp.const(node.inputs[3], "axes").reshape(-1))]
            if len(node.inputs) > 3 and node.inputs[3] else list(range(rank))
        )
    n = len(axes)
    if len(pads) != 2 * n:
        raise Unmappable(f"Pad: {len(pads)} pads for {n} axes")
    y = imp.tensor(node.inputs[0])
    crop = [(a, max(-pads[i], 0), max(-pads[n + i], 0)) for i, a in enumerate(axes)]
    if any(b or e for _, b, e in crop):
        dims = list(y.dim)
        y = imp.g.slice(y, [b for _, b, _ in crop], [dims[a] - e for a, _, e in crop], axes=[a for a, _, _ in crop])
    for i, a in enumerate(axes):
        before, after = max(pads[i], 0), max(pads[n + i], 0)
        if not before and not after:
            continue
        parts: list[TensorAttr | None] = []
        dims = list(y.dim)
        for size in (before, after):
            if size:
                slab = [*dims[:a], size, *dims[a + 1:]]
                parts.append(imp.constant(np.full(slab, value, dtype=y.dtype.numpy), f"pad_{a}"))
            else:
                parts.append(None)
        seq = [p for p in (parts[0], y, parts[1]) if p is not None]
        y = imp.g.concatenate(seq, axis=a)
    if y is imp.values.get(node.inputs[0]):
        y = imp.g.identity(y)
    imp.set(node.outputs[0], y)


@lowers("Identity", "Dropout")
def lower_identity(imp: Importer, node: ONode) -> None:
    """Identity, and Dropout at inference: the value passes through unchanged."""
    if node.op_type == "Dropout":
        if len(node.inputs) > 2 and node.inputs[2]:
            mode = imp.const(node.inputs[2], "training_mode")
            if bool(mode.reshape(-1)[0]):
                raise Unmappable("Dropout: training_mode=True")
        if len(node.outputs) > 1 and node.outputs[1] and is_read(imp, node.outputs[1]):
            raise Unmappable("Dropout: the mask output is used")
    imp.set(node.outputs[0], imp.tensor(node.inputs[0]))

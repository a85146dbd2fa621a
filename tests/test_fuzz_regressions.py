"""Named regression tests for what the graph fuzzer (tests/test_fuzz_graphs.py) found.

Each is the fuzzer's shrunk example, compared with the float64 reference. Bugs in files
outside the reliability area are strict xfails naming the bug; when one is fixed the xfail
turns into a failure, and the mark comes off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reference_checks import agrees_with_reference

import fusegraph as fg
from fusegraph.dtypes import DataType
from fusegraph.reference.inputs import random_inputs
from fusegraph.select.autotune import compare, tolerance

pytestmark = pytest.mark.usefixtures("own_cache")



# Was a strict xfail (ExecutionError "hal.buffer_view.create OUT_OF_RANGE; buffer view byte length
# 24 exceeds backing buffer byte length 12"): IREE 3.13 demotes every f64 value to f32 by default,
# the function's arguments and results included, so an f64 result was exported over f32-sized
# storage. Fixed in engines/iree/engine.py (_keep_f64_boundary: --iree-input-demote-f64-to-f32=false
# for a graph with an f64 tensor); f64 now computes in f64 (lower_base.compute_type), so the
# result meets f64's tolerance (1e-9).
def test_fuzz_iree_f64_output_of_a_computed_op(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_f64_abs")
    x = g.tensor("x", [3], data_type=DataType.DOUBLE)
    g.abs(x).set_data_type(DataType.DOUBLE).set_output(True)
    agrees_with_reference(g, "iree", rng)


@pytest.mark.parametrize("compute", [None, DataType.DOUBLE], ids=["undeclared", "f64"])
def test_fuzz_iree_f64_graph_agrees_at_f64_tolerance(compute: DataType | None, rng: np.random.Generator) -> None:
    """f64 in, f64 out, through a matmul, a reduction, a softmax and exp/log/pow: 1e-9."""
    g = fg.Graph(name="fuzz_f64", io_data_type=DataType.DOUBLE, compute_data_type=compute)
    a, b = g.tensor("a", [2, 3, 4]), g.tensor("b", [2, 4, 5])
    m = g.matmul(a, b)
    g.softmax(m, axis=-1).set_name("s").set_output(True)
    p = g.pow(g.add(g.abs(m), g.scalar(0.5)), g.exp(g.tensor("e", [1, 1, 5])))
    g.reduction(g.log(p), fg.ReductionMode.SUM, axes=[1]).set_name("r").set_output(True)
    agrees_with_reference(g, "iree", rng)


def aligned_read_only(values: np.ndarray, alignment: int = 4096) -> np.ndarray:
    """A read-only C-contiguous copy of ``values`` whose data pointer is ``alignment``-aligned."""
    raw = np.empty(values.nbytes + alignment, np.uint8)
    off = (-raw.ctypes.data) % alignment
    arr = raw[off : off + values.nbytes].view(values.dtype).reshape(values.shape)
    arr[...] = values
    arr.flags.writeable = False
    return arr


# Was a strict xfail (raw ValueError "buffer source array is read-only"); fixed in
# engines/iree/plan.py _host_input: read-only arrays are copied, never aliased (issue 16, G).
def test_fuzz_iree_read_only_aligned_input(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_read_only", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 4], [0, 0])  # the fuzzer's case: one element broadcast everywhere
    g.neg(x).set_name("y").set_output(True)
    g.validate()
    one = aligned_read_only(rng.standard_normal(1).astype(np.float32))
    x_arr = np.broadcast_to(one.reshape(1, 1), (3, 4))
    got = g.execute({"x": x_arr}, engine="iree")["y"]
    np.testing.assert_array_equal(got, -x_arr)


def test_fuzz_torch_input_broadcast_on_every_axis(rng: np.random.Generator) -> None:
    """The same graph on the torch engine (it passes; kept beside the IREE xfail)."""
    g = fg.Graph(name="fuzz_all_broadcast", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 4], [0, 0])
    g.neg(x).set_name("y").set_output(True)
    agrees_with_reference(g, "torch", rng)


# Was a strict xfail (CompileError: "'tensor.cast' op operand type 'tensor<5x2x3x4xf32>' and result
# type 'tensor<1x2x1x4xf32>' are cast incompatible", or a failed translation): torch's
# activation-backward ops do not broadcast and torch-mlir lowers them assuming they do not need
# to. Fixed in engines/iree/lower_pointwise.py (_full): dy and x are expanded to the result's shape.
@pytest.mark.parametrize("mode", ["gelu_backward", "tanh_backward", "sigmoid_backward"])
def test_fuzz_iree_backward_op_with_broadcast_dy_into_reduction(mode: str, rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_bwd_bcast", io_data_type=DataType.FLOAT)
    dy, x = g.tensor("dy", [1, 2, 1, 4]), g.tensor("x", [5, 2, 3, 4])
    g.reduction(getattr(g, mode)(dy, x), fg.ReductionMode.SUM, axes=[1, 2, 3]).set_name("y").set_output(True)
    agrees_with_reference(g, "iree", rng)


@pytest.mark.parametrize("reader", ["sum", "avg", "layernorm", "sum_of_stride0_view"])
def test_fuzz_iree_product_with_broadcast_operand_into_a_sum(reader: str, rng: np.random.Generator) -> None:
    """The cause of the backward-op failures: any product with an operand broadcast along a
    summed axis (mul(dy[1,2,1,4], x[5,2,3,4]) summed over axes 1-3) made IREE 3.13 fuse a
    contraction-like op its CPU code generation rejects ("'vector.contract' op invalid
    accumulator/result vector shape"). Fixed by fencing the product (Lowering.broadcast_product)."""
    g = fg.Graph(name=f"fuzz_bcast_product_{reader}", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [5, 2, 3, 4])
    dy = g.tensor("dy", [5, 2, 3, 4], [0, 4, 0, 1]) if reader == "sum_of_stride0_view" else g.tensor("dy", [1, 2, 1, 4])
    p = g.mul(dy, x)
    if reader == "layernorm":
        y, _, _ = g.layernorm(p, g.tensor("scale", [1, 2, 3, 4]), g.tensor("bias", [1, 2, 3, 4]))
    else:
        mode = fg.ReductionMode.AVG if reader == "avg" else fg.ReductionMode.SUM
        y = g.reduction(p, mode, axes=[1, 2, 3])
    y.set_name("y").set_output(True)
    agrees_with_reference(g, "iree", rng)


@pytest.mark.parametrize("engine", ["torch", "reference"])
def test_fuzz_backward_op_with_broadcast_dy_into_reduction_other_engines(engine: str, rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_bwd_bcast", io_data_type=DataType.FLOAT)
    dy, x = g.tensor("dy", [1, 2, 1, 4]), g.tensor("x", [5, 2, 3, 4])
    g.reduction(g.gelu_backward(dy, x), fg.ReductionMode.SUM, axes=[1, 2, 3]).set_name("y").set_output(True)
    agrees_with_reference(g, engine, rng)


BF16_MATMUL = """
import numpy as np, fusegraph as fg
g = fg.Graph(io_data_type=fg.DataType.BFLOAT16, intermediate_data_type=fg.DataType.FLOAT,
             compute_data_type=fg.DataType.FLOAT)
g.matmul(g.tensor("a", [8, 8]), g.tensor("b", [8, 8])).set_name("c").set_output(True)
g.validate()
rng = np.random.default_rng()
a, b = (rng.standard_normal((8, 8)).astype(fg.DataType.BFLOAT16.numpy) for _ in range(2))
c = g.execute({"a": a, "b": b}, engine="iree")["c"].astype(np.float64)
ref = a.astype(np.float64) @ b.astype(np.float64)
err = np.linalg.norm(c - ref) / np.linalg.norm(ref)
assert err < 2e-2, err
print("ok", err)
"""


def test_fuzz_iree_bf16_matmul_does_not_abort_the_process(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "FUSEGRAPH_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", BF16_MATMUL], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}): {proc.stderr.strip()[-400:]}"
    assert proc.stdout.startswith("ok")


def test_iree_bf16_matmul_pinned_to_data_tiling_is_refused_before_compiling() -> None:
    """The combination that aborts LLVM is refused by name instead of reaching the compiler."""
    g = fg.Graph(io_data_type=DataType.BFLOAT16, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    g.matmul(g.tensor("a", [8, 8]), g.tensor("b", [8, 8])).set_name("c").set_output(True)
    g.validate()
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.iree import IreeEngine

    with pytest.raises(fg.UnsupportedError, match="data_tiling"):
        IreeEngine().build(g, fg.Handle("cpu"), EngineConfig("iree", (("data_tiling", True),)))


WINDOW_CASES = [
    # (op, x dims, window/filter, stride, padding)
    ("pool_max", [1, 2, 3, 4], [2, 3], [1, 2], [0, 0]),
    ("pool_avg_exclude_pad", [1, 3, 1, 3], [2, 3], [2, 2], [1, 1]),
    ("conv", [1, 3, 4, 4], [3, 3], [2, 2], [0, 0]),
    ("conv", [1, 3, 4, 5], [3, 3], [2, 2], [0, 0]),
]


def _window_graph(op: str, xd: list[int], win: list[int], stride: list[int], pad: list[int]) -> fg.Graph:
    g = fg.Graph(name="fuzz_unit_output", io_data_type=DataType.FLOAT)
    x = g.tensor("x", xd)
    if op == "conv":
        w = g.tensor("w", [4, xd[1], *win])
        y = g.conv_fprop(x, w, padding=pad, stride=stride)
    else:
        y = g.pooling(x, fg.PoolingMode(op.removeprefix("pool_")), window=win, stride=stride, padding=pad)
    y.set_name("y").set_output(True)
    return g


# Was a strict xfail (CompileError "'linalg.generic' op inferred input/output operand #1 has
# shape's dimension #0 to be 4, but found 3"): IREE 3.13 folds a unit output axis away and then
# indexes the input by the window position alone. Fixed in engines/iree/lower_conv.py
# (trim_unit_windows, used by lower_pool.py too): the trailing input such a window never reads
# is sliced off.
@pytest.mark.parametrize(("op", "xd", "win", "stride", "pad"), WINDOW_CASES,
                         ids=["pool_max", "pool_avg_exclude_pad", "conv_4x4", "conv_4x5"])
def test_fuzz_iree_window_op_with_unit_output_and_leftover_input(
    op: str, xd: list[int], win: list[int], stride: list[int], pad: list[int], rng: np.random.Generator
) -> None:
    agrees_with_reference(_window_graph(op, xd, win, stride, pad), "iree", rng)


@pytest.mark.parametrize("case", ["grouped", "nchw_option", "conv_1d_nchw_option"])
def test_fuzz_iree_conv_with_unit_output_through_torch_convolution(case: str, rng: np.random.Generator) -> None:
    """The same fold on the emitter's other convolution path (torch.aten.convolution: grouped
    convolutions, and every convolution under conv_layout='nchw')."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.iree import IreeEngine

    g = fg.Graph(name="fuzz_unit_output_torch", io_data_type=DataType.FLOAT)
    if case == "grouped":
        y = g.conv_fprop(g.tensor("x", [1, 4, 4, 4]), g.tensor("w", [4, 2, 3, 3]), padding=[0, 0], stride=[2, 2])
    elif case == "nchw_option":
        y = g.conv_fprop(g.tensor("x", [1, 3, 4, 5]), g.tensor("w", [4, 3, 3, 3]), padding=[0, 0], stride=[2, 2])
    else:
        y = g.conv_fprop(g.tensor("x", [2, 3, 6]), g.tensor("w", [4, 3, 3]), padding=[0], stride=[4])
    y.set_name("y").set_output(True)
    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    config = EngineConfig("iree", () if case == "grouped" else (("conv_layout", "nchw"),))
    got = IreeEngine().build(g, fg.Handle("cpu"), config).execute(dict(inputs))
    err, why = compare(g, got, ref)
    assert err <= tolerance(g), f"rel err {err:.3g} > {tolerance(g):g} {why}"


@pytest.mark.parametrize("engine", ["torch", "reference"])
@pytest.mark.parametrize(("op", "xd", "win", "stride", "pad"), WINDOW_CASES,
                         ids=["pool_max", "pool_avg_exclude_pad", "conv_4x4", "conv_4x5"])
def test_fuzz_window_op_with_unit_output_other_engines(
    engine: str, op: str, xd: list[int], win: list[int], stride: list[int], pad: list[int], rng: np.random.Generator
) -> None:
    agrees_with_reference(_window_graph(op, xd, win, stride, pad), engine, rng)


# Was a strict xfail ("'func.func' op failed on workgroup distribution verification"): the
# same IREE 3.13 bug as test_fuzz_iree_output_read_by_a_reduction_root below; fixed there.
def test_fuzz_iree_wgrad_of_a_computed_output(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_wgrad_out", io_data_type=DataType.FLOAT)
    x = g.sin(g.tensor("x", [5, 1, 3, 2], [3, 3, 1, 15])).set_name("sx").set_output(True)
    dy = g.tensor("dy", [5, 1, 1, 2], [1, 5, 10, 5])
    g.conv_wgrad(x, dy, padding=[0, 0]).set_dim([1, 1, 3, 1]).set_name("dw").set_output(True)
    agrees_with_reference(g, "iree", rng)


def test_fuzz_wgrad_of_a_computed_output_on_torch(rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_wgrad_out", io_data_type=DataType.FLOAT)
    x = g.sin(g.tensor("x", [5, 1, 3, 2], [3, 3, 1, 15])).set_name("sx").set_output(True)
    dy = g.tensor("dy", [5, 1, 1, 2], [1, 5, 10, 5])
    g.conv_wgrad(x, dy, padding=[0, 0]).set_dim([1, 1, 3, 1]).set_name("dw").set_output(True)
    agrees_with_reference(g, "torch", rng)


def _matmul_of_reshaped_matmul(case: str, io: DataType) -> fg.Graph:
    g = fg.Graph(name=f"fuzz_mm_mm_{case}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    if case == "broadcast_batch":  # the fuzzer's graph: IREE computes [2,3,3]@[1,3,3] as [6,3]@[3,3]
        m = g.matmul(g.tensor("a", [2, 3, 3]), g.tensor("b", [1, 3, 3]))
    else:  # a reshape op splitting M of a 2-D product
        m = g.reshape(g.matmul(g.tensor("a", [6, 3]), g.tensor("b", [3, 3])), [2, 3, 3])
        if case == "reshape_tanh":
            m = g.tanh(m)
    g.matmul(m, g.tensor("c", [2, 3, 4])).set_name("y").set_output(True)
    return g


# Was silently wrong (rel err 0.39-1.2: the second batch's rows shifted by one, the last zero):
# IREE 3.13's data tiling fuses unpack -> expand_shape (splitting M) -> the next matmul's pack
# into one dispatch and writes the packed tiles at the wrong offsets. Fixed in
# engines/iree/lower_matmul.py: a batched matmul's A operand computed from a contraction is
# fenced (compute_barrier), so the pack runs in its own dispatch. Found by the fuzzer (seed
# 65349: matmul [3,3,3]@[1,3,3] -> matmul @[3,3,4] -> tanh -> exp).
@pytest.mark.parametrize("io", [DataType.FLOAT, DataType.HALF], ids=["f32", "f16"])
@pytest.mark.parametrize("case", ["broadcast_batch", "reshape", "reshape_tanh"])
def test_fuzz_iree_matmul_of_a_reshaped_matmul_result(case: str, io: DataType, rng: np.random.Generator) -> None:
    agrees_with_reference(_matmul_of_reshaped_matmul(case, io), "iree", rng)


def _product_graph(squash: str) -> fg.Graph:
    """The fuzzer's reduce_mul of seed 154: the product of all 81 values of a [3,3,3,3] input."""
    g = fg.Graph(name=f"fuzz_prod_{squash}", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 3, 3, 3], [27, 1, 9, 3])
    v = g.tanh(x)
    if squash == "exp":  # the fuzzer's domain now: exp(2 tanh(x) / n), the product within [e^-2, e^2]
        v = g.exp(g.mul(v, g.scalar(2.0 / 81)))
    g.reduction(v, fg.ReductionMode.MUL, axes=[0, 1, 2, 3]).set_name("y").set_output(True)
    return g


@pytest.mark.parametrize("engine", ["iree", "torch"])
def test_fuzz_product_of_many_values_agrees(engine: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_product_graph("exp"), engine, rng)


def test_fuzz_iree_flushes_subnormal_results_to_zero() -> None:
    """Why the fuzzer's reduce_mul reads exp(2x/n) (seed 154 was 'rel err 1'): the product of
    81 tanh values is ~1e-42, an f32 subnormal (no float type keeps 1e-4 relative precision
    there), and IREE's CPU runtime runs dispatches with denormals flushed to zero, so it
    returns 0 where torch returns the subnormal. Not a lowering bug; this pins the behaviour
    so that a change in IREE shows up here."""
    g = _product_graph("tanh")
    g.validate()
    x = np.full((3, 3, 3, 3), np.arctanh(0.3), np.float32)  # every factor 0.3: the product is 4.4e-43
    ref = g.execute({"x": x}, engine="reference")["y"]
    assert 0 < abs(float(ref.ravel()[0])) < np.finfo(np.float32).tiny
    got = np.asarray(g.execute({"x": x}, engine="iree")["y"])
    assert float(got.ravel()[0]) == 0.0


def _output_read_by(reader: str, io: DataType) -> fg.Graph:
    """A computed graph output that a reduction-like node also reads (the fuzzer's seed 1483:
    batchnorm training -> y read out, and read by an amax and by a softmax over a size-5 axis)."""
    g = fg.Graph(name=f"fuzz_out_read_{reader}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    if reader == "softmax_after_batchnorm":
        x = g.tensor("x", [4, 5, 1, 2], [5, 1, 40, 20])
        y, _, _ = g.batchnorm(x, g.tensor("scale", [5]), g.tensor("bias", [5]), epsilon=1e-3)
        y.set_stride([5, 1, 5, 20]).set_name("y").set_output(True)
        g.softmax(y, axis=-3).set_name("s").set_output(True)
        return g
    x = g.sin(g.tensor("x", [2, 4, 1, 5])).set_name("sx").set_output(True)
    g.softmax(x, axis=-1).set_name("s").set_output(True)
    return g


# Was a CompileError for a valid graph ("'vector.store' op write affecting operations on global
# resources are restricted to workgroup distributed contexts"): IREE 3.13 fuses the producer of a
# graph output into a reduction-like reader's dispatch and stores the output from there, outside
# the distributed loops. Fixed in engines/iree/lower_base.py (Lowering.set): a graph output that a
# node reads is fenced, so its producer's dispatch writes it. Found by the fuzzer (seed 1483:
# batchnorm -> amax, softmax).
@pytest.mark.parametrize("io", [DataType.FLOAT, DataType.HALF], ids=["f32", "f16"])
@pytest.mark.parametrize("reader", ["softmax_after_batchnorm", "softmax"])
def test_fuzz_iree_output_read_by_a_reduction_root(reader: str, io: DataType, rng: np.random.Generator) -> None:
    agrees_with_reference(_output_read_by(reader, io), "iree", rng)


def _norm_then_matvec(case: str) -> fg.Graph:
    io = DataType.FLOAT if case == "f32_io_f16_weight" else DataType.HALF
    g = fg.Graph(name=f"fuzz_norm_matvec_{case}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    m, k = (2, 2) if case == "layernorm" else (16, 4)
    x = g.tensor("x", [m, k])
    if case == "rmsnorm":
        y, _ = g.rmsnorm(x, g.tensor("scale", [1, k]))
    else:
        y, _, _ = g.layernorm(x, g.tensor("scale", [1, k]), g.tensor("bias", [1, k]))
    g.matmul(y, g.tensor("w", [k, 1], data_type=DataType.HALF)).set_name("o").set_output(True)
    return g


# Was a CompileError for a valid graph (found by a long fuzz run, not named until now): with data
# tiling, IREE 3.13 fused the norm and A's pack into a mixed-precision matvec dispatch (f32 A x
# f16 B, N = 1) and failed "to run translation of source executable". Fixed in
# engines/iree/lower_matmul.py: such a matvec's A operand computed from a norm/reduction is fenced.
@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "f32_io_f16_weight"])
def test_fuzz_iree_matvec_with_narrow_weight_after_a_norm(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_norm_then_matvec(case), "iree", rng)


def _broadcast_value_read_by_two(case: str) -> fg.Graph:
    """A value computed from a stride-0 (broadcast) input, which the IREE emitter keeps at its
    stand-in size 1 on the broadcast axis, read in full by two nodes reducing along different
    axes. The fuzzer's graph (seed 530993, f16 io): a [3,5] input broadcast along M (strides
    [0,1]) @ [5,3] -> tanh -> batchnorm training, and -> tanh -> rmsnorm inference."""
    io = DataType.HALF if case.endswith("_f16") else DataType.FLOAT
    g = fg.Graph(name=f"fuzz_bcast_two_readers_{case}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    if case.startswith("tanh"):
        v = g.tanh(g.tensor("x", [3, 4], [0, 1]))
    elif case.startswith("matmul_column"):  # B broadcast along N: the product keeps N at 1
        v = g.matmul(g.tensor("a", [3, 5]), g.tensor("b", [5, 4], [1, 0]))
    else:
        v = g.matmul(g.tensor("a", [3, 5], [0, 1]), g.tensor("b", [5, 3 if "norms" in case else 4]))
    if "norms" in case:
        t = g.tanh(v)
        _, mean, inv_var = g.batchnorm(t, g.tensor("scale", [3]), g.tensor("bias", [3]), epsilon=1e-3)
        mean.set_output(True)
        inv_var.set_output(True)
        r, _ = g.rmsnorm(g.tanh(v), g.tensor("s2", [3]), bias=g.tensor("b2", [3]), epsilon=1e-5,
                         phase=fg.NormFwdPhase.INFERENCE)
        r.set_name("r").set_output(True)
    elif "softmaxes" in case:
        g.softmax(v, axis=0).set_name("s0").set_output(True)
        g.softmax(v, axis=1).set_name("s1").set_output(True)
    else:
        g.reduction(v, fg.ReductionMode.SUM, axes=[0]).set_name("r0").set_output(True)
        g.reduction(v, fg.ReductionMode.MAX, axes=[1]).set_name("r1").set_output(True)
    return g


# Was a CompileError for a valid graph (fuzz seed 530993: "'linalg.unpack' op failed to verify
# that result type matches type of dest", tensor<1x?xf32>; the smaller graphs here failed with
# "'vector.store' (or 'iree_linalg_ext.map_store') op write affecting operations on global
# resources are restricted to workgroup distributed contexts", data tiling on or off): IREE 3.13
# fuses the expansion (broadcast_to) of such a value, and its producer, into reducing readers,
# and fails where two of them reduce along different axes. Fixed in engines/iree/lower_base.py
# (Lowering.get): a computed stand-in read in full by a reduction, softmax or norm is expanded
# once, behind a fence, in its own dispatch.
@pytest.mark.parametrize("case", [
    "matmul_norms_f16", "matmul_norms", "matmul_reductions", "matmul_softmaxes", "matmul_column_reductions",
    "tanh_softmaxes",
])
def test_fuzz_iree_broadcast_value_read_by_two_reducers(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_broadcast_value_read_by_two(case), "iree", rng)


@pytest.mark.parametrize("engine", ["torch", "reference"])
def test_fuzz_broadcast_value_read_by_two_reducers_other_engines(engine: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_broadcast_value_read_by_two("matmul_norms_f16"), engine, rng)


def _rmsnorm_then_sum(reader: str) -> fg.Graph:
    """An rmsnorm without bias whose scale ([3] over x [2,4,1,3]) is broadcast along axis 1,
    read by a node summing over axes 1-3. The fuzzer's graph (seed 453) reached it from a
    conv wgrad: wgrad -> tanh -> rmsnorm training (inv_rms read out) -> layernorm training."""
    g = fg.Graph(name=f"fuzz_rms_sum_{reader}", io_data_type=DataType.FLOAT)
    if reader == "wgrad_chain":
        x = g.tensor("x", [2, 4, 5, 3], [60, 5, 1, 20])
        dy = g.tensor("dy", [2, 2, 5, 5], [1, 50, 2, 10])
        dw = g.conv_wgrad(x, dy, padding=[0, 2], dilation=[2, 1]).set_dim([2, 4, 1, 3]).set_stride([12, 1, 1, 4])
        v = g.tanh(dw)
    else:
        v = g.tensor("x", [2, 4, 1, 3])
    r, inv = g.rmsnorm(v, g.tensor("scale", [3]), epsilon=1e-5, phase=fg.NormFwdPhase.TRAINING)
    assert inv is not None
    inv.set_output(True)
    if reader == "avg":
        y = g.reduction(r, fg.ReductionMode.AVG, axes=[1, 2, 3])
    else:
        y, _, _ = g.layernorm(r, g.tensor("s2", [1, 4, 1, 3]), g.tensor("b2", [4, 1, 3]), epsilon=1e-5)
    y.set_name("y").set_output(True)
    return g


# Was a CompileError for a valid graph ("'vector.contract' op invalid accumulator/result vector
# shape", fuzz seed 453): the bug of test_fuzz_iree_product_with_broadcast_operand_into_a_sum, with
# the product inside an rmsnorm (x * inv_rms * scale) rather than a mul node. Fixed in
# engines/iree/lower_base.py (Lowering.broadcast_product counts an rmsnorm without bias as a
# product), so the reader fences it.
@pytest.mark.parametrize("reader", ["layernorm", "avg", "wgrad_chain"])
def test_fuzz_iree_rmsnorm_with_broadcast_scale_into_a_sum(reader: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_rmsnorm_then_sum(reader), "iree", rng)


def _convolution_of_broadcast(case: str) -> fg.Graph:
    """A convolution reading a stride-0 (broadcast) input, expanded from its stand-in size 1 on
    the broadcast axes. The fuzzer's graph (seed 2314104): a lone wgrad of x [2,6,3,5] with
    strides [1,2,0,0] (broadcast over H and W), dy [2,3,3,3], stride [1,2], dilation [1,2]."""
    g = fg.Graph(name=f"fuzz_conv_bcast_{case}", io_data_type=DataType.FLOAT)
    if case == "wgrad_seed_2314104":
        x, dy = g.tensor("x", [2, 6, 3, 5], [1, 2, 0, 0]), g.tensor("dy", [2, 3, 3, 3], [1, 6, 2, 18])
        y = g.conv_wgrad(x, dy, padding=[0, 0], stride=[1, 2], dilation=[1, 2]).set_dim([3, 6, 1, 1])
        y.set_stride([1, 3, 3, 18])
    elif case == "wgrad_1x1":
        y = g.conv_wgrad(g.tensor("x", [2, 1, 3, 5], [1, 1, 0, 0]), g.tensor("dy", [2, 3, 3, 5]),
                         padding=[0, 0]).set_dim([3, 1, 1, 1])
    elif case == "wgrad_of_broadcast_dy":
        y = g.conv_wgrad(g.tensor("x", [2, 2, 3, 5]), g.tensor("dy", [2, 3, 3, 5], [3, 1, 0, 0]),
                         padding=[0, 0]).set_dim([3, 2, 1, 1])
    elif case == "dgrad":
        y = g.conv_dgrad(g.tensor("dy", [2, 3, 3, 5], [3, 1, 0, 0]), g.tensor("w", [3, 2, 1, 1]),
                         padding=[0, 0]).set_dim([2, 2, 3, 5])
    else:  # fprop, broadcast over H and W ("fprop_3x3") or over the batch ("fprop_batch")
        x = g.tensor("x", [2, 2, 3, 5], [0, 15, 5, 1] if case == "fprop_batch" else [2, 1, 0, 0])
        win = [3, 3] if case == "fprop_3x3" else [1, 1]
        y = g.conv_fprop(x, g.tensor("w", [3, 2, *win]), padding=[1, 1] if case == "fprop_3x3" else [0, 0])
    y.set_name("y").set_output(True)
    return g


# Was a CompileError for a valid graph -- iree-compile crashed (SIGSEGV in MaterializeEncoding's
# DecomposeMismatchEncodingTensorStoreOp), which fusegraph already reported as a typed
# CompileError with the reproducer kept, the calling process unharmed (fuzz seed 2314104: a lone
# wgrad). Any convolution of an input broadcast along its spatial or batch axes crashed with
# data tiling; without it, it compiled. Fixed in engines/iree/lower_base.py
# (Lowering._materialize_expansion): a convolution reads such an input's expansion from its own
# dispatch.
@pytest.mark.parametrize("case", ["wgrad_seed_2314104", "wgrad_1x1", "wgrad_of_broadcast_dy", "dgrad",
                                  "fprop_1x1", "fprop_3x3", "fprop_batch"])
def test_fuzz_iree_convolution_of_a_broadcast_input(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_convolution_of_broadcast(case), "iree", rng)


# The module the emitter wrote for wgrad_1x1 before the fix (the expansion fused into the
# convolution): IREE 3.13 crashes on it with data tiling.
WGRAD_OF_BROADCAST_BEFORE_THE_FIX = """module {
  func.func @main(%arg0: !torch.vtensor<[2,1,1,1],f32>, %arg1: !torch.vtensor<[2,3,3,5],f32>) -> (!torch.vtensor<[3,1,1,1],f32>) {
    %int2 = torch.constant.int 2
    %int1 = torch.constant.int 1
    %int3 = torch.constant.int 3
    %int5 = torch.constant.int 5
    %int0 = torch.constant.int 0
    %full = torch.prim.ListConstruct %int2, %int1, %int3, %int5 : (!torch.int, !torch.int, !torch.int, !torch.int) -> !torch.list<int>
    %x = torch.aten.broadcast_to %arg0, %full : !torch.vtensor<[2,1,1,1],f32>, !torch.list<int> -> !torch.vtensor<[2,1,3,5],f32>
    %img = torch.prim.ListConstruct %int1, %int2, %int3, %int5 : (!torch.int, !torch.int, !torch.int, !torch.int) -> !torch.list<int>
    %xg = torch.aten.view %x, %img : !torch.vtensor<[2,1,3,5],f32>, !torch.list<int> -> !torch.vtensor<[1,2,3,5],f32>
    %perm = torch.prim.ListConstruct %int1, %int0, %int2, %int3 : (!torch.int, !torch.int, !torch.int, !torch.int) -> !torch.list<int>
    %dyk = torch.aten.permute %arg1, %perm : !torch.vtensor<[2,3,3,5],f32>, !torch.list<int> -> !torch.vtensor<[3,2,3,5],f32>
    %none = torch.constant.none
    %ones = torch.prim.ListConstruct %int1, %int1 : (!torch.int, !torch.int) -> !torch.list<int>
    %zeros = torch.prim.ListConstruct %int0, %int0 : (!torch.int, !torch.int) -> !torch.list<int>
    %false = torch.constant.bool false
    %c = torch.aten.convolution %xg, %dyk, %none, %ones, %zeros, %ones, %false, %zeros, %int1 : !torch.vtensor<[1,2,3,5],f32>, !torch.vtensor<[3,2,3,5],f32>, !torch.none, !torch.list<int>, !torch.list<int>, !torch.list<int>, !torch.bool, !torch.list<int>, !torch.int -> !torch.vtensor<[1,3,1,1],f32>
    %dims = torch.prim.ListConstruct %int3, %int1, %int1, %int1 : (!torch.int, !torch.int, !torch.int, !torch.int) -> !torch.list<int>
    %dw = torch.aten.view %c, %dims : !torch.vtensor<[1,3,1,1],f32>, !torch.list<int> -> !torch.vtensor<[3,1,1,1],f32>
    return %dw : !torch.vtensor<[3,1,1,1],f32>
  }
}
"""


def test_fuzz_iree_compiler_crash_is_a_typed_error_with_a_reproducer(tmp_path: Path) -> None:
    """A SIGSEGV of iree-compile never takes the caller down: the engine, handed the module the
    emitter wrote for test_fuzz_iree_convolution_of_a_broadcast_input[wgrad_1x1] before the fix,
    raises CompileError naming the crash and keeps a reproducer that re-runs it. This pins IREE
    3.13's crash: if a newer IREE compiles the module, this test says so (drop it then)."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.iree import IreeEngine
    from fusegraph.engines.iree.emit import EmitOptions, EmittedModule

    g = _convolution_of_broadcast("wgrad_1x1")
    g.validate()

    def old_emitter(graph: fg.Graph, func_name: str = "main", options: EmitOptions | None = None) -> EmittedModule:
        return EmittedModule(WGRAD_OF_BROADCAST_BEFORE_THE_FIX, func_name, ("x", "dy"), ("y",),
                             ((2, 1, 1, 1), (2, 3, 3, 5)), ((3, 1, 1, 1),))

    with pytest.raises(fg.CompileError) as info:
        IreeEngine(emitter=old_emitter).build(g, fg.Handle("cpu"), EngineConfig("iree", (("data_tiling", True),)))
    assert "crashed (SIGSEGV)" in str(info.value), str(info.value)[:2000]
    repro = info.value.reproducer
    assert repro is not None and (repro / "module.mlir").read_text() == WGRAD_OF_BROADCAST_BEFORE_THE_FIX
    assert (repro / "repro.sh").is_file()


@pytest.mark.parametrize("engine", ["iree", "torch"])
def test_fuzz_layernorm_of_a_repeated_value_errs_by_its_conditioning(engine: str, rng: np.random.Generator) -> None:
    """Fuzz seed 173 (layernorm training of a stride-0 input [3,4,5] -> reduce_avg: IREE's rel err
    1.02e-4 > 1e-4) is the problem's conditioning, not a lowering bug. Each group is one repeated
    value x, so y = bias + scale * (x - mean) / sqrt(var + eps) with var = 0: the f32 mean's
    rounding (sum then divide: up to n * u * |x|) is amplified 1/sqrt(eps) = 316 times, and the
    average of y cancels (|mean(y)| ~ 0.02 against |y| ~ 1). Pinned here: every engine is within
    that bound element by element, and y itself meets the norm tolerance. torch happens to be
    exact (its Welford mean of equal values is exact); a shifted mean made IREE exact too but
    cost 4-29% on every layernorm/batchnorm, so the fuzzer feeds norms groups with spread
    instead (test_fuzz_graphs._spread)."""
    g = fg.Graph(name="fuzz_ln_repeated", io_data_type=DataType.FLOAT)
    x = g.tensor("x", [3, 4, 5], [0, 0, 0])
    y, _, _ = g.layernorm(x, g.tensor("scale", [1, 4, 5]), g.tensor("bias", [4, 5]), epsilon=1e-5,
                          phase=fg.NormFwdPhase.TRAINING)
    y.set_name("y").set_output(True)
    g.reduction(y, fg.ReductionMode.AVG, axes=[0, 1, 2]).set_name("avg").set_output(True)
    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    got = g.execute(dict(inputs), engine=engine)
    u, n = 2.0**-24, 20
    bound = n * u * abs(float(np.asarray(inputs["x"]).ravel()[0])) * np.abs(np.asarray(inputs["scale"], np.float64)) / np.sqrt(1e-5)
    err_y = np.abs(np.asarray(got["y"], np.float64) - np.asarray(ref["y"], np.float64))
    assert np.all(err_y <= bound + 1e-7), f"{engine}: max err {err_y.max():.3g} beyond the conditioning bound"
    err_avg = abs(float(np.asarray(got["avg"], np.float64).ravel()[0]) - float(np.asarray(ref["avg"]).ravel()[0]))
    assert err_avg <= float(bound.mean()) + 1e-7, f"{engine}: avg err {err_avg:.3g}"
    y_rel = np.linalg.norm(err_y) / np.linalg.norm(np.asarray(ref["y"], np.float64))
    assert y_rel <= 1e-4, f"{engine}: y rel err {y_rel:.3g}"


def _lone_reduction_beside_a_packed_operand(case: str) -> fg.Graph:
    """A node reducing a value to one number (every axis of extent > 1 summed) while the
    value, or something computed from the same elementwise producer, is a matmul's or a
    convolution's operand. The fuzzer's graph (seed 24718, f16 io, f32 compute): x [3,1,1,2]
    with strides [2,6,6,1] read by a wgrad whose dy [3,2,1,1] is 1x1 (a matmul over the
    batch) -> gelu_approx_tanh, and by a batchnorm with one channel (its statistics reduce
    all of x); the shared producer is x's cast to f32."""
    io = DataType.HALF if case in ("seed_24718", "wgrad_f16_sum") else DataType.FLOAT
    g = fg.Graph(name=f"fuzz_lone_reduction_{case}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    if case in ("seed_24718", "wgrad_f16_sum"):
        x = g.tensor("x", [3, 1, 1, 2], [2, 6, 6, 1])
        dw = g.conv_wgrad(x, g.tensor("dy", [3, 2, 1, 1], [1, 3, 6, 1]), padding=[0, 0]).set_dim([2, 1, 1, 2])
        (g.gelu_approx_tanh(dw) if case == "seed_24718" else dw).set_name("c").set_output(True)
        if case == "seed_24718":
            y, _, _ = g.batchnorm(x, g.tensor("scale", [1]), g.tensor("bias", [1]), epsilon=1e-3)
        else:
            y = g.reduction(x, fg.ReductionMode.SUM, axes=[0, 1, 2, 3])
        y.set_name("y").set_output(True)
        return g
    batch1 = case in ("rmsnorm_batch1", "layernorm_batch1", "sum_batch1")
    t = g.tanh(g.tensor("x", [1, 3, 4] if batch1 else [4, 3] if case == "matmul_b_sum" else [3, 4]))
    if case == "matmul_b_sum":
        g.matmul(g.tensor("a", [5, 4]), t).set_name("c").set_output(True)
    else:
        a = g.neg(t) if case == "siblings" else t
        g.matmul(a, g.tensor("b", [1, 4, 5] if batch1 else [4, 5])).set_name("c").set_output(True)
    if case == "rmsnorm_batch1":
        y, _ = g.rmsnorm(t, g.tensor("scale", [1, 3, 4]))
    elif case == "layernorm_batch1":
        y, _, _ = g.layernorm(t, g.tensor("scale", [1, 3, 4]), g.tensor("bias", [1, 3, 4]))
    else:
        mode = {"avg": fg.ReductionMode.AVG, "norm2": fg.ReductionMode.NORM2}.get(case, fg.ReductionMode.SUM)
        y = g.reduction(g.exp(t) if case == "siblings" else t, mode, axes=[1, 2] if batch1 else [0, 1])
    y.set_name("y").set_output(True)
    return g


# Was a CompileError for a valid graph (fuzz seed 24718, the only failure of the lead's 11,384-graph
# run: "'vector.store' op write affecting operations on global resources are restricted to
# workgroup distributed contexts"; the smaller graphs here failed the same way, or with
# 'memref.store'), with data tiling only: IREE 3.13 fused an elementwise producer into a
# reduction to one value and, with it, the producer's other consumer, the pack (set_encoding)
# of a matmul's or convolution's operand, whose store then lay outside the distributed loops
# (iree-org/iree issue 24058 describes the same dispatch). Fixed in engines/iree/lower_base.py
# (Lowering.shares_a_packed_operand; lower_reduce.py and lower_norm.py fence the reader's input).
@pytest.mark.parametrize("case", [
    "seed_24718", "wgrad_f16_sum", "matmul_sum", "matmul_b_sum", "siblings", "avg", "norm2", "sum_batch1",
    "rmsnorm_batch1", "layernorm_batch1",
])
def test_fuzz_iree_lone_reduction_beside_a_packed_operand(case: str, rng: np.random.Generator) -> None:
    _agrees_with_data_tiling(_lone_reduction_beside_a_packed_operand(case), rng)


def test_fuzz_lone_reduction_beside_a_packed_operand_on_torch(rng: np.random.Generator) -> None:
    agrees_with_reference(_lone_reduction_beside_a_packed_operand("seed_24718"), "torch", rng)


# Was a CompileError for a pure data-movement graph (fuzz seed 1018: x[7] -> slice [6:7] ->
# reshape [1,1,1] (an output) -> reshape; "expected rank to be smaller or equal to the other
# rank" on a tensor.extract_slice from tensor<7xi32> to tensor<1x1x1xi32>). The output read by
# another node is fenced (Lowering.set); IREE 3.13's BubbleUpExpandShapesPass folded the
# one-element slice and the view adding unit axes, inside the fence's dispatch region, into a
# rank-expanding extract_slice. Fixed in engines/iree/lower_base.py (Lowering.fence: a
# one-element value is fenced with util.optimization_barrier). Slices of more than one element,
# and views of the one-element slice that add no axes, compiled before and still do.
@pytest.mark.parametrize(("xd", "starts", "ends", "steps", "yd", "reader"), [
    ([7], [6], [7], [1], [1, 1, 1], "reshape"),  # seed 1018
    ([7], [6], [7], [1], [1, 1, 1], "neg"),
    ([7], [6], [7], [3], [1, 1], "add"),
    ([3, 4], [1, 1], [2, 2], [1, 1], [1, 1, 1, 1], "reshape"),
    ([7], [4], [6], [1], [1, 2, 1], "reshape"),  # two elements: compiled before too
], ids=["seed_1018", "neg", "step3_add", "2d_rank4", "two_elements"])
@pytest.mark.parametrize("io", [DataType.INT32, DataType.FLOAT], ids=["i32", "f32"])
def test_fuzz_iree_one_element_slice_viewed_to_more_unit_axes(
    xd: list[int], starts: list[int], ends: list[int], steps: list[int], yd: list[int], reader: str,
    io: DataType, rng: np.random.Generator,
) -> None:
    g = fg.Graph(name="fuzz_slice_view", io_data_type=io)
    r = g.reshape(g.slice(g.tensor("x", xd), starts, ends, steps), yd).set_name("y").set_output(True)
    z = {"reshape": lambda: g.reshape(r, yd), "neg": lambda: g.neg(r), "add": lambda: g.add(r, r)}[reader]()
    z.set_name("z").set_output(True)
    agrees_with_reference(g, "iree", rng)


def _layernorm_statistics_beside_a_softmax(case: str) -> fg.Graph:
    g = fg.Graph(name=f"fuzz_ln_stats_softmax_{case}", io_data_type=DataType.FLOAT)
    if case == "seed_817":  # channels-last x [3,2,7,5], softmax over the channels
        dims, x = [3, 2, 7, 5], g.tensor("x", [3, 2, 7, 5], [70, 1, 10, 2])
        x = g.softmax(x, axis=1)
    else:
        dims, x = [8, 3], g.tensor("x", [8, 3])
        if case == "softmax_layernorm":
            x = g.softmax(x, axis=-1)
        elif case in ("tanh_matmul_softmax", "softmax_tanh_layernorm"):
            if case == "tanh_matmul_softmax":  # seed 3000314297
                x = g.tanh(g.matmul(g.tensor("a", [8, 7]), g.tensor("b", [7, 3])))
            x = g.softmax(x, axis=-1)
            if case == "softmax_tanh_layernorm":
                x = g.tanh(x)
    y, mean, inv_var = g.layernorm(x, g.tensor("scale", [1, *dims[1:]]), g.tensor("bias", dims[1:]),
                                   phase=fg.NormFwdPhase.TRAINING)
    assert mean is not None and inv_var is not None
    mean.set_output(True)
    inv_var.set_output(True)
    if case == "layernorm_softmax":  # seed 34410
        y = g.softmax(y, axis=-1)
    elif case == "layernorm_tanh_softmax":
        y = g.softmax(g.tanh(y), axis=-1)
    y.set_name("y").set_output(True)
    return g


# Was a CompileError for valid graphs (fuzz seeds 817, 3000314297 (5 shrink variants) and 34410
# of the lead's 10,322-graph run: "'vector.store' (or 'memref.store') op write affecting
# operations on global resources are restricted to workgroup distributed contexts"): a layer norm
# whose statistics are graph outputs, fused by IREE 3.13 with a softmax over the same rows before
# or after it, had the statistics' stores left outside the distributed loops. Not the packed-operand
# case of seed 24718 (no contraction is needed: seed 817 has none). Fixed in engines/iree/lower_base.py
# (Lowering.beside_a_softmax) and lower_norm.py (the layer norm fences its input or its result).
@pytest.mark.parametrize("case", [
    "seed_817", "softmax_layernorm", "softmax_tanh_layernorm", "tanh_matmul_softmax", "layernorm_softmax",
    "layernorm_tanh_softmax",
])
def test_fuzz_iree_layernorm_statistics_beside_a_softmax(case: str, rng: np.random.Generator) -> None:
    agrees_with_reference(_layernorm_statistics_beside_a_softmax(case), "iree", rng)


def test_fuzz_layernorm_statistics_beside_a_softmax_on_torch(rng: np.random.Generator) -> None:
    agrees_with_reference(_layernorm_statistics_beside_a_softmax("seed_817"), "torch", rng)


# Not a bug (fuzz seed 1112, 4 shrink variants: log_softmax -> wgrad -> tanh -> batchnorm with
# C = 1 over 2 values, its mean read out; IREE rel err 0.163 and 0.117 > 1e-4, and torch errs
# too, 0.023 on the same inputs). tanh of the wgrad's [30.2, -7.68] is [1, -0.99999957] in f32,
# so the exact mean is 2.1e-7: a cancellation. Each f32 tanh is rounded to within u/2 |t|
# (u = 2**-23), so any f32 engine's mean errs by up to ~u mean|t| = 6e-8, i.e. 0.3 relative;
# IREE's tanh is within half an ulp (mean 1.79e-7). y and inv_var are well conditioned and
# agree to 1e-7. The fuzzer no longer tanh-squashes a norm's input (tests/test_fuzz_graphs.py
# op_batchnorm: a linear scale, which norms are invariant to); this pins the absolute bound.
@pytest.mark.parametrize("engine", ["iree", "torch"])
def test_fuzz_batchnorm_mean_of_saturated_values_errs_by_its_conditioning(engine: str, rng: np.random.Generator) -> None:
    g = fg.Graph(name="fuzz_bn_saturated", io_data_type=DataType.FLOAT)
    t = g.tanh(g.mul(g.tensor("x", [2, 1, 1, 1]), g.scalar(20.0)))
    y, mean, inv_var = g.batchnorm(t, g.tensor("scale", [1]), g.tensor("bias", [1]), epsilon=1e-3)
    y.set_name("y").set_output(True)
    mean.set_name("mean").set_output(True)
    inv_var.set_name("inv_var").set_output(True)
    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    got = g.execute(dict(inputs), engine=engine)
    t64 = np.tanh(20.0 * inputs["x"].astype(np.float64))
    u = 2.0**-23
    err = abs(float(np.asarray(got["mean"], np.float64).item()) - float(ref["mean"].item()))
    assert err <= 2 * u * float(np.mean(np.abs(t64))), f"{engine}: mean off by {err:.3g}"
    # inv_var = 1/sqrt(var + eps) is well conditioned (eps bounds it). y = scale * (t - mean) *
    # inv_var + bias inherits the cancellation in t - mean when both t saturate alike (a full
    # suite run drew such inputs: rel err 2.6e-4): each element may err by the rounding of t
    # (~u |t|, twice) times |scale| inv_var, and by f32 rounding of y itself. Over 2,000 seeds
    # torch used at most 0.19 of this bound, IREE (300 seeds) 0.17.
    a, b = np.asarray(got["inv_var"], np.float64), ref["inv_var"]
    assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b), f"{engine}: inv_var"
    a, b = np.asarray(got["y"], np.float64), ref["y"]
    allowed = abs(float(inputs["scale"].item())) * float(ref["inv_var"].item()) * 4 * u * float(np.abs(t64).max())
    assert np.all(np.abs(a - b) <= allowed + 1e-5 * np.abs(b)), f"{engine}: y off by {np.abs(a - b).max():.3g}"


def _matvec_of_elementwise_matrix(case: str) -> fg.Graph:
    """A matrix-vector product whose matrix operand is computed by elementwise ops and stored
    with its contraction axis outside (A [M, K] stored K-major, B [K, N] row-major)."""
    io = DataType.HALF if case == "seed_234407" else DataType.FLOAT
    g = fg.Graph(name=f"fuzz_matvec_{case}", io_data_type=io, intermediate_data_type=DataType.FLOAT,
                 compute_data_type=DataType.FLOAT)
    if case == "seed_234407":  # the fuzzer's graph, dead branches (sigmoid_bwd, log_softmax) kept
        x = g.tensor("in1", [5, 8], [1, 5])
        p = g.sub(g.tensor("in2", [1, 1]), x)
        c = g.matmul(p, g.tensor("in3", [8, 1], [1, 8]))
        g.softmax(g.tanh(c), axis=-1, log=True)
        g.concatenate([g.sigmoid_backward(x, p), g.tensor("in4", [3, 8])], axis=0)
        g.concatenate([p, g.tensor("in5", [5, 2]), c], axis=1).set_name("y").set_output(True)
        return g
    m, k, n = {"k1000": (4, 1000, 1), "vecmat_k1000": (1, 1000, 64), "n2": (5, 8, 2)}.get(case, (5, 8, 1))
    if case in ("vecmat_row_major", "vecmat_n_major", "vecmat_k1000"):  # x[1, K] @ tanh(w)
        t = g.tanh(g.tensor("w", [k, 5 if n == 1 else n], [1, k] if case == "vecmat_n_major" else None))
        c = g.matmul(g.tensor("a", [1, k]), t)
    else:
        shape, strides = ([1, m, k], [m * k, 1, m]) if case == "batch1" else ([m, k], [1, m])
        t = g.tanh(g.tensor("x", shape, None if case == "k_inner" else strides))
        c = g.matmul(g.neg(t) if case == "siblings" else t, g.tensor("w", [*shape[:-2], k, n]))
    c.set_name("c").set_output(True)
    if case not in ("k1000", "vecmat_k1000"):  # the value shared with another reader
        (g.exp(t) if case == "siblings" else g.neg(t)).set_name("q").set_output(True)
    return g


# Was a CompileError for valid graphs, with data tiling (fuzz seed 234407 of a local ~3,000-graph
# run, f16 io: "'vector.store' op write affecting operations on global resources are restricted to
# workgroup distributed contexts"). Minimized: a matvec (N = 1, or M = 1 for B) whose matrix is
# computed by elementwise ops and stored K-outer; IREE 3.13 fused the elementwise work, the
# matrix's pack and the matvec into one dispatch: with the value read elsewhere and M within one
# tile, that read's store fell outside the distributed loops; with K >= 512 (no other reader
# needed) "One or more operations with large vector sizes (16384 bytes) were found". The size-1
# log_softmax and the sigmoid_bwd of the fuzz graph were bystanders (dead code). Fixed in
# engines/iree/lower_matmul.py (_matvec_matrix_k_outer: the matrix is fenced). k_inner,
# vecmat_n_major and n2 compiled before too (controls: no fence).
@pytest.mark.parametrize("case", [
    "seed_234407", "tanh_read_by_neg", "siblings", "batch1", "vecmat_row_major", "k1000", "vecmat_k1000",
    "k_inner", "vecmat_n_major", "n2",
])
def test_fuzz_iree_matvec_of_an_elementwise_matrix_stored_k_outer(case: str, rng: np.random.Generator) -> None:
    _agrees_with_data_tiling(_matvec_of_elementwise_matrix(case), rng)


def _agrees_with_data_tiling(g: fg.Graph, rng: np.random.Generator) -> None:
    """``g`` compiled by IREE with data tiling on agrees with the float64 reference."""
    from fusegraph.engines.base import EngineConfig
    from fusegraph.engines.iree import IreeEngine

    g.validate()
    inputs = random_inputs(g, rng)
    ref = g.execute(dict(inputs), engine="reference")
    plan = IreeEngine().build(g, fg.Handle("cpu"), EngineConfig("iree", (("data_tiling", True),)))
    err, why = compare(g, plan.execute(dict(inputs)), ref)
    assert err <= tolerance(g), f"rel err {err:.3g} > {tolerance(g):g} {why}"

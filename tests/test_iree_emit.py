"""Structural tests of the IREE emitter: the emitted torch-dialect lines (golden text),
the boundary convention, the layout strategy, the tables' completeness, and errors.
Two tests compile, to read IREE's dispatch structure (fusion)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import fusegraph as fg
from fusegraph import PointwiseMode, PoolingMode
from fusegraph.dtypes import DataType
from fusegraph.engines.iree import emit as emit_mod
from fusegraph.engines.iree.emit import LOWER, EmitOptions, emit_mlir, unsupported_reason
from fusegraph.engines.iree.lower_pointwise import POINTWISE_LOWER
from fusegraph.graph.ops import OpKind

F16, F32 = DataType.HALF, DataType.FLOAT


def conv_bias_relu(user_layout: str = "NHWC", io: DataType = F16) -> fg.Graph:
    g = fg.Graph(name="cbr", io_data_type=io, intermediate_data_type=F32, compute_data_type=F32)
    x = g.tensor("x", [2, 8, 10, 10], fg.strides_for([2, 8, 10, 10], user_layout))
    filt = "KRSC" if user_layout == "NHWC" else "KCRS"
    w = g.tensor("w", [16, 8, 3, 3], fg.strides_for([16, 8, 3, 3], filt))
    b = g.tensor("b", [1, 16, 1, 1])
    conv = g.conv_fprop(x, w, padding=[1, 1], name="conv")
    y = g.relu(g.bias(conv, b, name="bias"), name="relu").set_name("y").set_output(True)
    y.set_stride(fg.strides_for([2, 16, 10, 10], user_layout)).set_data_type(io)
    return g.validate()


def lines_with(text: str, needle: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if needle in line]


def conv_line(text: str) -> str:
    return lines_with(text, "linalg.conv_")[0]


# ---- golden text ----------------------------------------------------------------------------
def test_conv_bias_relu_nhwc_golden() -> None:
    m = emit_mlir(conv_bias_relu("NHWC"))
    t = m.text
    # Boundary: dense memory-order buffers in their own dtype.
    assert re.search(
        r"func\.func @main\(%arg0: !torch\.vtensor<\[2,10,10,8\],f16>, %arg1: !torch\.vtensor<\[16,3,3,8\],f16>, "
        r"%arg2: !torch\.vtensor<\[1,16,1,1\],f16>\) -> \(!torch\.vtensor<\[2,10,10,16\],f16>\)",
        t,
    ), t
    # The activation is never transposed; the KRSC filter becomes HWCF once, fenced off.
    permutes = lines_with(t, "torch.aten.permute")
    assert len(permutes) == 1 and "%arg1" in permutes[0] and "-> !torch.vtensor<[3,3,8,16],f16>" in permutes[0]
    barrier = lines_with(t, "iree_tensor_ext.compute_barrier.start")
    assert len(barrier) == 1 and "tensor<3x3x8x16xf16>" in barrier[0]
    assert barrier[0].split()[0] in conv_line(t)  # the fenced filter feeds the conv
    assert lines_with(t, "tensor.pad")[0].endswith("low[0, 1, 1, 0] high[0, 1, 1, 0] {")
    conv = lines_with(t, "linalg.conv_2d_nhwc_hwcf")
    assert len(conv) == 1
    # Mixed precision: f16 operands, f32 accumulator (no up-casts of the operands).
    assert "ins(" in conv[0] and "tensor<2x12x12x8xf16>, tensor<3x3x8x16xf16>" in conv[0]
    assert "outs(" in conv[0] and "tensor<2x10x10x16xf32>" in conv[0]
    # Epilogue in f32 on the channels-last result; the bias reshaped to [1,1,1,16].
    assert any("torch.aten.view %arg2" in line and "[1,1,1,16],f16>" in line for line in t.splitlines())
    add = lines_with(t, "torch.aten.add.Tensor")
    assert len(add) == 1 and "!torch.vtensor<[2,10,10,16],f32>, !torch.vtensor<[1,1,1,16],f32>" in add[0]
    assert len(lines_with(t, "torch.aten.relu")) == 1
    ret = lines_with(t, "return")[0]
    final = lines_with(t, ret.split()[1] + " = ")[0]
    assert "torch.aten.to.dtype" in final and final.endswith("-> !torch.vtensor<[2,10,10,16],f16>")


def test_conv_nchw_user_layout_permutes_at_boundary_only() -> None:
    t = emit_mlir(conv_bias_relu("NCHW", io=F32)).text
    permutes = lines_with(t, "torch.aten.permute")
    # x NCHW -> NHWC, filter KCRS -> HWCF, result NHWC -> NCHW: three, none in between.
    assert len(permutes) == 3
    assert "%arg0" in permutes[0] and "-> !torch.vtensor<[2,10,10,8],f32>" in permutes[0]
    assert permutes[2].endswith("-> !torch.vtensor<[2,16,10,10],f32>")
    assert lines_with(t, "return")[0].split()[1] == permutes[2].split()[0]
    assert len(lines_with(t, "torch.aten.to.dtype")) == 0  # f32 throughout: no casts


def test_conv_layout_nchw_knob() -> None:
    t = emit_mlir(conv_bias_relu("NCHW", io=F32), options=EmitOptions(conv_layout="nchw")).text
    assert len(lines_with(t, "torch.aten.convolution")) == 1
    assert not lines_with(t, "linalg.conv")
    assert not lines_with(t, "torch.aten.permute")


def test_filter_fence_knob() -> None:
    g = conv_bias_relu("NHWC")
    opt = emit_mlir(g, options=EmitOptions(filter_fence="optimization_barrier")).text
    assert len(lines_with(opt, "util.optimization_barrier")) == 1 and "compute_barrier" not in opt
    bare = emit_mlir(g, options=EmitOptions(filter_fence="none")).text
    assert "barrier" not in bare
    # A filter already stored HWCF needs no transpose and no fence.
    g2 = fg.Graph(io_data_type=F32)
    x = g2.tensor("x", [1, 4, 6, 6], fg.strides_for([1, 4, 6, 6], "NHWC"))
    w = g2.tensor("w", [8, 4, 3, 3], fg.graph.layout.packed_strides([8, 4, 3, 3], (2, 3, 1, 0)))
    g2.conv_fprop(x, w).set_output(True)
    t2 = emit_mlir(g2.validate()).text
    assert "barrier" not in t2 and not lines_with(t2, "torch.aten.permute")


def test_grouped_and_depthwise_choices() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [1, 8, 6, 6], fg.strides_for([1, 8, 6, 6], "NHWC"))
    g.conv_fprop(x, g.tensor("wd", [8, 1, 3, 3]), padding=[1, 1]).set_output(True)
    g.conv_fprop(x, g.tensor("wg", [8, 4, 3, 3]), padding=[1, 1]).set_output(True)
    t = emit_mlir(g.validate()).text
    assert len(lines_with(t, "linalg.depthwise_conv_2d_nhwc_hwc ")) == 1
    grouped = lines_with(t, "torch.aten.convolution")
    assert len(grouped) == 1 and grouped[0].count("!torch.int") >= 1


def test_pointwise_chain_keeps_layout() -> None:
    """An NHWC input through pointwise ops to an NHWC output: no transposes at all."""
    g = fg.Graph(io_data_type=F32)
    dims = [2, 4, 5, 6]
    x = g.tensor("x", dims, fg.strides_for(dims, "NHWC"))
    b = g.tensor("b", [1, 4, 1, 1])
    y = g.sigmoid(g.add(g.exp(x), b)).set_output(True)
    m = emit_mlir(g.validate())
    assert m.input_shapes[0] == (2, 5, 6, 4) and m.output_shapes[0] == (2, 5, 6, 4)
    assert y.stride == list(fg.strides_for(dims, "NHWC"))
    assert not lines_with(m.text, "torch.aten.permute")


def test_nhwc_block_has_no_activation_transpose() -> None:
    """conv -> batchnorm -> relu -> conv -> +x -> relu -> maxpool, NHWC end to end: the
    only permutes are the two KRSC filters becoming HWCF."""
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [1, 8, 10, 10], fg.strides_for([1, 8, 10, 10], "NHWC"))

    def conv(t: fg.TensorAttr, name: str) -> fg.TensorAttr:
        return g.conv_fprop(t, g.tensor(name, [8, 8, 3, 3], fg.strides_for([8, 8, 3, 3], "KRSC")), padding=[1, 1])

    h = g.relu(g.batchnorm_inference(conv(x, "w1"), *(g.tensor(n, [8]) for n in ("s", "b", "m", "v"))))
    h = g.relu(g.add(conv(h, "w2"), x))
    g.pooling(h, PoolingMode.MAX, window=(3, 3), stride=(2, 2), padding=(1, 1)).set_output(True)
    t = emit_mlir(g.validate()).text
    permutes = lines_with(t, "torch.aten.permute")
    assert len(permutes) == 2 and all("[3,3,8,8],f32>" in p for p in permutes)
    assert len(lines_with(t, "linalg.conv_2d_nhwc_hwcf")) == 2
    assert len(lines_with(t, "linalg.pooling_nhwc_max")) == 1


def test_transpose_is_free() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [2, 3, 4])
    g.exp(g.transpose(g.transpose(x, [2, 0, 1]), [1, 2, 0])).set_output(True)
    assert not lines_with(emit_mlir(g.validate()).text, "torch.aten.permute")


def test_boundary_convention() -> None:
    g = fg.Graph(io_data_type=F32)
    a = g.tensor("a", [2, 3, 4, 5], fg.strides_for([2, 3, 4, 5], "NHWC"))
    bc = g.tensor("bc", [2, 3, 4, 5], [0, 1, 0, 0])  # broadcast along N, H, W
    g.add(a, bc).set_name("s").set_output(True)
    g.mul(a, g.scalar(2.5)).set_name("p").set_output(True)
    m = emit_mlir(g.validate(), func_name="fwd")
    assert m.func_name == "fwd" and "func.func @fwd(" in m.text
    assert m.inputs == tuple(t.name for t in g.inputs()) == ("a", "bc")
    assert m.outputs == tuple(t.name for t in g.outputs()) == ("s", "p")
    assert m.input_shapes == ((2, 4, 5, 3), (3, 1, 1, 1))
    assert m.output_shapes == ((2, 4, 5, 3), (2, 4, 5, 3))
    # The scalar is inlined as a constant, not an argument.
    assert "torch.vtensor.literal(dense<2.5" in m.text
    assert m.text.count("%arg") == m.text.count("%arg0") + m.text.count("%arg1")


def test_mixed_precision_matmul_casts() -> None:
    g = fg.Graph(io_data_type=F16)
    g.matmul(g.tensor("a", [4, 8]), g.tensor("b", [8, 3])).set_output(True)
    t = emit_mlir(g.validate()).text
    casts = lines_with(t, "torch.aten.to.dtype")
    assert len(casts) == 3  # a, b up to f32; the result down to f16
    mm = lines_with(t, "torch.aten.matmul")[0]
    assert mm.endswith("-> !torch.vtensor<[4,3],f32>")


def test_pooling_and_attention_lowerings() -> None:
    g = fg.Graph(io_data_type=F32)
    x = g.tensor("x", [1, 2, 6, 6])
    g.pooling(x, PoolingMode.MAX, window=(3, 3), stride=(2, 2), padding=(1, 1)).set_output(True)
    q = g.tensor("q", [1, 2, 4, 8])
    g.sdpa(q, q, q, causal=True).set_output(True)
    t = emit_mlir(g.validate()).text
    assert len(lines_with(t, "linalg.pooling_nhwc_max")) == 1
    assert any("arith.constant 0xFF800000 : f32" in line for line in t.splitlines())  # -inf pad
    assert len(lines_with(t, "torch.aten.scaled_dot_product_attention")) == 1
    t2 = emit_mlir(g, options=EmitOptions(attention="decomposed")).text
    assert not lines_with(t2, "scaled_dot_product_attention") and lines_with(t2, "torch.aten.softmax.int")


def test_round_intermediates_knob() -> None:
    g = fg.Graph(io_data_type=F16)
    g.tanh(g.exp(g.relu(g.tensor("x", [4, 4])))).set_output(True)
    g.validate()
    exact = emit_mlir(g).text
    wide = emit_mlir(g, options=EmitOptions(round_intermediates=False)).text
    # Each op rounds to f16 and widens again, vs one widening in and one rounding out.
    assert len(lines_with(exact, "torch.aten.to.dtype")) == 6
    assert len(lines_with(wide, "torch.aten.to.dtype")) == 2


# ---- tables, options, errors -------------------------------------------------------------------
def test_every_op_and_mode_has_a_lowering() -> None:
    from fusegraph.engines.unsupported import UNSUPPORTED

    declared = set(UNSUPPORTED["iree"])  # the backward ops IREE declares it does not run yet
    assert set(LOWER) | (declared & set(OpKind)) == set(OpKind)
    assert set(POINTWISE_LOWER) | (declared & set(PointwiseMode)) == set(PointwiseMode)


def test_emit_knobs_match_options() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(EmitOptions)}
    assert {k.name: k.default for k in emit_mod.EMIT_KNOBS} == fields
    for k in emit_mod.EMIT_KNOBS:
        for choice in k.choices:
            EmitOptions(**{k.name: choice})  # every choice is accepted


def test_emit_options_validate() -> None:
    with pytest.raises(ValueError, match="conv_layout"):
        EmitOptions(conv_layout="chwn")
    with pytest.raises(ValueError, match="attention"):
        EmitOptions(attention="flash")
    with pytest.raises(ValueError, match="filter_fence"):
        EmitOptions(filter_fence=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_variance"):
        EmitOptions(norm_variance="welford")


def test_emitter_version_covers_lowering_modules() -> None:
    v = emit_mod.EMITTER_VERSION
    assert re.fullmatch(r"[0-9a-f]{16}", v)
    assert v == emit_mod._source_digest()


def test_unsupported_reason_names_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    g = fg.Graph(io_data_type=F32)
    g.softmax(g.tensor("x", [2, 3]), name="sm").set_output(True)
    g.validate()
    assert unsupported_reason(g) is None
    monkeypatch.delitem(LOWER, OpKind.SOFTMAX)
    reason = unsupported_reason(g)
    assert reason is not None and "'sm'" in reason and "softmax" in reason
    with pytest.raises(fg.UnsupportedError):
        emit_mlir(g)


def test_f64_transcendentals_are_refused() -> None:
    g = fg.Graph(io_data_type=DataType.DOUBLE, compute_data_type=DataType.DOUBLE)
    x = g.tensor("x", [3])
    g.exp(x, name="e").set_output(True)  # fine in f64
    g.validate()
    assert unsupported_reason(g) is None
    g.tanh(x, name="th").set_output(True)
    g.validate()
    reason = unsupported_reason(g)
    assert reason is not None and "'th'" in reason and "f64" in reason
    # Without a declared f64 compute type, f64 tensors compute in f32: supported.
    g2 = fg.Graph(io_data_type=DataType.DOUBLE)
    g2.tanh(g2.tensor("x", [3])).set_output(True)
    assert unsupported_reason(g2.validate()) is None


def test_emit_validates_first() -> None:
    g = fg.Graph(io_data_type=F32)
    g.exp(g.tensor("x", [3])).set_output(True)
    assert not g.is_validated
    emit_mlir(g)
    assert g.is_validated


def test_graph_emit_mlir_hook() -> None:
    assert "linalg.conv_2d_nhwc_hwcf" in conv_bias_relu().emit_mlir()


# ---- fusion: read IREE's dispatch structure -----------------------------------------------------
def _dispatches(text: str, tmp_path: Path) -> tuple[list[str], int]:
    """Dispatch function names (from the dumped executable sources) and IREE's count."""
    ic = pytest.importorskip("iree.compiler", reason="IREE's compiler wheel is a hard dependency")
    stats = tmp_path / "stats.json"
    srcs = tmp_path / "sources"
    ic.compile_str(
        text,
        target_backends=["llvm-cpu"],
        input_type="torch",
        extra_args=[
            "--iree-llvmcpu-target-cpu=host",
            "--iree-scheduling-dump-statistics-format=json",
            f"--iree-scheduling-dump-statistics-file={stats}",
            f"--iree-hal-dump-executable-sources-to={srcs}",
        ],
    )
    names = []
    for f in sorted(srcs.glob("*.mlir")):
        names += re.findall(r"hal\.executable\.export public @(\S+?)\s*(?:ordinal|\()", f.read_text())
    count = json.loads(stats.read_text())["stream-aggregate"]["execution"]["dispatch-count"]
    return names, int(count)


def test_conv_bias_relu_fuses_into_the_conv_dispatch(tmp_path: Path) -> None:
    names, count = _dispatches(emit_mlir(conv_bias_relu("NHWC", io=F32)).text, tmp_path)
    assert count == len(names)
    convs = [n for n in names if "conv" in n]
    assert len(convs) == 1, names
    # Only data movement besides: the filter transpose (fenced) and the zero padding.
    others = [n for n in names if n not in convs]
    assert all(("transpose" in n or "memcpy" in n) for n in others), names
    assert not any("elementwise" in n for n in names), names  # bias and ReLU live in the conv


def test_pointwise_chain_is_one_dispatch(tmp_path: Path) -> None:
    g = fg.Graph(io_data_type=F16)
    x, b = g.tensor("x", [64, 128]), g.tensor("b", [128])
    y = g.tanh(g.mul(g.sigmoid(g.add(g.exp(g.relu(x)), b)), x))
    g.sub(y, g.scalar(0.5)).set_output(True)
    names, count = _dispatches(emit_mlir(g.validate()).text, tmp_path)
    assert count == 1 and len(names) == 1 and "elementwise" in names[0], names

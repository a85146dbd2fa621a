"""`fusegraph bench` command lines (fusegraph/bench/flags.py, cases.py): MIOpenDriver's conv
flags keep MIOpen's meanings (checked on the graphs they build, not by running them), the
other families' flags build the shapes they say, and what the driver cannot do is refused
by name. No timing here: tests/test_bench_run.py runs the driver."""

from __future__ import annotations

import argparse
import math

import pytest

from fusegraph.bench import flags
from fusegraph.bench.cases import Case, cases_of
from fusegraph.bench.flags import UsageError, parse_line, split_line
from fusegraph.dtypes import DataType
from fusegraph.graph.layout import strides_for
from fusegraph.graph.ops import OpKind


def _cases(line: str, defaults: argparse.Namespace | None = None) -> list[Case]:
    tokens = split_line(line)
    assert tokens is not None
    return cases_of(parse_line(tokens, defaults), line)


def _node(case: Case, kind: OpKind) -> object:
    return next(n for n in case.graph.nodes if n.kind == kind)


def test_miopen_documented_conv_line_runs_unchanged() -> None:
    """MIOpen's documentation example, program name and all."""
    (case,) = _cases("./bin/MIOpenDriver conv -n 32 -c 64 -H 56 -W 56 -k 64 -y 3 -x 3 -p 1 -q 1 -u 1 -v 1 -F 1 -t 1")
    g = case.graph
    x, w = g.tensor_by_name("x"), g.tensor_by_name("w")
    y = g.outputs()[0]
    assert x.shape == (32, 64, 56, 56) and x.strides == strides_for([32, 64, 56, 56], "NCHW")  # MIOpen's default layout
    assert w.shape == (64, 64, 3, 3) and y.shape == (32, 64, 56, 56)
    attrs = _node(case, OpKind.CONV_FPROP).attrs  # type: ignore[attr-defined]
    assert attrs.pre_padding == attrs.post_padding == (1, 1) and attrs.stride == (1, 1) and attrs.dilation == (1, 1)
    assert case.dtype == DataType.FLOAT and g.compute_data_type == DataType.FLOAT
    assert case.flops == 2.0 * 32 * 64 * 56 * 56 * 64 * 9


def test_forw_selects_directions_as_miopen_does() -> None:
    base = "conv -n 2 -c 4 -H 8 -W 8 -k 4 -y 3 -x 3 -p 1 -q 1"
    for forw, want in ((0, ["fwd", "bwd", "wrw"]), (1, ["fwd"]), (2, ["bwd"]), (4, ["wrw"]), (3, ["fwd", "bwd"]),
                       (5, ["fwd", "wrw"]), (6, ["bwd", "wrw"])):
        got = [c.name.split("_")[1] for c in _cases(f"{base} -F {forw}")]
        assert got == want, forw
    bwd, wrw = _cases(f"{base} -F 6")
    assert [n.kind for n in bwd.graph.nodes] == [OpKind.CONV_DGRAD] and bwd.graph.outputs()[0].shape == (2, 4, 8, 8)
    assert [n.kind for n in wrw.graph.nodes] == [OpKind.CONV_WGRAD] and wrw.graph.outputs()[0].shape == (4, 4, 3, 3)
    with pytest.raises(UsageError, match="-F 8"):
        _cases(f"{base} -F 8")


def test_long_flags_fp16_driver_name_stride_dilation_groups() -> None:
    (case,) = _cases("MIOpenDriver convfp16 --batchsize 4 --in_channels 8 --in_h 17 --in_w 15 --out_channels 12 "
                     "--fil_h 3 --fil_w 5 --pad_h 2 --pad_w 0 --conv_stride_h 2 --conv_stride_w 1 --dilation_h 2 "
                     "--dilation_w 1 --group_count 4 --forw 1")
    g = case.graph
    assert case.dtype == DataType.HALF and g.compute_data_type == DataType.FLOAT
    assert g.tensor_by_name("w").shape == (12, 2, 3, 5)  # [K, C/g, y, x]
    # out = (in + 2p - d(f-1) - 1) / s + 1: h (17+4-4-1)/2+1 = 9, w (15-4-1)/1+1 = 11
    assert g.outputs()[0].shape == (4, 12, 9, 11)
    attrs = _node(case, OpKind.CONV_FPROP).attrs  # type: ignore[attr-defined]
    assert attrs.stride == (2, 1) and attrs.dilation == (2, 1)
    assert case.flops == 2.0 * 4 * 12 * 9 * 11 * 2 * 15
    with pytest.raises(UsageError, match="-g 3"):
        _cases("conv -n 1 -c 8 -H 8 -W 8 -k 12 -g 3 -F 1")


def test_3d_flags_and_layouts() -> None:
    (case,) = _cases("conv --spatial_dim 3 -n 2 -c 4 -! 6 -H 8 -W 8 -k 8 -@ 3 -y 3 -x 3 -$ 1 -p 1 -q 1 -# 2 -u 2 -v 2 "
                     "-^ 1 -F 1 --in_layout NHWC --out_layout NHWC --fil_layout NHWC")
    g = case.graph
    x, w, y = g.tensor_by_name("x"), g.tensor_by_name("w"), g.outputs()[0]
    assert x.shape == (2, 4, 6, 8, 8) and x.strides == strides_for(x.shape, "NDHWC")  # NHWC means channels-last in 3-D
    assert w.strides == strides_for(w.shape, "NDHWC") and y.strides == strides_for(y.shape, "NDHWC")
    assert y.shape == (2, 8, 3, 4, 4)
    with pytest.raises(UsageError, match="--in_layout 'CHWN'"):
        _cases("conv -n 1 -c 4 -H 8 -W 8 -k 4 -F 1 -I CHWN")


@pytest.mark.parametrize(("mode", "pads"), [("same", (0, 2)), ("valid", (0, 0)), ("default", (5, 5))])
def test_pad_mode_recomputes_padding_with_miopens_formula(mode: str, pads: tuple[int, int]) -> None:
    # same: in % stride == 0 -> max(f - s, 0) // 2 else max(f - in % s, 0) // 2 (MIOpen's driver):
    # H 8, y 3, u 2 -> 1 // 2 = 0; W 9, x 5, v 2 -> (5 - 1) // 2 = 2
    (case,) = _cases(f"conv -n 1 -c 2 -H 8 -W 9 -k 2 -y 3 -x 5 -u 2 -v 2 -p 5 -q 5 -z {mode} -F 1")
    attrs = _node(case, OpKind.CONV_FPROP).attrs  # type: ignore[attr-defined]
    assert attrs.pre_padding == pads


def test_bias_activation_search_and_refusals() -> None:
    (case,) = _cases("conv -n 1 -c 4 -H 8 -W 8 -k 4 -p 1 -q 1 -F 1 -b 1 --activation gelu -s 1")
    kinds = [n.kind for n in case.graph.nodes]
    assert kinds[0] == OpKind.CONV_FPROP and len(kinds) == 3 and case.tune  # conv, bias, gelu; -s 1 is --tune
    (plain,) = _cases("conv -n 1 -c 4 -H 8 -W 8 -k 4 -p 1 -q 1 -F 1 -b 0 -w 1 -P 0 -S 0 -G 0 -o 0 -V 0 -i 3")
    assert len(plain.graph.nodes) == 1 and not plain.tune
    for extra, needle in (("-d x.bin", "-d/--in_data"), ("-U f16", "-U/--in_cast_type"),
                          ("-r 1", "--pad_val"), ("-Z 1", "vectorized"), ("-y 9 -p 0", "output would be empty")):
        with pytest.raises(UsageError, match=needle):
            _cases(f"conv -n 1 -c 4 -H 8 -W 8 -k 4 -F 1 {extra}")
    with pytest.raises(UsageError, match="unrecognized arguments: --nope"):
        _cases("conv -n 1 --nope 3")
    with pytest.raises(UsageError, match="-n/--batchsize: expected an integer >= 1"):
        _cases("conv -n 0")


def test_transposed_convolution_as_miopen_defines_it() -> None:
    """-m trans: input [N, C, ...], filter [C, K/g, ...], output (in - 1) s - 2p + d(f - 1) + 1 + output pad."""
    (case,) = _cases("conv -m trans -n 2 -c 8 -H 5 -W 6 -k 12 -y 3 -x 3 -p 1 -q 1 -u 2 -v 2 -Y 1 -X 0 -g 2 -F 1 -b 1")
    g = case.graph
    assert g.tensor_by_name("x").shape == (2, 8, 5, 6) and g.tensor_by_name("w").shape == (8, 6, 3, 3)
    assert g.outputs()[0].shape == (2, 12, 10, 11)  # h: 4*2 - 2 + 2 + 1 + 1 = 10; w: 5*2 - 2 + 2 + 1 = 11
    assert g.nodes[0].kind == OpKind.CONV_DGRAD and case.flops == 2.0 * 2 * 8 * 30 * 6 * 9
    with pytest.raises(UsageError, match="-m trans -F 2"):
        _cases("conv -m trans -F 2")
    with pytest.raises(UsageError, match="output padding"):
        _cases("conv -m trans -F 1 -u 2 -v 2 -Y 2")


def test_matmul_flags() -> None:
    (case,) = _cases("matmul -m 6 -n 10 -k 8 --batch 3 --transA T --transB 1 --bias --activation silu --dtype bf16")
    g = case.graph
    a, b, y = g.tensor_by_name("a"), g.tensor_by_name("b"), g.outputs()[0]
    assert a.shape == (3, 6, 8) and a.strides == (48, 1, 6)  # stored [batch, k, m]
    assert b.shape == (3, 8, 10) and b.strides == (80, 1, 8)
    assert y.shape == (3, 6, 10) and case.dtype == DataType.BFLOAT16
    assert case.flops == 2.0 * 3 * 6 * 10 * 8
    (gemm,) = _cases("gemm -M 4 -N 4 -K 4")
    assert gemm.graph.tensor_by_name("a").shape == (4, 4)  # batch 1: plain 2-D


def test_norm_softmax_and_sdpa_flags() -> None:
    (ln,) = _cases("layernorm -X 2x3x4x5 -o 2 -e 1e-3")
    assert ln.graph.tensor_by_name("x").shape == (6, 20) and ln.graph.tensor_by_name("scale").shape == (1, 20)
    (rms,) = _cases("rmsnorm -X 4x7")
    assert rms.graph.tensor_by_name("x").shape == (4, 7) and rms.graph.nodes[0].kind == OpKind.RMSNORM
    with pytest.raises(UsageError, match="normalized_dim 0"):
        _cases("layernorm -X 4x7 -o 0")
    (inst,) = _cases("softmax -n 2 -c 3 -H 4 -W 5 -m 0 -a 2")
    node = inst.graph.nodes[0]
    assert inst.graph.tensor_by_name("x").shape == (2, 60) and node.attrs.axis == 1 and node.attrs.log  # type: ignore[attr-defined]
    (chan,) = _cases("softmax -n 2 -c 3 -H 4 -W 5")
    assert chan.graph.tensor_by_name("x").shape == (2, 3, 4, 5) and not chan.graph.nodes[0].attrs.log  # type: ignore[attr-defined]
    (att,) = _cases("sdpa -b 2 --heads 8 --heads_kv 2 -s 16 --seq_kv 24 -d 32 --causal --mask additive")
    g = att.graph
    assert g.tensor_by_name("q").shape == (2, 8, 16, 32) and g.tensor_by_name("k").shape == (2, 2, 24, 32)
    assert g.tensor_by_name("mask").shape == (1, 1, 16, 24) and att.dtype == DataType.HALF
    assert att.flops == 4.0 * 2 * 8 * 16 * 24 * 32  # causal halves only a square score matrix
    assert att.onnx is None and "grouped" in att.no_onnx
    with pytest.raises(UsageError, match="--heads_kv 3"):
        _cases("sdpa --heads 8 --heads_kv 3")


def test_lines_of_a_file_and_outer_defaults() -> None:
    assert split_line("   ") is None and split_line("# ResNet-50 stage 1") is None
    assert split_line("MIOpenDriver conv -n 1  # trailing comment") == ["conv", "-n", "1"]
    assert split_line("fusegraph bench softmax -n 2") == ["softmax", "-n", "2"]
    p = argparse.ArgumentParser()
    flags.build(p)
    outer = p.parse_args(["--engine", "all", "--device", "cpu", "--compare", "eager,ort", "-i", "4"])
    line = parse_line(["conv", "-n", "1", "-F", "1", "--compare", "ort"], outer)
    assert line.engine == "all" and line.iter == 4 and line.compare == ("ort",)  # the line's own value wins
    both = p.parse_args(["conv", "-F", "1", "--engine", "torch"])  # common options after the family count too
    assert both.engine == "torch" and both.family == "conv"
    with pytest.raises(UsageError, match="must name a family"):
        parse_line(["--seed", "3"], outer)
    with pytest.raises(UsageError, match="unknown baseline 'tensorrt'"):
        parse_line(["softmax", "--compare", "tensorrt"])


def test_work_model_counts_every_io_byte() -> None:
    (case,) = _cases("softmax -X 8x16 --dtype f16")
    assert case.bytes == 2 * 8 * 16 * 2 and math.isclose(case.flops, 0.0)

"""benchmarks/profile_step.py: the kernel classes its ceiling rests on, and one CPU run.

The classes decide what the script calls fusegraph's to win (everything but the vendor
GEMMs, convolutions and attention, the optimizer and the host), so the names below are
kernels as the profiler names them on an H100/H200 (cuBLAS, cuDNN, ATen, Inductor's and
fusegraph's Triton): a pattern reordered or widened moves one of them and fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the script profiles PyTorch training steps")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_step as ps  # noqa: E402

KERNELS = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
    "_kernel__5x_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64> >(...)":
        "attention",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "conv",
    "sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "conv",
    "triton_poi_fused_convolution_backward_0": "fused",  # Inductor's, whatever ops it names
    "triton_red_fused__to_copy_native_layer_norm_backward_3": "fused",
    "triton_per_fused__scaled_dot_product_cudnn_attention_1": "fused",
    "fg_row_kernel": "fused",
    "fg_norm_bwd_rows": "fused",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)": "norm",
    "void cudnn::bn_fw_tr_1C11_singleread_spec<__nv_bfloat16, 512, true, 1, 2, 0>(...)": "norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<c10::BFloat16, float>(...)": "norm",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)": "reduction",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float> > >(...)":
        "reduction",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedSgdMathFunctor>(...)":
        "optimizer",
    "Memcpy DtoD (Device -> Device)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>(...)": "copy",
    "void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true>(...)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(...)>(...)": "elementwise",
    "void at::native::(anonymous namespace)::convert_dtype_kernel<float, c10::BFloat16>(...)": "other",  # not a conv
    # the CPU profile's operators
    "aten::addmm": "gemm",
    "## Call CompiledFxGraph f3opmqewopveed44mozf3pz676el2xbk4q3cfpvpldwd7ct2f3t4 ##": "fused",
    "aten::view": "host",
    "autograd::engine::evaluate_function: AddmmBackward0": "host",
    "aten::mul_": "elementwise",
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_fall_in_their_class(name: str) -> None:
    assert ps.classify(name) == KERNELS[name]


def test_busy_time_is_the_union_of_the_kernels_spans() -> None:
    assert ps._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert ps._union_us([]) == 0


def test_the_ceiling_arithmetic() -> None:
    d = {"step_ms": 100.0, "kernels_ms": 95.0,
         "classes_ms": {c: 0.0 for c in ps.CLASS_NAMES} | {"gemm": 50.0, "attention": 10.0, "optimizer": 5.0,
                                                           "fused": 30.0}}
    c = ps.ceiling(d)
    assert c["rest_ms"] == pytest.approx(30.0)
    cut = 100 * (1 - 1 / 1.05)
    assert c["rest_faster_for_target"] == pytest.approx(30 / (30 - cut))
    assert c["rest_free_speedup"] == pytest.approx(100 / 70)


def test_a_cpu_run_accounts_every_class_of_the_step(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert ps.main(["--device", "cpu", "--models", "convnet", "--variants", "eager,inductor",
                    "--steps", "2", "--warm-steps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["models"]["convnet"]
    for variant in ("eager", "inductor"):
        d = rows[variant]
        assert "error" not in d, d
        assert d["step_ms"] > 0 and d["kernels_ms"] > 0
        assert sum(d["classes_ms"].values()) == pytest.approx(d["kernels_ms"], rel=1e-6)
        assert d["classes_ms"]["conv"] > 0  # a conv net's convolutions are found
    assert rows["inductor"]["classes_ms"]["fused"] > 0  # Inductor's generated code
    assert rows["eager"]["classes_ms"]["fused"] == 0
    assert 0 < rows["inductor"]["ceiling"]["rest_share"] < 1

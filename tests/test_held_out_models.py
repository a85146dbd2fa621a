"""benchmarks/held_out_models.py: architectures nothing in fusegraph was tuned or tested on
(transformers' configurations, random weights), trained in their tiny versions five float32
steps under eager and under ``torch.compile(backend="fusegraph")`` with every region
claimed, as bench_torch.py's quick mode checks its own five models: losses within 1e-4
relative, first-step gradients within 1e-3, eval outputs within 1e-4, more than half of
the compute nodes run by fusegraph. Their first run found a convolution converter that
refused EfficientNet's whole backward (tests/test_torch_aten_conv.py). The full-size
versions are checked to be the published architectures (parameter counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch benchmark needs torch")
pytest.importorskip("transformers", reason="the held-out models are transformers' architectures (the test extra installs it)")

from test_bench_torch import _load, _quick  # noqa: E402  (bench_torch.py's quick check, the same assertions)

PUBLISHED = {  # parameters of the published checkpoints of the same shape
    "hf-bert": 109_514_298,  # bert-base-uncased with its masked-LM head
    "hf-t5": 60_506_624,  # t5-small
    "hf-gpt-neox": 162_322_944,  # EleutherAI/pythia-160m
    "hf-convnext": 28_589_128,  # facebook/convnext-tiny-224
    "hf-swin": 28_288_354,  # microsoft/swin-tiny-patch4-window7-224
    "hf-efficientnet": 5_288_548,  # google/efficientnet-b0
    "hf-mobilenet-v2": 3_504_872,  # google/mobilenet_v2_1.0_224
}


@pytest.mark.slow
def test_the_held_out_models_agree_with_eager(tmp_path: Path) -> None:
    ho = _load("held_out_models")
    _quick(tmp_path, list(ho.HELD_OUT))


def test_full_size_held_out_models_are_the_published_architectures() -> None:
    ho = _load("held_out_models")
    tm = _load("torch_models")
    with torch.device("meta"):
        counts = {name: tm.parameters(ho.case(name, "full", batch=1).model) for name in PUBLISHED}
        qwen = ho.case("hf-qwen2", "full", batch=1).model.model.config
    assert counts == PUBLISHED
    # Qwen2-0.5B's layer, 8 of its 24 layers, a 32k vocabulary
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.num_hidden_layers) == (896, 4864, 14, 2, 8)

"""Held-out models: published architectures that nothing in fusegraph was tuned or tested
on, built from Hugging Face ``transformers`` configurations with random weights (no
download). The five models of torch_models.py are the set every earlier measurement and
fix looked at; what was tuned on them must hold on models nobody tried, so
bench_torch.py runs these under the same check and timing (``--models hf-bert,hf-swin``).

Each is the published shape unless its entry says otherwise (decoders cut to fewer layers
keep a cold compile within a device session's minutes); dropout and stochastic depth are
off, so eager and compiled runs draw no random numbers and their losses compare. ``tiny``
keeps each architecture's op pattern at a few thousand parameters, for the CPU.

``transformers`` is an optional dependency of the benchmarks only: without it these names
raise a ``ModuleNotFoundError`` that says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch_models as tm

HELD_OUT = ("hf-bert", "hf-t5", "hf-qwen2", "hf-gpt-neox", "hf-convnext", "hf-swin", "hf-efficientnet",
            "hf-mobilenet-v2", "hf-regnet")
VISION = ("hf-convnext", "hf-swin", "hf-efficientnet", "hf-mobilenet-v2", "hf-regnet")
DEFAULT_BATCH = {"hf-bert": 8, "hf-t5": 8, "hf-qwen2": 2, "hf-gpt-neox": 4, "hf-convnext": 64, "hf-swin": 32,
                 "hf-efficientnet": 64, "hf-mobilenet-v2": 64, "hf-regnet": 64}


class Logits(nn.Module):
    """A ``transformers`` model whose call returns its logits alone (a tensor, as the
    benchmark's loss and timing expect), inputs passed by keyword."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True))).logits  # type: ignore[no-any-return]


def _transformers() -> Any:
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the held-out models (hf-*) need Hugging Face transformers: "
                                  "pip install transformers") from exc
    return transformers


def _language(tf: Any, name: str, tiny: bool) -> tuple[nn.Module, int, int, str]:
    """A decoder or encoder language model, its vocabulary, sequence and description."""
    common = {"attn_implementation": "sdpa", "use_cache": False}
    if name == "hf-bert":
        cfg = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, attn_implementation="sdpa") if tiny else \
            tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        seq = 16 if tiny else 512
        return tf.BertForMaskedLM(cfg), cfg.vocab_size, seq, f"BERT-base masked LM, sequence {seq}"
    if name == "hf-qwen2":  # Qwen2-0.5B's layer (GQA 14/2, qkv bias, SwiGLU), 8 of its 24 layers, 32k vocabulary
        shape = dict(vocab_size=64, hidden_size=56, intermediate_size=96, num_hidden_layers=2, num_attention_heads=7,
                     num_key_value_heads=1) if tiny else \
            dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=8,
                 num_attention_heads=14, num_key_value_heads=2)
        cfg = tf.Qwen2Config(**shape, max_position_embeddings=2048, attention_dropout=0.0, **common)
        seq = 16 if tiny else 2048
        return tf.Qwen2ForCausalLM(cfg), cfg.vocab_size, seq, \
            f"Qwen2-0.5B-style decoder, {cfg.num_hidden_layers} layers, GQA {cfg.num_attention_heads}/{cfg.num_key_value_heads}, sequence {seq}"
    if name == "hf-gpt-neox":  # Pythia-160m: parallel attention and MLP, rotary on a quarter of each head
        shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64) if tiny else \
            dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072)
        cfg = tf.GPTNeoXConfig(**shape, rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True,
                               attention_dropout=0.0, hidden_dropout=0.0, **common)
        seq = 16 if tiny else 2048
        return tf.GPTNeoXForCausalLM(cfg), cfg.vocab_size, seq, f"Pythia-160m (GPT-NeoX), sequence {seq}"
    raise ValueError(name)


def _vision(tf: Any, name: str, tiny: bool) -> tuple[nn.Module, int, int, bool, str]:
    """An image classifier, its classes, image side, whether it runs channels-last, description."""
    # tiny: 64x64, so the last stage is 2x2: at 1x1 a training batch norm over a batch of 2
    # normalises two values to +-1 and every gradient before it vanishes (nothing checked)
    classes, image = (10, 64) if tiny else (1000, 224)
    if name == "hf-convnext":  # ConvNeXt-T
        cfg = tf.ConvNextConfig(num_stages=2, depths=[1, 1], hidden_sizes=[8, 16], num_labels=classes) if tiny else \
            tf.ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768], num_labels=classes)
        return tf.ConvNextForImageClassification(cfg), classes, image, True, "ConvNeXt-T"
    if name == "hf-swin":  # Swin-T
        cfg = tf.SwinConfig(image_size=image, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=8,
                            num_labels=classes) if tiny else \
            tf.SwinConfig(image_size=image, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                          window_size=7, num_labels=classes)
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = cfg.drop_path_rate = 0.0
        return tf.SwinForImageClassification(cfg), classes, image, False, "Swin-T"
    if name == "hf-efficientnet":  # EfficientNet-B0
        cfg = tf.EfficientNetConfig(image_size=image, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                                    num_labels=classes) if tiny else \
            tf.EfficientNetConfig(image_size=image, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280,
                                  num_labels=classes)  # the configuration's defaults are B7's
        cfg.dropout_rate = cfg.drop_connect_rate = 0.0
        return tf.EfficientNetForImageClassification(cfg), classes, image, True, "EfficientNet-B0"
    if name == "hf-mobilenet-v2":
        cfg = tf.MobileNetV2Config(image_size=image, depth_multiplier=0.25 if tiny else 1.0, num_labels=classes,
                                   classifier_dropout_prob=0.0)
        return tf.MobileNetV2ForImageClassification(cfg), classes, image, True, "MobileNetV2"
    if name == "hf-regnet":  # the configuration's default: RegNetY-4GF-like stages
        cfg = tf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                              num_labels=classes) if tiny else tf.RegNetConfig(num_labels=classes)
        return tf.RegNetForImageClassification(cfg), classes, image, True, "RegNet (Y, the config's default)"
    raise ValueError(name)


def _torch_init(model: nn.Module) -> nn.Module:
    """Every module that has a ``reset_parameters`` re-initialised as torch initialises it:
    ``transformers``' own initialisation of an untrained EfficientNet-B0 shrank the
    activations ~1e4-fold a block (1e-33 at its classifier), so no gradient reached its stem
    and a training check compared zeros."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return model


def case(name: str, size: str = "full", batch: int | None = None, seed: int = 0) -> tm.Case:
    """The held-out model ``name`` (one of HELD_OUT) as a torch_models.Case."""
    if name not in HELD_OUT:
        raise ValueError(f"unknown held-out model {name!r} (one of {', '.join(HELD_OUT)})")
    if size not in ("full", "tiny"):
        raise ValueError(f"size is 'full' or 'tiny', got {size!r}")
    tf = _transformers()
    tiny = size == "tiny"
    b = batch or ((4 if name in VISION else 2) if tiny else DEFAULT_BATCH[name])
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    suffix = f"{' (tiny)' if tiny else ''}, batch {b}"
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if name == "hf-t5":  # T5-small: encoder-decoder, relative position buckets, RMS-style layer norm
        shape = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4) if tiny else \
            dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)
        cfg = tf.T5Config(**shape, dropout_rate=0.0, feed_forward_proj="relu", use_cache=False)
        enc, dec = (16, 8) if tiny else (512, 128)
        ids = torch.randint(0, cfg.vocab_size, (b, enc), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (b, dec + 1), generator=g)
        model = Logits(tf.T5ForConditionalGeneration(cfg), ("input_ids", "decoder_input_ids"))
        return tm.Case(model, (ids, labels[:, :-1].contiguous()), labels[:, 1:].contiguous(), tm._token_loss, False,
                       f"T5-small{suffix}, encoder {enc}, decoder {dec}")
    if name in ("hf-bert", "hf-qwen2", "hf-gpt-neox"):
        lm, vocab, seq, describe = _language(tf, name, tiny)
        ids = torch.randint(0, vocab, (b, seq + 1), generator=g)
        loss = tm._token_loss
        return tm.Case(Logits(lm, ("input_ids",)), (ids[:, :-1].contiguous(),), ids[:, 1:].contiguous(), loss,
                       False, f"{describe}{suffix}")
    net, classes, image, channels_last, describe = _vision(tf, name, tiny)
    x = torch.randn(b, 3, image, image, generator=g)
    return tm.Case(Logits(_torch_init(net), ("pixel_values",)), (x,), torch.randint(0, classes, (b,), generator=g),
                   tm._class_loss, channels_last,
                   f"{describe}{suffix}, {image}x{image}{', channels-last' if channels_last else ''}")

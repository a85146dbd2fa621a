"""The model corpus of bench_onnx_gpu.py (issue 24 item 8): each model built with random
weights (torchvision / transformers configurations, no downloads; ``unet``, a diffusion-style
UNet, and ``block``, a tiny encoder block, defined here), and its export to ONNX. Apart from
the benchmark's timing and reporting so that tests and other scripts can build the same
models (``MODELS[name][1](batch)`` -> module, example inputs, input names; ``export``)
without reading the benchmark; bench_onnx_gpu re-exports these names.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_models import GPT, ConvNet  # bench_torch.py's conv net and decoder

Case = tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]  # module, example inputs, input names


# ---- models defined here ----------------------------------------------------------------------------
class Block(nn.Module):
    """A pre-norm transformer encoder block (layer norm, attention, GELU MLP)."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class UNet(nn.Module):
    """A diffusion-style UNet (GroupNorm + SiLU residual blocks, self-attention at the lowest
    resolution, skip connections), the timestep embedding folded in as a constant."""

    def __init__(self, ch: int = 64, levels: int = 3) -> None:
        super().__init__()
        self.inp = nn.Conv2d(4, ch, 3, padding=1)
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        widths = [ch * 2 ** i for i in range(levels)]
        for i, w in enumerate(widths):
            prev = widths[i - 1] if i else ch
            self.down.append(nn.ModuleList([self._res(prev, w), nn.Conv2d(w, w, 3, stride=2, padding=1)]))
        mid = widths[-1]
        self.mid_norm = nn.GroupNorm(32, mid)
        self.mid_attn = nn.MultiheadAttention(mid, 8, batch_first=True)
        for w in reversed(widths):
            self.up.append(nn.ModuleList([nn.ConvTranspose2d(mid, w, 4, stride=2, padding=1), self._res(2 * w, w)]))
            mid = w
        self.out = nn.Conv2d(ch, 4, 3, padding=1)
        self.register_buffer("temb", torch.randn(1, ch, 1, 1))

    @staticmethod
    def _res(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.GroupNorm(min(32, cin), cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1),
                             nn.GroupNorm(32, cout), nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.temb
        skips = []
        for res, down in self.down:  # type: ignore[misc]
            h = res(h)
            skips.append(h)
            h = down(h)
        b, c, hh, ww = h.shape
        t = self.mid_norm(h).flatten(2).transpose(1, 2)
        h = h + self.mid_attn(t, t, t, need_weights=False)[0].transpose(1, 2).reshape(b, c, hh, ww)
        for (up, res), skip in zip(self.up, reversed(skips), strict=True):  # type: ignore[misc]
            h = res(torch.cat([up(h), skip], dim=1))
        return self.out(F.silu(h))  # type: ignore[no-any-return]


class HFOut(nn.Module):
    """A transformers model returning one tensor (its first output), for export."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]  # type: ignore[no-any-return]


# ---- the corpus -------------------------------------------------------------------------------------
def _torchvision(name: str) -> Callable[[int], Case]:
    def make(batch: int) -> Case:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None)
        return model, (torch.randn(batch, 3, 224, 224),), ["pixels"]

    return make


def _hf(kind: str) -> Callable[[int], Case]:
    def make(batch: int) -> Case:
        import transformers as tf

        if kind == "bert":  # 6 layers at base width, sequence 128
            model: nn.Module = tf.BertModel(tf.BertConfig(num_hidden_layers=6))
            x = torch.randint(0, 30522, (batch, 128))
        elif kind == "whisper_encoder":  # speech: whisper-base's encoder over 30 s of log-mel frames
            cfg = tf.WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                                   decoder_attention_heads=8, decoder_layers=1)  # the decoder is built too: its heads must divide d_model
            model = tf.WhisperModel(cfg).get_encoder()
            x = torch.randn(batch, cfg.num_mel_bins, 3000)
        elif kind == "distilbert":
            model = tf.DistilBertModel(tf.DistilBertConfig())
            x = torch.randint(0, 30522, (batch, 128))
        else:
            raise ValueError(kind)
        return HFOut(model), (x,), ["input"]

    return make


def _decoder(batch: int) -> Case:
    """GPT-2 small's block at 6 layers, sequence 128 (learned positions, pre-norm, causal
    attention, tanh GELU, the head tied to the embedding): bench_torch.py's decoder, since
    transformers' GPT-2 does not export at opset 17 with the TorchScript exporter under
    torch 2.11-2.13 (its masking code: `aten::diff` unsupported, or `unordered_map::at`)."""
    return GPT(768, 12, 6, 50257, ctx=128), (torch.randint(0, 50257, (batch, 128)),), ["input"]


def _local(cls: type[nn.Module], shape: tuple[int, ...]) -> Callable[[int], Case]:
    return lambda batch: (cls(), (torch.randn(batch, *shape),), ["x"])


MODELS: dict[str, tuple[str, Callable[[int], Case]]] = {
    "resnet50": ("cnn", _torchvision("resnet50")),
    "mobilenet_v3_large": ("cnn", _torchvision("mobilenet_v3_large")),
    "efficientnet_b0": ("cnn", _torchvision("efficientnet_b0")),
    "convnext_tiny": ("cnn", _torchvision("convnext_tiny")),
    "regnet_y_1_6gf": ("cnn", _torchvision("regnet_y_1_6gf")),
    "densenet121": ("cnn", _torchvision("densenet121")),
    "vit_b_16": ("vision transformer", _torchvision("vit_b_16")),
    "swin_t": ("vision transformer", _torchvision("swin_t")),
    "bert": ("encoder", _hf("bert")),
    "distilbert": ("encoder", _hf("distilbert")),
    "gpt2": ("decoder", _decoder),
    "whisper_encoder": ("speech encoder", _hf("whisper_encoder")),
    "unet": ("diffusion unet", _local(UNet, (4, 64, 64))),
    # small, defined here: the --quick smoke run
    "convnet": ("cnn (tiny)", _local(ConvNet, (3, 32, 32))),
    "block": ("encoder (tiny)", _local(Block, (16, 64))),
}
DEFAULT = [m for m in MODELS if m not in ("convnet", "block")]
ATTENTION = {"vit_b_16", "swin_t", "bert", "distilbert", "gpt2", "whisper_encoder"}


def export(module: nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str], path: Path) -> None:
    """``torch.onnx.export`` at opset 17 (the TorchScript exporter where this torch has both)."""
    kwargs: dict[str, Any] = {"input_names": names, "output_names": ["out"], "opset_version": 17,
                              "do_constant_folding": True}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False
    # nn.MultiheadAttention's inference fast path (_native_multi_head_attention, taken under
    # no_grad on CUDA) has no ONNX export: exported as its composite ops, timed with it on
    fast = torch.backends.mha.get_fastpath_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            torch.onnx.export(module, inputs, str(path), **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)


def _no_zero_parameters(module: nn.Module) -> None:
    """Random values in place of all-zero parameters (torchvision's ViT zero-initializes its
    classifier head: every output 0, an agreement check of 0 that checked nothing)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() and not p.any():
                p.normal_(0.0, 0.02)


__all__ = ["ATTENTION", "DEFAULT", "MODELS", "Block", "Case", "HFOut", "UNet", "export"]

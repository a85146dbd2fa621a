"""The PyTorch models the benchmarks train and run (benchmarks/bench_torch.py,
bench_torch_ddp.py, bench_onnx_gpu.py's small ConvNet), written here in plain torch with
random weights so that nothing is downloaded and the same code runs at full size on a GPU
and in a tiny version on the CPU (the CI's agreement check exercises the same ATen patterns
the GPU runs).

The full-size models are the published architectures: ``resnet50`` and ``vit_b_16`` have
torchvision's module structure and parameter counts (25,557,032 and 86,567,656), ``gpt2``
is GPT-2 small (124,439,808 parameters, tied head), ``llama`` an 8-layer Llama-style
decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU), and ``unet`` one
level of Stable Diffusion's UNet (a resnet block with GroupNorm + SiLU + conv and the
timestep embedding, then a transformer block: self-attention, cross-attention to a text
context, a GEGLU feed-forward).

``case(name, size, batch)`` gives a model, its example inputs, a training target and the
loss to train it with; ``size`` is "full" (the benchmark's shapes) or "tiny" (seconds on
a CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):
    """conv + bias + ReLU blocks with residual adds, global pooling, a linear head."""

    def __init__(self, width: int = 32, blocks: int = 3, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, stride=2)
        self.blocks = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for conv in self.blocks:
            x = F.relu(conv(x)) + x
        return self.head(x.mean((2, 3)))  # type: ignore[no-any-return]


# ---- ResNet-50 ---------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 expand, each with
    batch norm; the shortcut projected where the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        stages: list[nn.Module] = []
        cin = base
        for i, n in enumerate(layers):
            width = base * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # type: ignore[no-any-return]


# ---- ViT-B/16 ----------------------------------------------------------------------------------
class EncoderBlock(nn.Module):
    """Pre-norm: layer norm, nn.MultiheadAttention (as torchvision's ViT), layer norm, GELU MLP."""

    def __init__(self, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, mlp), nn.GELU(), nn.Linear(mlp, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class ViT(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, d: int = 768, layers: int = 12, heads: int = 12,
                 mlp: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.layers = nn.Sequential(*(EncoderBlock(d, heads, mlp) for _ in range(layers)))
        self.ln = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])  # type: ignore[no-any-return]


# ---- GPT-2 small -------------------------------------------------------------------------------
class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """GPT-2: learned positions, pre-norm blocks, causal attention, tanh-GELU MLP, the
    output head tied to the token embedding. ``blocks`` is what FSDP shards one by one."""

    def __init__(self, d: int = 768, heads: int = 12, layers: int = 12, vocab: int = 50257, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


# ---- Llama-style decoder -----------------------------------------------------------------------
def rotary(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (seq, head_dim), halves repeated (the rotate-half convention)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        y = self.attention_norm(x)
        q = self.wq(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))  # type: ignore[no-any-return]


class Llama(nn.Module):
    cos: torch.Tensor  # buffers: the rotary tables
    sin: torch.Tensor

    def __init__(self, d: int = 2048, layers: int = 8, heads: int = 32, kv_heads: int = 8, ffn: int = 5632,
                 vocab: int = 32000, ctx: int = 2048) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.output = nn.Linear(d, vocab, bias=False)
        cos, sin = rotary(ctx, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # type: ignore[no-any-return]


# ---- a diffusion UNet block --------------------------------------------------------------------
class ResnetBlock(nn.Module):
    """GroupNorm + SiLU + 3x3 conv, the timestep embedding added per channel, again, residual."""

    def __init__(self, c: int, temb: int, groups: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(groups, c, eps=1e-5), nn.GroupNorm(groups, c, eps=1e-5)
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, c)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))  # type: ignore[no-any-return]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, context: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k = nn.Linear(context or d, d, bias=False)
        self.to_v = nn.Linear(context or d, d, bias=False)
        self.to_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        ctx = x if context is None else context
        b, s, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(ctx)), split(self.to_v(ctx)))
        return self.to_out(a.transpose(1, 2).reshape(b, s, d))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    """GroupNorm, project in, [layer norm, self-attention] [layer norm, cross-attention to
    the context] [layer norm, GEGLU feed-forward], project out, residual."""

    def __init__(self, c: int, heads: int, context: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.proj_in, self.proj_out = nn.Linear(c, c), nn.Linear(c, c)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(c), nn.LayerNorm(c), nn.LayerNorm(c)
        self.attn1, self.attn2 = Attention(c, heads), Attention(c, heads, context)
        self.ff_in, self.ff_out = nn.Linear(c, 8 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        t = t + self.attn1(self.norm1(t))
        t = t + self.attn2(self.norm2(t), context)
        a, gate = self.ff_in(self.norm3(t)).chunk(2, dim=-1)
        t = t + self.ff_out(a * F.gelu(gate))
        return x + self.proj_out(t).transpose(1, 2).reshape(b, c, h, w)  # type: ignore[no-any-return]


class UNetBlock(nn.Module):
    def __init__(self, c: int = 640, temb: int = 1280, heads: int = 8, context: int = 768, groups: int = 32) -> None:
        super().__init__()
        self.resnet = ResnetBlock(c, temb, groups)
        self.transformer = TransformerBlock(c, heads, context, groups)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.resnet(x, temb), context)  # type: ignore[no-any-return]


# ---- cases -------------------------------------------------------------------------------------
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


def _class_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), target)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


@dataclass
class Case:
    """A model with random weights, its example inputs (CPU, float32), the training target
    and the loss; ``channels_last``: the model and its image input go channels-last."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss: Loss
    channels_last: bool = False
    describe: str = ""

    def on(self, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
        """The model, its inputs and the target on ``device`` (channels-last where the case is)."""
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        model = self.model.to(device, memory_format=fmt)
        inputs = tuple(x.to(device, memory_format=fmt) if (self.channels_last and x.dim() == 4) else x.to(device)
                       for x in self.inputs)
        return model, inputs, self.target.to(device)


MODELS = ("resnet50", "vit_b_16", "gpt2", "llama", "unet", "convnet")
DEFAULT_BATCH = {"resnet50": 64, "vit_b_16": 32, "gpt2": 8, "llama": 2, "unet": 8, "convnet": 64}


def case(name: str, size: str = "full", batch: int | None = None, seed: int = 0) -> Case:
    """The model ``name`` at ``size`` ("full" or "tiny"), ``batch`` examples (default: the
    benchmark's, 2 when tiny), weights and data from ``seed``."""
    if name.startswith("hf-"):  # the held-out set (held_out_models.py), which imports this module
        import held_out_models

        return held_out_models.case(name, size, batch, seed)
    if size not in ("full", "tiny"):
        raise ValueError(f"size is 'full' or 'tiny', got {size!r}")
    tiny = size == "tiny"
    b = batch or (2 if tiny else DEFAULT_BATCH.get(name, 1))
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "resnet50":
        hw, classes = (64, 10) if tiny else (224, 1000)
        rn = ResNet((1, 1, 1, 1), 8, classes) if tiny else ResNet()
        x = torch.randn(b, 3, hw, hw, generator=g)
        return Case(rn, (x,), torch.randint(0, classes, (b,), generator=g), _class_loss, True,
                    f"ResNet-50{' (tiny)' if tiny else ''}, batch {b}, {hw}x{hw}, channels-last")
    if name == "vit_b_16":
        image, classes = (32, 10) if tiny else (224, 1000)
        vit = ViT(32, 8, 32, 2, 4, 64, 10) if tiny else ViT()
        x = torch.randn(b, 3, image, image, generator=g)
        return Case(vit, (x,), torch.randint(0, classes, (b,), generator=g), _class_loss, False,
                    f"ViT-B/16{' (tiny)' if tiny else ''}, batch {b}, {image}x{image}")
    if name == "gpt2":
        d, heads, layers, vocab, s = (32, 4, 2, 64, 16) if tiny else (768, 12, 12, 50257, 1024)
        gpt = GPT(d, heads, layers, vocab, ctx=s)
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        return Case(gpt, (ids[:, :-1],), ids[:, 1:].contiguous(), _token_loss, False,
                    f"GPT-2 small{' (tiny)' if tiny else ''}, batch {b}, sequence {s}")
    if name == "llama":
        d, layers, heads, kv, ffn, vocab, s = (64, 2, 4, 2, 128, 64, 16) if tiny else (2048, 8, 32, 8, 5632, 32000, 2048)
        llama = Llama(d, layers, heads, kv, ffn, vocab, ctx=s)
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        return Case(llama, (ids[:, :-1],), ids[:, 1:].contiguous(), _token_loss, False,
                    f"Llama-style{' (tiny)' if tiny else ''} {layers} layers, h {d}, GQA {heads}/{kv}, batch {b}, sequence {s}")
    if name == "unet":
        c, temb, heads, ctx, groups, hw, tokens = (32, 16, 2, 16, 8, 8, 4) if tiny else (640, 1280, 8, 768, 32, 32, 77)
        unet = UNetBlock(c, temb, heads, ctx, groups)
        x = torch.randn(b, c, hw, hw, generator=g)
        inputs = (x, torch.randn(b, temb, generator=g), torch.randn(b, tokens, ctx, generator=g))
        return Case(unet, inputs, torch.randn(b, c, hw, hw, generator=g), _mse, False,
                    f"UNet block{' (tiny)' if tiny else ''} (resnet + transformer, c {c}, {hw}x{hw}, context {tokens}x{ctx}), batch {b}")
    if name == "convnet":
        width, blocks, classes, hw = (16, 2, 10, 16) if tiny else (64, 4, 1000, 112)
        net = ConvNet(width, blocks, classes)
        x = torch.randn(b, 3, hw, hw, generator=g)
        return Case(net, (x,), torch.randint(0, classes, (b,), generator=g), _class_loss, True,
                    f"conv net{' (tiny)' if tiny else ''} (conv + bias + ReLU), batch {b}, {hw}x{hw}, channels-last")
    raise ValueError(f"unknown model {name!r} (one of {', '.join(MODELS)})")


def parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())



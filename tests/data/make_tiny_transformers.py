"""Regenerates the tiny transformer exports under tests/data/ (random weights, static shapes).

    python tests/data/make_tiny_transformers.py

Needs torch and transformers (not test dependencies: the tests read the committed files).
Each model is built from a transformers config with a fixed seed and exported with
``torch.onnx.export(..., opset_version=17, dynamo=False)``; the feed is stored beside it
(``<name>.npz``), so tests compare against ONNX Runtime on the same inputs.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent
SEQ = 16


def _bert() -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers as tr

    # over 64 positions: onnx.reference's GatherElements (token-type ids) goes through np.choose,
    # which takes at most 64 choices (NumPy 2), and its fallback is wrong
    seq = 80
    cfg = tr.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=seq)
    ids = torch.randint(0, 128, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.int64)
    mask[0, seq - 3:] = 0
    return tr.BertModel(cfg), {"input_ids": ids, "attention_mask": mask}


def _gpt2() -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers as tr

    cfg = tr.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2, n_positions=32, n_inner=128,
                         bos_token_id=0, eos_token_id=0)
    return tr.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 128, (1, SEQ))}


def _llama() -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")
    return tr.LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 128, (1, SEQ))}


def _tv_swin() -> tuple[Any, dict[str, Any]]:
    """torchvision's Swin (shifted windows, padding to whole windows): its export computes
    every shape at run time, a deep chain of Shape/Gather/Concat per block."""
    import torch
    from torchvision.models.swin_transformer import SwinTransformer

    model = SwinTransformer(patch_size=[4, 4], embed_dim=4, depths=[2, 2, 2, 2], num_heads=[1, 1, 1, 2],
                            window_size=[4, 4], num_classes=10)
    return model, {"x": torch.randn(1, 3, 64, 64)}


MODELS: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "tiny_bert": _bert, "tiny_gpt2": _gpt2, "tiny_llama": _llama, "tiny_tv_swin": _tv_swin,
}


class _First:
    """Wraps a transformers model so that the export has one output, its first."""

    def __new__(cls, model: Any) -> Any:
        import torch

        class Wrap(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *args: Any) -> Any:
                if "use_cache" in model.forward.__code__.co_varnames:
                    return self.model(*args, use_cache=False)[0]
                out = self.model(*args)
                return out if isinstance(out, torch.Tensor) else out[0]

        return Wrap()


def _torchvision_without_cxx_ops() -> None:
    """transformers imports torchvision where installed; a torchvision wheel built for another
    torch fails on its C++ ops' registrations (``torchvision::nms does not exist``), which
    these models never use: the registrations are skipped."""
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    except ImportError:
        pass


def export(name: str) -> Path:
    import torch

    _torchvision_without_cxx_ops()

    torch.manual_seed(0)
    model, feed = MODELS[name]()
    model.eval()
    wrapped = _First(model)
    path = HERE / f"{name}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapped, tuple(feed.values()), str(path), input_names=list(feed),
                          output_names=["output"], opset_version=17, dynamo=False)
    np.savez(HERE / f"{name}.npz", **{k: v.numpy() for k, v in feed.items()})
    return path


if __name__ == "__main__":
    for n in sys.argv[1:] or MODELS:
        p = export(n)
        print(f"{p.name}: {p.stat().st_size / 1024:.0f} KiB")

"""A corpus of real architectures (random weights) through fusegraph's ONNX provider, side by
side with ONNX Runtime alone and PyTorch eager.

Each model is built from its library's definition with random weights (torchvision, timm,
transformers configs, torch.nn), exported once with ``torch.onnx.export`` (opset 17) and
cached under ``<cache>/bench-models/`` (the fusegraph cache directory unless
``--export-dir``), then run in a process of its own (one model cannot take the others
down; memory is measured per model):

* agreement: the relative error of every output of fusegraph against ONNX Runtime, and of
  ONNX Runtime against eager PyTorch on the same input;
* coverage: the share of non-constant nodes fusegraph runs (after the floor);
* latency: fusegraph / ONNX Runtime and fusegraph / eager, timed as
  ``benchmarks/bench_onnx.py`` does (ONNX Runtime in a worker process, alternating blocks
  each alone after a pause and a time-based warm-up, median; ORT at the faster of its
  default and no-spin configurations), with eager PyTorch as a fourth block;
* setup: fusegraph session creation + first run with an empty cache directory (cold) and
  again with the cache it left (warm), against ONNX Runtime's;
* peak memory: resident-set growth over the warm session's creation + first run, against
  ONNX Runtime's (fusegraph.onnx.memory); it follows the cold session in the same process,
  whose freed memory it may reuse, so it reads low -- the cold session's own growth
  (``cold_mib``, engines' libraries loaded included) reads high.

    python benchmarks/bench_models.py                      # the whole corpus
    python benchmarks/bench_models.py --models resnet18,bert --repeat 20
    python benchmarks/bench_models.py --short              # CI: a few small torch.nn models
    python benchmarks/bench_models.py --list

Writes ``--json`` (default bench_models.json) and ``--png`` (a chart; needs matplotlib, the
``bench`` extra). Needs torch; torchvision, timm and transformers for their models (models of
a missing library are reported as skipped, with the reason). On machines where the PyPI
torchvision wheel was built for another torch build, its C++ ops do not load (``operator
torchvision::nms does not exist``); the model definitions are pure Python, so the import
here goes on without the C++ ops' fake registrations (detection ops are not used).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

Built = tuple[Any, tuple[Any, ...], list[str]]  # (module, example inputs, input names)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    family: str  # cnn, mobile, transformer, vision-transformer, segmentation, recurrent, ...
    source: str  # torchvision, timm, transformers, torch.nn
    build: Callable[[], Built]
    short: bool = False  # in --short (CI): small, torch.nn only


# ---- model builders ----------------------------------------------------------------------------
def import_torchvision() -> Any:
    """torchvision's models, also where its C++ ops were built for another torch (see the
    module docstring): the fake-tensor registrations of those ops are skipped."""
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def _image(size: int = 224) -> tuple[Any, ...]:
    import torch

    return (torch.randn(1, 3, size, size),)


def tv(name: str, size: int = 224, **kw: Any) -> Callable[[], Built]:
    def build() -> Built:
        tvm = import_torchvision().models
        m = tvm.get_model(name, weights=None, **kw)
        return _Out(m), _image(size), ["input"]

    return build


def timm_model(name: str, size: int = 224) -> Callable[[], Built]:
    def build() -> Built:
        import_torchvision()  # timm imports torchvision
        import timm

        return timm.create_model(name, pretrained=False), _image(size), ["input"]

    return build


def hf(config: str, model: str, seq: int = 128, output: str = "last_hidden_state", image: int = 0,
       **cfg: Any) -> Callable[[], Built]:
    """A transformers model from its config (small: 4 layers, hidden 256 unless given)."""

    def build() -> Built:
        import torch

        import_torchvision()  # transformers' model modules import it
        import transformers

        conf = getattr(transformers, config)(**cfg)
        with _quiet():
            conf._attn_implementation = "eager"
        m = getattr(transformers, model)(conf)
        if image:
            return _HfOut(m, output, "pixel_values"), _image(image), ["pixel_values"]
        vocab = int(getattr(conf, "vocab_size", 1000))
        ids = torch.randint(0, vocab, (1, seq))
        return _HfOut(m, output, "input_ids"), (ids,), ["input_ids"]

    return build


class _quiet:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> bool:
        return True  # attribute names moved between transformers versions: best effort


def _Out(m: Any) -> Any:
    """The module's main tensor output (segmentation models return dicts, GoogLeNet tuples)."""
    import torch

    class Main(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Any) -> Any:
            y = self.m(x)
            if isinstance(y, dict):
                return y["out"]
            if isinstance(y, tuple):
                return y[0]
            return y

    return Main()


def _HfOut(m: Any, output: str, arg: str) -> Any:
    import torch

    class Main(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Any) -> Any:
            return getattr(self.m(**{arg: x}), output)

    return Main()


def nn_model(kind: str, **kw: Any) -> Callable[[], Built]:
    def build() -> Built:
        import torch

        m = _NN[kind](**kw)
        if kind in ("lstm", "gru"):
            return m, (torch.randint(0, m.vocab, (1, kw.get("seq", 64))),), ["tokens"]
        if kind == "encoder":
            return m, (torch.randn(1, kw.get("seq", 64), kw.get("d", 128)),), ["x"]
        return m, _image(kw.get("size", 224)), ["input"]

    return build


def _tagger(cell: str, vocab: int = 1000, d: int = 128, hidden: int = 256, tags: int = 20, seq: int = 64) -> Any:
    import torch

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vocab = vocab
            self.emb = torch.nn.Embedding(vocab, d)
            rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
            self.rnn = rnn(d, hidden, num_layers=2, batch_first=True, bidirectional=True)
            self.out = torch.nn.Linear(2 * hidden, tags)

        def forward(self, tokens: Any) -> Any:
            return self.out(self.rnn(self.emb(tokens))[0])

    return Tagger()


def _encoder(d: int = 128, heads: int = 4, layers: int = 2, seq: int = 64) -> Any:
    import torch

    layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, activation="gelu")
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _se_mobile(size: int = 64, width: int = 16) -> Any:
    """A small mobile block stack: depthwise-separable convs, squeeze-excite, hard-swish."""
    import torch
    from torch import nn

    class SE(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

        def forward(self, x: Any) -> Any:
            s = x.mean((2, 3), keepdim=True)
            return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))

    def block(cin: int, cout: int, stride: int) -> nn.Module:
        mid = cin * 4
        return nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
            SE(mid), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )

    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 2, 1), nn.BatchNorm2d(w), nn.Hardswish(),
        block(w, w, 1), block(w, 2 * w, 2), block(2 * w, 2 * w, 1), block(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10),
    )


_NN: dict[str, Callable[..., Any]] = {
    "lstm": lambda **kw: _tagger("lstm", **kw),
    "gru": lambda **kw: _tagger("gru", **kw),
    "encoder": _encoder,
    "se_mobile": _se_mobile,
}

_BERT = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
_DEC = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 768,
        "vocab_size": 8000}

CORPUS: list[Spec] = [
    # torch.nn (the --short set: small enough for CI)
    Spec("nn_se_mobile", "mobile", "torch.nn", nn_model("se_mobile", size=64), short=True),
    Spec("nn_encoder", "transformer", "torch.nn", nn_model("encoder", seq=32, d=64, layers=2), short=True),
    Spec("nn_lstm_tagger_small", "recurrent", "torch.nn", nn_model("lstm", seq=16, d=32, hidden=32), short=True),
    Spec("nn_lstm_tagger", "recurrent", "torch.nn", nn_model("lstm")),
    Spec("nn_gru_tagger", "recurrent", "torch.nn", nn_model("gru")),
    Spec("nn_encoder_256", "transformer", "torch.nn", nn_model("encoder", seq=128, d=256, layers=4)),
    # torchvision
    Spec("alexnet", "cnn", "torchvision", tv("alexnet")),
    Spec("resnet18", "cnn", "torchvision", tv("resnet18")),
    Spec("resnet50", "cnn", "torchvision", tv("resnet50")),
    Spec("resnext50_32x4d", "cnn", "torchvision", tv("resnext50_32x4d")),
    Spec("densenet121", "cnn", "torchvision", tv("densenet121")),
    Spec("googlenet", "cnn", "torchvision", tv("googlenet", aux_logits=False, init_weights=True)),
    Spec("inception_v3", "cnn", "torchvision", tv("inception_v3", 299, aux_logits=False, init_weights=True)),
    Spec("vgg11_bn", "cnn", "torchvision", tv("vgg11_bn")),
    Spec("squeezenet1_1", "cnn", "torchvision", tv("squeezenet1_1")),
    Spec("shufflenet_v2_x1_0", "mobile", "torchvision", tv("shufflenet_v2_x1_0")),
    Spec("mobilenet_v2", "mobile", "torchvision", tv("mobilenet_v2")),
    Spec("mobilenet_v3_small", "mobile", "torchvision", tv("mobilenet_v3_small")),
    Spec("mobilenet_v3_large", "mobile", "torchvision", tv("mobilenet_v3_large")),
    Spec("mnasnet1_0", "mobile", "torchvision", tv("mnasnet1_0")),
    Spec("efficientnet_b0", "mobile", "torchvision", tv("efficientnet_b0")),
    Spec("efficientnet_v2_s", "mobile", "torchvision", tv("efficientnet_v2_s", 224)),
    Spec("regnet_x_400mf", "cnn", "torchvision", tv("regnet_x_400mf")),
    Spec("regnet_y_400mf", "cnn", "torchvision", tv("regnet_y_400mf")),
    Spec("convnext_tiny", "cnn", "torchvision", tv("convnext_tiny")),
    Spec("swin_t", "vision-transformer", "torchvision", tv("swin_t")),
    Spec("vit_b_16", "vision-transformer", "torchvision", tv("vit_b_16")),
    Spec("maxvit_t", "vision-transformer", "torchvision", tv("maxvit_t")),
    Spec("deeplabv3_mobilenet_v3_large", "segmentation", "torchvision",
         tv("deeplabv3_mobilenet_v3_large", weights_backbone=None, aux_loss=False)),
    Spec("lraspp_mobilenet_v3_large", "segmentation", "torchvision",
         tv("lraspp_mobilenet_v3_large", weights_backbone=None)),
    # timm
    Spec("timm_vit_tiny", "vision-transformer", "timm", timm_model("vit_tiny_patch16_224")),
    Spec("timm_levit_128s", "vision-transformer", "timm", timm_model("levit_128s")),
    Spec("timm_mobilevit_xxs", "mobile", "timm", timm_model("mobilevit_xxs", 256)),
    Spec("timm_convnext_atto", "cnn", "timm", timm_model("convnext_atto")),
    Spec("timm_poolformer_s12", "vision-transformer", "timm", timm_model("poolformer_s12")),
    Spec("timm_ghostnet_100", "mobile", "timm", timm_model("ghostnet_100")),
    Spec("timm_lcnet_050", "mobile", "timm", timm_model("lcnet_050")),
    Spec("timm_rexnet_100", "mobile", "timm", timm_model("rexnet_100")),
    Spec("timm_pvt_v2_b0", "vision-transformer", "timm", timm_model("pvt_v2_b0")),
    Spec("timm_edgenext_xx_small", "mobile", "timm", timm_model("edgenext_xx_small", 256)),
    Spec("timm_mixer_s16", "vision-transformer", "timm", timm_model("mixer_s16_224")),
    Spec("timm_dla34", "cnn", "timm", timm_model("dla34")),
    Spec("timm_resnet18d", "cnn", "timm", timm_model("resnet18d")),
    Spec("timm_tinynet_e", "mobile", "timm", timm_model("tinynet_e", 106)),
    # transformers (from configs)
    Spec("hf_bert", "encoder", "transformers", hf("BertConfig", "BertModel", **_BERT)),
    Spec("hf_distilbert", "encoder", "transformers",
         hf("DistilBertConfig", "DistilBertModel", dim=256, n_layers=4, n_heads=4, hidden_dim=1024)),
    Spec("hf_albert", "encoder", "transformers",
         hf("AlbertConfig", "AlbertModel", embedding_size=128, **_BERT)),
    Spec("hf_roberta", "encoder", "transformers", hf("RobertaConfig", "RobertaModel", **_BERT)),
    Spec("hf_gpt2", "decoder", "transformers",
         hf("GPT2Config", "GPT2LMHeadModel", output="logits", n_embd=256, n_layer=4, n_head=4, vocab_size=8000)),
    Spec("hf_llama", "decoder", "transformers",
         hf("LlamaConfig", "LlamaForCausalLM", output="logits", num_key_value_heads=2, **_DEC)),
    Spec("hf_qwen2", "decoder", "transformers",
         hf("Qwen2Config", "Qwen2ForCausalLM", output="logits", num_key_value_heads=2, **_DEC)),
    Spec("hf_gpt_neox", "decoder", "transformers", hf("GPTNeoXConfig", "GPTNeoXForCausalLM", output="logits", **_DEC)),
    Spec("hf_opt", "decoder", "transformers",
         hf("OPTConfig", "OPTForCausalLM", output="logits", hidden_size=256, num_hidden_layers=4,
            num_attention_heads=4, ffn_dim=1024, word_embed_proj_dim=256, vocab_size=8000)),
    Spec("hf_t5_encoder", "encoder", "transformers",
         hf("T5Config", "T5EncoderModel", d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_heads=4, vocab_size=8000)),
    Spec("hf_vit", "vision-transformer", "transformers",
         hf("ViTConfig", "ViTModel", image=224, **_BERT)),
    Spec("hf_swin", "vision-transformer", "transformers",
         hf("SwinConfig", "SwinModel", image=224, embed_dim=48, depths=[2, 2, 2, 2], num_heads=[2, 4, 8, 16])),
    Spec("hf_convnext", "cnn", "transformers",
         hf("ConvNextConfig", "ConvNextModel", image=224, hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 4, 2])),
    Spec("hf_segformer", "segmentation", "transformers",
         hf("SegformerConfig", "SegformerForSemanticSegmentation", image=256, output="logits")),
    Spec("hf_mobilevit", "mobile", "transformers",
         hf("MobileViTConfig", "MobileViTModel", image=256)),
]
BY_NAME = {s.name: s for s in CORPUS}


# ---- export cache -----------------------------------------------------------------------------
def export_dir(args: argparse.Namespace) -> Path:
    if args.export_dir:
        return Path(args.export_dir)
    from fusegraph.runtime.cache_dir import cache_root

    return cache_root() / "bench-models"


def exported(spec: Spec, root: Path, seed: int) -> tuple[Path, Any, dict[str, np.ndarray]]:
    """(the ONNX file, the eager module, the feed): exported once per spec, seed and torch version."""
    import torch

    torch.backends.mha.set_fastpath_enabled(False)  # torch.nn's fused attention fast path does not export
    torch.manual_seed(seed)
    module, inputs, names = spec.build()
    module.eval()
    feed = {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
    tag = hashlib.sha256(f"{spec.name}|{seed}|{torch.__version__}|v1".encode()).hexdigest()[:12]
    path = root / f"{spec.name}-{tag}.onnx"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.onnx")
        import warnings

        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, inputs, str(tmp), input_names=names, output_names=["output"],
                              opset_version=17, dynamo=False)
        os.replace(tmp, path)
    return path, module, feed


# ---- one model, in its own process -------------------------------------------------------------
def _rel(got: Any, want: Any) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if g.shape != w.shape or not np.array_equal(np.isnan(g), np.isnan(w)):
        return math.inf
    ok = ~np.isnan(w)
    return float(np.linalg.norm(g[ok] - w[ok]) / max(float(np.linalg.norm(w[ok])), 1e-30))


def _cpu_paths(report: Any) -> list[str]:
    """Which CPU path the torch engine's units took (kept or handed back), from the report's notes."""
    import re

    texts = [s.note or "" for s in report.subgraphs] + [u.reason or "" for u in report.unclaimed]
    return sorted({m for t in texts for m in re.findall(r"CPU path: (\w+)", t)})


def _runs_on(report: Any) -> str:
    """What runs the model: a whole-model runner the floor chose (openvino, ort-nospin),
    onnxruntime (the caller's session, whole), or fusegraph (its plan: fusegraph units
    and ONNX Runtime sub-sessions)."""
    kinds = {s.kind for s in report.subgraphs}
    if len(report.subgraphs) == 1 and not kinds & {"fusegraph", "iree-onnx"}:
        return str(report.subgraphs[0].kind)
    return "fusegraph" if "fusegraph" in kinds else "onnxruntime"


def bench_one(spec: Spec, args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort
    import torch
    from bench_onnx import PAUSE_S, ROUNDS, OrtWorker, _OthersCpu, _time, _warm

    import fusegraph.onnx as fgo
    from fusegraph.onnx.memory import measure_peak

    ort.set_default_logger_severity(3)
    t0 = time.perf_counter()
    path, module, feed = exported(spec, export_dir(args), args.seed)
    row: dict[str, Any] = {"model": spec.name, "family": spec.family, "source": spec.source,
                           "prepare_s": time.perf_counter() - t0}
    with torch.inference_mode():
        eager_out = module(*[torch.from_numpy(v) for v in feed.values()])
    eager = eager_out.numpy()

    opts: dict[str, Any] = {}
    if args.engine:
        opts["engine"] = args.engine
    if args.floor:
        opts["floor"] = args.floor
    worker = OrtWorker()
    try:
        with tempfile.TemporaryDirectory(prefix="fusegraph-models-") as tmp:
            cache = args.cache_dir or str(Path(tmp) / "cache")
            gc.collect()
            t0 = time.perf_counter()
            with measure_peak() as cold_mem:  # includes loading the engines' libraries (torch)
                sess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {**opts, "cache_dir": cache})])
                got = sess.run(None, feed)
            cold_s = time.perf_counter() - t0
            # floor_mode=background: the cold session ran ONNX Runtime while a child measured
            # fusegraph's plan; the warm session below decides from that verdict.
            sess.wait_for_evaluation(timeout=args.timeout)
            evaluation_s = time.perf_counter() - t0
            del sess, got
            gc.collect()
            t0 = time.perf_counter()
            with measure_peak() as mem:
                sess = fgo.InferenceSession(str(path), providers=[(fgo.PROVIDER, {**opts, "cache_dir": cache})])
                got = sess.run(None, feed)
            warm_s = time.perf_counter() - t0
            want, ort_setup_s, ort_bytes = worker.load(str(path), feed)
            report = sess.partition_report()
            row.update({
                "rel_err": _rel(got[0], want[0]),
                "ort_vs_eager": _rel(want[0], eager),
                "fusegraph_vs_eager": _rel(got[0], eager),
                "coverage": report.coverage,
                "fusegraph_nodes": report.fusegraph_nodes,
                "nodes": report.running_nodes,
                "units": len(report.subgraphs),
                "fusegraph_units": sum(s.kind == "fusegraph" for s in report.subgraphs),
                "engines": sorted({s.engine.split("[")[0] for s in report.subgraphs if s.kind == "fusegraph"}),
                "boundary_copies": report.boundaries.copies,
                "cpu_paths": _cpu_paths(report),
                "runs_on": _runs_on(report),
                "runners": list(report.runners),
                "floor": report.floor,
                "setup_cold_s": cold_s, "setup_warm_s": warm_s, "ort_setup_s": ort_setup_s,
                "evaluation_s": evaluation_s,
                "mib": mem.bytes / 2**20, "ort_mib": ort_bytes / 2**20, "cold_mib": cold_mem.bytes / 2**20,
            })
            if args.agreement_only:
                return row
            eager_feed = [torch.from_numpy(v) for v in feed.values()]

            def eager_run(_: Any, __: Any) -> Any:
                with torch.inference_mode():
                    return module(*eager_feed)

            t_fg: list[float] = []
            t_eager: list[float] = []
            t_ort: list[float] = []
            t_calm: list[float] = []
            with _OthersCpu(worker) as others:
                per = max(1, -(-args.repeat // ROUNDS))
                for _ in range(ROUNDS):
                    time.sleep(PAUSE_S)
                    _warm(sess.run, feed, args.warmup)
                    for _ in range(per):
                        _time(sess.run, feed, t_fg)
                    time.sleep(PAUSE_S)
                    t_ort += worker.time("default", args.warmup, per)
                    time.sleep(PAUSE_S)
                    t_calm += worker.time("no-spin", args.warmup, per)
                    time.sleep(PAUSE_S)
                    _warm(eager_run, feed, args.warmup)
                    for _ in range(per):
                        _time(eager_run, feed, t_eager)
            ms = statistics.median(t_fg) * 1e3
            default_ms, nospin_ms = statistics.median(t_ort) * 1e3, statistics.median(t_calm) * 1e3
            ort_ms = min(default_ms, nospin_ms)
            eager_ms = statistics.median(t_eager) * 1e3
            row.update({"ms": ms, "ort_ms": ort_ms, "eager_ms": eager_ms, "vs_ort": ms / ort_ms,
                        "ort_default_ms": default_ms, "ort_nospin_ms": nospin_ms, "vs_ort_default": ms / default_ms,
                        "vs_eager": ms / eager_ms, "others_cpu": others.share})
    finally:
        worker.close()
    return row


# ---- the driver --------------------------------------------------------------------------------
def run_isolated(spec: Spec, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """The model in a child process (a crash or hang there is a failed row, not a failed run)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--one", spec.name, "--row-out", out, "--repeat", str(args.repeat),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    for flag in ("engine", "floor", "cache_dir", "export_dir"):
        v = getattr(args, flag)
        if v:
            cmd += [f"--{flag.replace('_', '-')}", str(v)]
    if args.agreement_only:
        cmd.append("--agreement-only")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text = Path(out).read_text() if Path(out).stat().st_size else ""
        if proc.returncode == 0 and text:
            return json.loads(text)  # type: ignore[no-any-return]
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = f"exit {proc.returncode}: {' | '.join(tail)}"
    except subprocess.TimeoutExpired:
        why = f"timed out after {timeout:.0f} s"
    finally:
        Path(out).unlink(missing_ok=True)
    return {"model": spec.name, "family": spec.family, "source": spec.source, "error": why}


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs else math.nan


def print_table(rows: list[dict[str, Any]], agree: float) -> None:
    head = ("| model | source | agreement (rel err vs ORT) | coverage | units (fusegraph) | runs on | fusegraph / ORT "
            "| fusegraph / ORT default | fusegraph / eager | fusegraph ms | ORT ms (default / no-spin) | eager ms "
            "| setup cold / warm / ORT s | MiB (ORT) |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['source']} | FAILED: {r['error'][:160]} |" + " |" * 11)
            continue
        ok = "ok" if r["rel_err"] <= agree else "NO"
        print(
            f"| {r['model']} | {r['source']} | {ok} {r['rel_err']:.1e} | {100 * r['coverage']:.0f}% "
            f"| {r['units']} ({r['fusegraph_units']}) | {r.get('runs_on', '-')} | {_fmt(r.get('vs_ort'))}x "
            f"| {_fmt(r.get('vs_ort_default'))}x | {_fmt(r.get('vs_eager'))}x "
            f"| {_fmt(r.get('ms'))} | {_fmt(r.get('ort_default_ms'))} / {_fmt(r.get('ort_nospin_ms'))} "
            f"| {_fmt(r.get('eager_ms'))} "
            f"| {r['setup_cold_s']:.1f} / {r['setup_warm_s']:.2f} / {r['ort_setup_s']:.2f} "
            f"| {r['mib']:.0f} ({r['ort_mib']:.0f}) |"
        )
    ok = [r for r in rows if "error" not in r]
    timed = [r for r in ok if "vs_ort" in r]
    print()
    print(f"models: {len(rows)}, ran: {len(ok)}, agree (rel err <= {agree:g}): "
          f"{sum(r['rel_err'] <= agree for r in ok)}")
    if timed:
        print(f"geomean fusegraph / ORT: {geomean([r['vs_ort'] for r in timed]):.3f}x "
              f"(worst {max(r['vs_ort'] for r in timed):.2f}x, {max(timed, key=lambda r: r['vs_ort'])['model']}); "
              f"fusegraph / eager: {geomean([r['vs_eager'] for r in timed]):.3f}x")
        print(f"geomean setup cold / ORT: {geomean([r['setup_cold_s'] / r['ort_setup_s'] for r in timed]):.1f}x, "
              f"warm / ORT: {geomean([r['setup_warm_s'] / r['ort_setup_s'] for r in timed]):.1f}x; "
              f"memory / ORT: {geomean([max(r['mib'], 1) / max(r['ort_mib'], 1) for r in timed]):.2f}x")
        runs_on = collections.Counter(r.get("runs_on", "-") for r in timed)
        print("runs on: " + ", ".join(f"{k} x{v}" for k, v in sorted(runs_on.items())))
        default = [r for r in timed if "vs_ort_default" in r]
        if default:
            worst = max(default, key=lambda r: r["vs_ort_default"])
            print(f"geomean fusegraph / ORT default: {geomean([r['vs_ort_default'] for r in default]):.3f}x "
                  f"(worst {worst['vs_ort_default']:.2f}x, {worst['model']}); "
                  f"above 1.05x: {sum(r['vs_ort_default'] > 1.05 for r in default)} of {len(default)} against ORT "
                  f"default, {sum(r['vs_ort'] > 1.05 for r in timed)} against the faster ORT configuration")
        cold = [r['setup_cold_s'] / r['ort_setup_s'] for r in timed]
        warm = [r['setup_warm_s'] / r['ort_setup_s'] for r in timed]
        print(f"setup: cold above 10x ORT: {sum(c > 10 for c in cold)}, worst {max(cold):.1f}x; "
              f"warm above 2x ORT: {sum(w > 2 for w in warm)}, worst {max(warm):.1f}x")
        evals = [r["evaluation_s"] for r in timed if r.get("evaluation_s") is not None]
        if evals:
            print(f"background evaluation (cold session start to verdict): median {statistics.median(evals):.1f} s, "
                  f"max {max(evals):.1f} s")


def chart(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "vs_ort" in r]
    if not timed:
        return
    names = [r["model"] for r in timed]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.28 * len(names)), 5))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [r["vs_ort"] for r in timed], 0.4, label="fusegraph / ONNX Runtime")
    ax.bar(x + 0.2, [r["vs_eager"] for r in timed], 0.4, label="fusegraph / PyTorch eager")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=75, fontsize=7)
    ax.set_ylabel("latency ratio (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated names (default: the corpus)")
    p.add_argument("--short", action="store_true", help="the few small torch.nn models (CI), agreement only")
    p.add_argument("--list", action="store_true")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default=None, help="pin fusegraph's engine (default: the selection layer)")
    p.add_argument("--floor", default=None, help="the provider option floor (default: its default)")
    p.add_argument("--cache-dir", default=None, help="fusegraph's cache (default: a fresh one per model: cold setup)")
    p.add_argument("--export-dir", default=None, help="where exported models are kept (default: <cache>/bench-models)")
    p.add_argument("--agreement-only", action="store_true", help="no latency timing")
    p.add_argument("--agree", type=float, default=1e-4, help="largest relative error that counts as agreement")
    p.add_argument("--timeout", type=float, default=900, help="seconds per model")
    p.add_argument("--json", default="bench_models.json")
    p.add_argument("--png", default="bench_models.png")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.list:
        for s in CORPUS:
            print(f"{s.name:32s} {s.source:13s} {s.family}{'  (short)' if s.short else ''}")
        return 0
    if args.one:
        row = bench_one(BY_NAME[args.one], args)
        Path(args.row_out).write_text(json.dumps(row, default=str))
        return 0
    if args.short:
        args.agreement_only = True
        specs = [s for s in CORPUS if s.short]
    elif args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = sorted(set(names) - set(BY_NAME))
        if unknown:
            p.error(f"unknown model(s) {unknown}; --list shows the corpus")
        specs = [BY_NAME[n] for n in names]
    else:
        specs = list(CORPUS)
    rows = []
    for spec in specs:
        print(f"... {spec.name}", file=sys.stderr, flush=True)
        rows.append(run_isolated(spec, args, args.timeout))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print_table(rows, args.agree)
    print(f"machine: {os.cpu_count()} CPUs; fusegraph {'engine ' + args.engine if args.engine else 'default engines'}, "
          f"floor {args.floor or 'default'}; repeat {args.repeat}; batch 1; random weights (seed {args.seed})")
    if args.png and not args.agreement_only:
        try:
            chart(rows, args.png)
        except ImportError as exc:
            print(f"no chart: {exc} (pip install 'fusegraph[bench]')", file=sys.stderr)
    bad = [r["model"] for r in rows if "error" in r or r["rel_err"] > args.agree]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

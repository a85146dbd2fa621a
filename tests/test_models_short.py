"""The model corpus' short mode (benchmarks/bench_models.py --short): a few small real
architectures built with torch.nn (a mobile CNN with squeeze-excite and hard-swish, a
transformer encoder, an LSTM tagger), exported to ONNX, run through
fusegraph.onnx.InferenceSession with the floor off (so fusegraph's own engines compute
what they claim) and compared with ONNX Runtime and with PyTorch eager. Agreement only:
no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the corpus is built and exported with torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_models.py"


@pytest.mark.slow
def test_short_corpus_agrees_with_onnxruntime_and_eager(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--short", "--floor", "off", "--export-dir", str(tmp_path / "models"),
         "--cache-dir", str(tmp_path / "cache"), "--json", str(out), "--png", ""],
        capture_output=True, text=True, timeout=300,
    )
    assert out.exists(), proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) >= 3
    for r in rows:
        assert "error" not in r, f"{r['model']}: {r.get('error')}"
        assert r["rel_err"] <= 1e-4, f"{r['model']}: fusegraph vs ONNX Runtime rel err {r['rel_err']:.2e}"
        assert r["fusegraph_vs_eager"] <= 1e-4, f"{r['model']}: fusegraph vs eager rel err {r['fusegraph_vs_eager']:.2e}"
        assert r["fusegraph_nodes"] > 0, f"{r['model']}: nothing ran on fusegraph"
    assert proc.returncode == 0, proc.stdout[-2000:]

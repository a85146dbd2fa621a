"""The findings of the first GPU fuzz run (H200, fusegraph 1b70e82; tests/data/
gpu_fuzz_findings.json, from the project's shared gpu-fuzz-findings): every one must now
match the reference or be refused with a reason, and none may take the process down.

On the CPU the refusals that decide the cuDNN findings are checked where they are made
(the cudnn engine's binding, pure Python); on the GPU machine every record is run on the
engine that failed it, each in a child process that is restarted past a record that kills it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fusegraph as fg
from fusegraph.engines.cudnn import rules

HERE = Path(__file__).resolve().parent
FINDINGS = HERE / "data" / "gpu_fuzz_findings.json"
RECORDS = json.loads(FINDINGS.read_text())


def _graph(rec: dict[str, object]) -> fg.Graph:
    return fg.Graph.from_json(json.dumps(rec["graph"])).validate()


def test_findings_cover_the_run() -> None:
    kinds = {r["finding"] for r in RECORDS}
    assert kinds == {"wrong numbers", "process killed", "raised on a valid graph"}
    assert len(RECORDS) == 97


@pytest.mark.parametrize("i", [i for i, r in enumerate(RECORDS) if r["finding"] == "wrong numbers"])
def test_cudnn_refuses_the_layouts_it_got_wrong(i: int) -> None:
    """Every wrong-number record (the float32 matmuls: TF32 rounding on every cuDNN plan) had a tensor in a stride order other than
    NCHW's or NHWC's, a broadcast norm scale, or a dead branch: cuDNN is no longer given such a graph."""
    why = rules.refusal(_graph(RECORDS[i]))
    assert why is not None
    assert any(k in why for k in ("layouts correctly", "is broadcast", "dead branch", "unconnected", "TF32")), why


@pytest.mark.parametrize("i", [i for i, r in enumerate(RECORDS) if r["finding"] == "process killed"])
def test_cudnn_splits_graphs_with_two_main_ops(i: int) -> None:
    """Each graph that killed a process held a matmul and a convolution: cuDNN takes at most one."""
    why = rules.refusal(_graph(RECORDS[i]))
    assert why is not None and "at most one convolution, matmul or sdpa" in why, why


def test_cudnn_describes_packed_tensors_without_stride_ties() -> None:
    """A size-1 axis whose stride ties with a real one (numpy leaves such strides) is
    described with the stride its layout gives it, so cuDNN reads one unambiguous order."""
    g = fg.Graph(name="ties", io_data_type=fg.DataType.HALF, compute_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [2, 5, 1, 5], [25, 5, 1, 1])  # NCHW; the size-1 H carries W's stride
    g.abs(x).set_output(True)
    b = rules.binding(g.validate())
    assert b.described["x"].strides == (25, 5, 5, 1)
    g2 = fg.Graph(name="ties2", io_data_type=fg.DataType.HALF, compute_data_type=fg.DataType.FLOAT)
    x2 = g2.tensor("x", [2, 5, 1, 5], [25, 1, 1, 5])  # NHWC, H=1 with C's stride
    g2.abs(x2).set_output(True)
    b2 = rules.binding(g2.validate())
    assert b2.described["x"].strides == (25, 1, 25, 5)


def test_norm_params_of_lower_rank_align_right() -> None:
    """A [C] scale of a layernorm over [N, C] is [1, C] as NumPy aligns it (not [C, 1] as the
    unit dims appended for cuDNN's rank-4 norm descriptors would make it)."""
    g = fg.Graph(name="ln", io_data_type=fg.DataType.HALF, compute_data_type=fg.DataType.FLOAT)
    x = g.tensor("x", [8, 16])
    s, bias = g.tensor("s", [16]), g.tensor("b", [16])
    y, _, _ = g.layernorm(x, s, bias, 1e-5)
    y.set_output(True)
    b = rules.binding(g.validate())
    assert b.described["s"].dims == (1, 16, 1, 1) and b.described["x"].dims == (8, 16, 1, 1)


@pytest.mark.parametrize("i", [i for i, r in enumerate(RECORDS) if r["finding"] == "raised on a valid graph"])
def test_expanded_inputs_reach_the_device(i: int) -> None:
    """Every 'written-to tensor refers to a single memory location' record had an input with
    an expanded (stride-0) axis: cuDNN is not given one, and the copy every GPU plan makes of
    such an input writes the one element each expanded run shares (checked on the CPU here,
    with torch's same copy rule)."""
    import numpy as np
    import torch

    from fusegraph.engines.expanded_copy import copy_strided
    from fusegraph.engines.torch.convert import from_numpy
    from fusegraph.reference.inputs import random_inputs

    g = _graph(RECORDS[i])
    expanded = [t for t in g.inputs() if any(s == 0 and d > 1 for d, s in zip(t.shape, t.strides, strict=True))]
    assert expanded
    if RECORDS[i]["engine"] == "cudnn":
        assert rules.refusal(g)  # the stride-0 input, or a dead branch (test_cudnn_refuses_...)
    inputs = random_inputs(g, np.random.default_rng(int(RECORDS[i]["seed"])))
    for t in expanded:
        host = from_numpy(np.ascontiguousarray(inputs[t.name]), t.dtype)
        dev = copy_strided(torch.empty_strided(t.shape, t.strides, dtype=host.dtype), host)
        assert dev.stride() == t.strides
        assert torch.equal(dev, host)


# One graph per refusal rule from the later fuzz runs (1-4, H200; docs/reliability.md 1b):
# wrong numbers, the first CUDA error of each poisoned worker, and the graphs of killed ones.
RUNS = HERE / "data" / "gpu_fuzz_findings_runs.json"
RUN_RECORDS = json.loads(RUNS.read_text())


@pytest.mark.parametrize("i", range(len(RUN_RECORDS)))
def test_later_runs_findings_are_refused_with_their_rule(i: int) -> None:
    """Golden reasons: each record is refused by the rule written for it."""
    rec = RUN_RECORDS[i]
    assert (rules.refusal(_graph(rec)) or "")[:200] == rec["reason"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", [FINDINGS, RUNS], ids=["first_run", "later_runs"])
def test_every_finding_passes_or_is_refused_on_the_gpu(path: Path) -> None:
    records = json.loads(path.read_text())
    statuses: dict[int, tuple[str, str]] = {}
    first = 0
    while first < len(records):
        proc = subprocess.run([sys.executable, str(HERE / "findings_runner.py"), str(path), str(first), "cuda:0"],
                              capture_output=True, text=True, timeout=900, cwd=HERE.parent)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = int(line.split()[1])
            elif line.startswith("DONE "):
                rec = json.loads(line[5:])
                statuses[rec["index"]] = (rec["status"], rec["detail"])
                started = None
        if started is not None:  # the process died on this record
            statuses[started] = ("process killed", f"rc {proc.returncode}: {proc.stderr[-400:]}")
            first = started + 1
        elif proc.returncode != 0:
            pytest.fail(f"the findings runner failed outside a record (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
        else:
            break
    bad = {i: s for i, s in statuses.items() if s[0] not in ("ok", "refused")}
    lines = "\n".join(f"  #{i} {records[i]['engine']} seed {records[i]['seed']}: {s} {d[:200]}" for i, (s, d) in sorted(bad.items()))
    assert not bad, f"{len(bad)} of {len(records)} findings still fail:\n{lines}"
    assert len(statuses) == len(records)
    refused = [d for s, d in statuses.values() if s == "refused"]
    assert all(d.strip() for d in refused)

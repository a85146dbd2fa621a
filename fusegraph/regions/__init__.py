"""The region layer (L5.5): the one place both front doors -- the ONNX provider and the
PyTorch front door (``torch.compile(backend="fusegraph")``) -- choose which parts of a
model fusegraph runs. A graph is split into engine-sized regions along what the engines
fuse (split.py, pattern.py), each region is measured against what the front door would
otherwise run (incumbent.py, measure.py), the verdict is cached per content key, device
and library versions (verdicts.py), the chosen steps run as one plan with intermediates
on the device (plan.py), and a report says which nodes ran where and why (report.py).
It imports select/ and below, never a front door. See docs/regions.md.
"""

from __future__ import annotations

from fusegraph.regions.split import Region, Rejection, Split, split

__all__ = ["Region", "Rejection", "Split", "split"]

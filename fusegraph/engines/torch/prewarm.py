"""GPU libraries loaded while the caller does something else.

A process's first matmul on a GPU pays for loading cuBLAS and making its handle, its first
convolution for loading cuDNN: on an H200, 0.08 s and 0.06 s, paid by the first run of a
session that is otherwise ready. Those costs belong to no shape, so a thread can pay them
while the session reads and parses its model file (which releases the GIL for most of its
time): measured on the H200 (an ad hoc probe, ViT-B/16's 330 MB file), the first matmul and
convolution after the parse took 0.001 s and 0.002 s instead, for 0.02-0.04 s more on the
parse itself.

Nothing here changes what runs or how: tiny tensors of ones (no random state is drawn),
PyTorch's default flags, and each library's per-thread handle goes back to PyTorch's pool
when the thread ends, where the session's own thread takes it.
"""

from __future__ import annotations

import logging
import threading

from fusegraph.engines.torch.convert import _torch, _torch_device
from fusegraph.runtime.handle import Handle

log = logging.getLogger("fusegraph.engines.torch")

# devices whose libraries a thread has started loading in this process (once each)
_STARTED: set[str] = set()
_LOCK = threading.Lock()


def start(handle: Handle) -> threading.Thread | None:
    """A daemon thread loading cuBLAS and cuDNN for ``handle``'s GPU, the first time this
    process asks for that device; None where there is nothing to do (a CPU, no CUDA, done)."""
    if not handle.device.is_gpu:
        return None
    key = str(handle.device)
    with _LOCK:
        if key in _STARTED:
            return None
        _STARTED.add(key)
    thread = threading.Thread(target=_load, args=(handle,), name=f"fusegraph-prewarm-{key}", daemon=True)
    thread.start()
    return thread


def _load(handle: Handle) -> None:
    try:
        torch = _torch()
        if not torch.cuda.is_available():
            return
        device = _torch_device(handle)
        with torch.cuda.device(device):
            a = torch.ones(8, 8, device=device)
            _ = torch.mm(a, a)  # cuBLAS
            _ = torch.addmm(a[0], a, a)  # cuBLASLt (a matmul with a bias epilogue)
            x = torch.ones(1, 4, 8, 8, device=device)
            w = torch.ones(4, 4, 3, 3, device=device)
            _ = torch.nn.functional.conv2d(x, w)  # cuDNN
            torch.cuda.current_stream(device).synchronize()
    except Exception as exc:  # only time is at stake: the session loads them itself
        log.debug("GPU library warm-up failed: %s", exc)


"""The PyTorch front door (docs/torch.md).

- autograd functions whose forward and backward are fusegraph graphs:
  ``conv_bias_act``, ``linear_bias_act``, ``layer_norm``, ``rms_norm``,
  ``scaled_dot_product_attention`` (functions.py; graphs.py, plans.py);
- the ``torch.compile`` backend ``"fusegraph"`` (compile_backend.py; aten.py converts ATen
  graphs, partition.py claims regions through fusegraph/regions/);
- ``explain(model, *inputs)``: which ATen nodes ran where and why, with ``.coverage``.

Importing this package imports torch (it is the front door to torch); nothing else in
fusegraph imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it. No module is named like a public name: once a
# submodule is imported, Python binds it on the package under its own name, and that binding
# would hide __getattr__ (``fgt.explain`` turned into the module ``explain.py``).
_HOME = {
    "conv_bias_act": "functions",
    "linear_bias_act": "functions",
    "layer_norm": "functions",
    "rms_norm": "functions",
    "scaled_dot_product_attention": "functions",
    "backend": "compile_backend",
    "explain": "explainer",
    "PLANS": "plans",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = sorted(_HOME)

"""Where fusegraph keeps what it learns on a machine: compiled modules, tuning results,
autotune choices, oneDNN Graph verdicts. One directory, one rule for finding it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "FUSEGRAPH_CACHE_DIR"  # overrides the directory
CACHE_ENV = "FUSEGRAPH_CACHE"  # "0" turns the caches off


def cache_root() -> Path:
    """``FUSEGRAPH_CACHE_DIR``, else the user cache directory (``platformdirs``)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusegraph"))


def cache_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")

"""Where fusegraph keeps what it learns on a machine: compiled modules, tuning results,
autotune choices, oneDNN Graph verdicts. One directory, one rule for finding it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def read_table(path: Path) -> dict[str, Any]:
    """A JSON object kept in the cache directory; {} when missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Replaces the file atomically (a reader never sees half a table); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True, default=list)
    os.replace(tmp, path)

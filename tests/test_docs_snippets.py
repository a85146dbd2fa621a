"""Documentation as tests (issue 16, item 7): every ```python block in README.md and docs/*.md
runs as written, each in a fresh namespace, from a temporary directory (a snippet that needs
a model builds it or uses one the package ships)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def _snippets() -> list[tuple[str, str]]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1)))
    return out


SNIPPETS = _snippets()


def test_there_are_snippets() -> None:
    assert len(SNIPPETS) >= 5, SNIPPETS


@pytest.mark.parametrize("where,code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs_as_written(where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(code, where, "exec"), ns)  # the documentation's own code
    assert os.getcwd() == str(tmp_path)

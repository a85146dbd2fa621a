"""Progress lines (issue 16, item 5): drawn on a terminal after a delay, never when stderr is
not a terminal or with --quiet (the "fusegraph" logger at ERROR)."""

from __future__ import annotations

import io
import logging
import time

import pytest

from fusegraph.runtime import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_drawn_on_a_terminal_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.working("fusegraph: testing"):
        time.sleep(0.7)
    assert "fusegraph: testing" in err.getvalue()


def test_quiet_when_not_a_terminal_or_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    with progress.working("fusegraph: testing"):
        time.sleep(0.6)
    assert plain.getvalue() == ""
    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    logger = logging.getLogger("fusegraph")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        assert not progress.enabled()
        with progress.working("fusegraph: testing"):
            time.sleep(0.6)
    finally:
        logger.setLevel(old)
    assert err.getvalue() == ""

"""A sign of life on long work: a tqdm line that appears only after about a second.

Shown when stderr is a terminal and the "fusegraph" logger lets warnings through (the CLI's
``--quiet`` raises it to ERROR); otherwise nothing is drawn and nothing is started.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator

DELAY_S = 1.0


def enabled() -> bool:
    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)()) and logging.getLogger("fusegraph").isEnabledFor(
        logging.WARNING
    )


@contextlib.contextmanager
def working(desc: str) -> Iterator[None]:
    """Elapsed time next to ``desc`` while the block runs, once it has run ``DELAY_S``."""
    if not enabled():
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=None, desc=desc, delay=DELAY_S, bar_format="{desc}: {elapsed}", leave=False)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.refresh()

    t = threading.Thread(target=tick, name="fusegraph-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        bar.close()

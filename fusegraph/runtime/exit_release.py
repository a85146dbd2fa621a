"""Holders of a native library's objects, let go of before the interpreter tears its modules
down. Objects kept alive until exit -- by a session, a compiled model, Dynamo's frame cache --
are otherwise freed in any order with the modules: IREE's bindings crash when a buffer
outlives its HAL device, and nanobind (IREE's and cuDNN's frontend's bindings) prints pages
of "leaked instance / type / function" lines for each object still alive. Each library's
holders are one ``ExitRelease``, released by that library's own exit handler."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any


class ExitRelease:
    """Objects with a ``_release()`` that drops their native objects, tracked weakly."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()

    def track(self, holder: Any) -> None:
        self._live.add(holder)

    def release(self) -> None:
        """Each holder's ``_release()``, once; a failure is passed over (nothing useful to
        do about it at exit)."""
        for holder in list(self._live):
            with contextlib.suppress(Exception):
                holder._release()
        self._live.clear()

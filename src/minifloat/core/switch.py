"""A per-thread on/off switch with a scoped context manager: the one shape of every temporary, thread-local mode in
minifloat (eager kernels, suppressed FP8 steps), so none of them is a process-global flag flipped unscoped."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ThreadSwitch:
    """Off by default; `with switch.on():` turns it on for the block, in this thread only (nesting restores)."""

    def __init__(self):
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        prev = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = prev

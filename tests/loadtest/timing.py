"""Retrying timing-sensitive tests only when the test process itself was starved of CPU.

These tests measure real time over real sockets on a shared machine (vLLM engines may be running beside
them). A scheduling stall of hundreds of milliseconds is indistinguishable from a slow server, so an
assertion that fails *while* such a stall was observed is retried; one that fails on a calm machine fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
STARVED_S = 0.1


class StarvationMonitor:
    """A thread that sleeps 10 ms at a time and records how late it wakes."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(0.01)
            self.max_lag = max(self.max_lag, time.perf_counter() - before - 0.01)

    def __enter__(self) -> StarvationMonitor:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(1)


def retry_if_starved(attempt: Callable[[], T], attempts: int = 3) -> T:
    """Run ``attempt``; on an AssertionError retry only if the process was starved (>100 ms) meanwhile."""
    for i in range(attempts):
        with StarvationMonitor() as monitor:
            try:
                return attempt()
            except AssertionError:
                if i == attempts - 1 or monitor.max_lag < STARVED_S:
                    raise
    raise AssertionError("unreachable")

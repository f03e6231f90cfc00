"""Pausing real processes from a test: the one SIGSTOP/SIGCONT helper the integration and compose tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil


@contextlib.contextmanager
def paused(*processes: psutil.Process) -> Iterator[None]:
    """SIGSTOP ``processes`` for the block and SIGCONT them after it, whatever the block raises: a stopped engine
    holds its requests in flight (a drain that must outlast checks) or looks hung (past hung_after_seconds)."""
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile (its parent stopped it): none to resume
                process.resume()

"""Waiting for a real system to reach a state: the one polling helper the integration and compose tests share.

Tests judge orderings and end states, not durations: ``timeout`` is a generous bound for a loaded 2-core machine,
never the thing asserted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def eventually(check: Callable[[], T | None], timeout: float, what: str, *, interval: float = 0.5) -> T:
    """Poll ``check`` until it returns something truthy, and return that; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(interval)
    pytest.fail(f"not within {timeout:.0f}s: {what}")

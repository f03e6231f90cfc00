"""One look at an engine's /health, and how consecutive looks add up to "not routing to it".

A probe has three outcomes, not two: green, refused (no engine, or an error), and late (no answer within
``engine.health_timeout_seconds``). vLLM answers /health on its API server's event loop, the same loop that streams
every token, so a busy engine on a loaded host answers late while it serves well. A late answer therefore does not
count against an engine while the gateway keeps receiving its response bytes (``ReplicaStatus.last_progress``,
written by the data path): otherwise a loaded host takes every busy replica out of routing, and every request
then fails with no replica. A refused probe always counts, and so does a late one from an engine that sends
nothing: a hung engine is still found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import aiohttp

from appliance.engine.contract import ReplicaStatus

HEALTH_PROBE_TIMEOUT_SECONDS = 2.0  # engine.health_timeout_seconds' default


class Health(Enum):
    OK = "ok"  # 200 in time
    LATE = "late"  # no answer within the probe's time limit
    FAILED = "failed"  # refused, reset, or not 200


async def probe_health(session: aiohttp.ClientSession, url: str,
                       timeout_seconds: float = HEALTH_PROBE_TIMEOUT_SECONDS) -> Health:
    """One look at an engine's /health: OK only on a 200 within ``timeout_seconds``."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as resp:
            return Health.OK if resp.status == 200 else Health.FAILED
    except TimeoutError:  # aiohttp's ServerTimeoutError is one too
        return Health.LATE
    except (aiohttp.ClientError, OSError):
        return Health.FAILED


class HealthFailures:
    """Consecutive probes of one engine that count as failed. A LATE probe does not count (nor reset the count)
    while the data path received the engine's bytes within ``grace_seconds`` (the probe's time limit plus the
    interval between probes: progress since the last look)."""

    def __init__(self, status: ReplicaStatus, grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._status = status
        self.grace_seconds = grace_seconds
        self._clock = clock
        self.count = 0
        self.excused = 0  # late probes not counted, over this object's life

    def record(self, result: Health) -> int:
        """The count after ``result``: 0 after a green probe."""
        if result is Health.OK:
            self.count = 0
        elif result is Health.LATE and self._progressing():
            self.excused += 1
        else:
            self.count += 1
        return self.count

    def _progressing(self) -> bool:
        progress = self._status.last_progress
        return progress is not None and self._clock() - progress <= self.grace_seconds

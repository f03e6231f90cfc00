"""Passive outlier ejection: replicas that fail or lag are taken out of routing for a backoff period.

A replica with ``eject_consecutive_failures`` failures in a row, or whose average TTFT is an outlier against its
peers, is ejected for a doubling backoff period; when the period ends it is probed (its /metrics must answer)
before it returns. The gateway's own view, kept apart from the replica: a replica does not know it is ejected.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.settings import RoutingSettings

log = logging.getLogger(__name__)


@dataclass
class ReplicaHealth:
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None  # monotonic; None = in rotation
    reason: str = ""
    ttft_ewma: float | None = None

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None


class Ejector:
    TTFT_EWMA_ALPHA = 0.2

    def __init__(self, routing: RoutingSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.routing = routing
        self._clock = clock
        self.health: dict[str, ReplicaHealth] = {}

    def health_of(self, name: str) -> ReplicaHealth:
        return self.health.setdefault(name, ReplicaHealth())

    def is_ejected(self, name: str) -> bool:
        health = self.health.get(name)
        return health is not None and health.ejected

    def failure(self, name: str) -> None:
        health = self.health_of(name)
        health.consecutive_failures += 1
        if health.consecutive_failures >= self.routing.eject_consecutive_failures:
            self.eject(name, f"{health.consecutive_failures} consecutive failures")

    def success(self, name: str, ttft_seconds: float | None, peers: Iterable[str]) -> None:
        health = self.health_of(name)
        health.consecutive_failures = 0
        if ttft_seconds is not None:
            self._record_ttft(name, health, ttft_seconds, peers)

    def eject(self, name: str, reason: str) -> None:
        health = self.health_of(name)
        if health.ejected:
            return
        period = min(self.routing.eject_max_seconds, self.routing.eject_base_seconds * 2 ** health.ejections)
        health.ejections += 1
        health.ejected_until = self._clock() + period
        health.reason = reason
        log.warning("ejecting %s for %.0fs: %s", name, period, reason)

    def due_for_probe(self) -> list[str]:
        """Ejected replicas whose period is over: they return only after a successful probe."""
        now = self._clock()
        return [name for name, h in self.health.items() if h.ejected and h.ejected_until <= now]

    def probe_result(self, name: str, ok: bool) -> None:
        health = self.health_of(name)
        if not health.ejected:
            return
        if ok:
            log.info("%s passed its probe; back in rotation", name)
            health.ejected_until = None
            health.consecutive_failures = 0
            health.ttft_ewma = None  # judge it afresh
        else:
            health.ejected_until = None
            self.eject(name, f"probe failed after: {health.reason}")

    def _record_ttft(self, name: str, health: ReplicaHealth, ttft: float, peers: Iterable[str]) -> None:
        a = self.TTFT_EWMA_ALPHA
        health.ttft_ewma = ttft if health.ttft_ewma is None else (1 - a) * health.ttft_ewma + a * ttft
        others = [self.health_of(p).ttft_ewma for p in peers if p != name]
        others = [o for o in others if o is not None]
        if not others:
            return  # an outlier needs peers to be an outlier against; never eject the last replica
        median = statistics.median(others)
        if (health.ttft_ewma > self.routing.latency_outlier_factor * median
                and health.ttft_ewma - median > self.routing.latency_outlier_min_seconds):
            self.eject(name, f"TTFT outlier: {health.ttft_ewma:.2f}s vs peers' median {median:.2f}s")

"""Which replica gets the next request, and which replicas are taken out of the rotation.

Policy: among ready, non-ejected replicas under their concurrency limit, the one with the fewest outstanding
requests; ties go to the lower KV-cache usage, then the shorter engine queue (both read from each engine's
/metrics; stale readings count as unknown), then the lower index. Outstanding counts are the gateway's own:
exact, no polling lag.

Passive outlier ejection: a replica with ``eject_consecutive_failures`` failures in a row, or whose average TTFT
is an outlier against its peers, is ejected for a doubling backoff period; when the period ends it is probed
(its /metrics must answer) before it returns.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.settings import RoutingSettings

log = logging.getLogger(__name__)


class Routable(Protocol):
    """What the router needs of a replica; the supervisor's Replica satisfies it, and so do test doubles."""

    name: str
    url: str

    @property
    def routable(self) -> bool: ...

    @property
    def status(self): ...  # has an ``outstanding`` int


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # the replica's fault: connect error, 5xx, timeout, broken stream
    CLIENT_ERROR = "client_error"  # a 4xx: the request's fault, says nothing about the replica
    ABORTED = "aborted"  # the client went away or the request never reached the replica


@dataclass
class EngineLoad:
    """A reading of an engine's own metrics."""

    kv_cache_usage: float | None = None  # 0..1
    waiting: float | None = None
    running: float | None = None
    prompt_tokens_total: float | None = None  # counters: rates are taken by whoever needs them
    generation_tokens_total: float | None = None
    read_at: float = -math.inf  # monotonic


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


class Router:
    TTFT_EWMA_ALPHA = 0.2

    def __init__(
        self,
        replicas: Callable[[], Sequence[Routable]],
        routing: RoutingSettings | None = None,
        *,
        limit_for: Callable[[str], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replicas = replicas
        self.routing = routing or RoutingSettings()
        self._limit_for = limit_for or (lambda _name: 1 << 30)
        self._clock = clock
        self.health: dict[str, ReplicaHealth] = {}
        self.load: dict[str, EngineLoad] = {}

    def replicas(self) -> Sequence[Routable]:
        return self._replicas()

    def health_of(self, name: str) -> ReplicaHealth:
        return self.health.setdefault(name, ReplicaHealth())

    def eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Routable]:
        return [r for r in self._replicas()
                if r.routable and r.name not in exclude and not self.health_of(r.name).ejected]

    def any_eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return bool(self.eligible(exclude))

    def capacity_expected(self) -> bool:
        """A replica is down for a planned restart and will be back: worth queueing for, not a 503."""
        return any(getattr(r.status, "planned_restart", False) for r in self._replicas())

    def try_acquire(self, exclude: frozenset[str] | set[str] = frozenset()) -> Routable | None:
        """The best replica with room under its limit, its outstanding count already taken; or None."""
        candidates = [r for r in self.eligible(exclude) if r.status.outstanding < self._limit_for(r.name)]
        if not candidates:
            return None
        chosen = min(candidates, key=self._rank)
        chosen.status.outstanding += 1
        return chosen

    def release(self, replica: Routable, outcome: Outcome, ttft_seconds: float | None = None) -> None:
        if replica.status.outstanding <= 0:  # a bug if it happens: the drain and the limits rely on this count
            log.error("release of %s with no request outstanding (%s)", replica.name, outcome.value)
        else:
            replica.status.outstanding -= 1
        health = self.health_of(replica.name)
        if outcome is Outcome.FAILURE:
            health.consecutive_failures += 1
            if health.consecutive_failures >= self.routing.eject_consecutive_failures:
                self.eject(replica.name, f"{health.consecutive_failures} consecutive failures")
        elif outcome is Outcome.SUCCESS:
            health.consecutive_failures = 0
            if ttft_seconds is not None:
                self._record_ttft(replica.name, health, ttft_seconds)

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

    def update_load(self, name: str, load: EngineLoad) -> None:
        self.load[name] = load

    def _fresh_load(self, name: str) -> EngineLoad:
        load = self.load.get(name)
        if load is None or self._clock() - load.read_at > self.routing.metrics_stale_seconds:
            return EngineLoad()
        return load

    def _rank(self, replica: Routable) -> tuple:
        load = self._fresh_load(replica.name)
        # Unknown readings rank in the middle: neither preferred nor avoided.
        kv = 0.5 if load.kv_cache_usage is None else load.kv_cache_usage
        waiting = 0.0 if load.waiting is None else load.waiting
        return (replica.status.outstanding, round(kv, 2), waiting)

    def _record_ttft(self, name: str, health: ReplicaHealth, ttft: float) -> None:
        a = self.TTFT_EWMA_ALPHA
        health.ttft_ewma = ttft if health.ttft_ewma is None else (1 - a) * health.ttft_ewma + a * ttft
        peers = [self.health_of(r.name).ttft_ewma for r in self.eligible() if r.name != name]
        peers = [p for p in peers if p is not None]
        if not peers:
            return  # an outlier needs peers to be an outlier against; never eject the last replica
        median = statistics.median(peers)
        if (health.ttft_ewma > self.routing.latency_outlier_factor * median
                and health.ttft_ewma - median > self.routing.latency_outlier_min_seconds):
            self.eject(name, f"TTFT outlier: {health.ttft_ewma:.2f}s vs peers' median {median:.2f}s")

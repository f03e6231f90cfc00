"""Passive outlier ejection: replicas that fail or lag are taken out of routing for a backoff period.

A replica with ``eject_consecutive_failures`` failures in a row, or whose average TTFT is an outlier against its
peers, is ejected for a doubling backoff period; when the period ends it is probed (its /metrics must answer)
before it returns. Each ``eject_decay_seconds`` back in rotation halves the doubling, so a replica that behaves
again is not punished for old incidents. The gateway's own view, kept apart from the replica: a replica does not
know it is ejected.

Panic threshold (Envoy's healthy_panic_threshold): ejection must never cost more capacity than the sickness it
guards against. When fewer than ``eject_panic_threshold`` of the routable replicas would remain, and always when
none would, ejection is ignored and every routable replica takes traffic (``panic``; the router's ``is_ejected``,
which the routing filters read, applies it).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from appliance.gateway.routing.settings import RoutingSettings

log = logging.getLogger(__name__)


@dataclass
class ReplicaHealth:
    consecutive_failures: int = 0
    ejections: int = 0  # ever, for the metric: never decreases
    strikes: int = 0  # what the next period doubles from; decays while the replica behaves
    in_rotation_since: float | None = None  # monotonic: when it last returned from an ejection
    ejected_until: float | None = None  # monotonic; None = in rotation
    reason: str = ""
    ttft_ewma: float | None = None
    ttft_at: float | None = None  # monotonic: the average's last sample

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

    def panic(self, names: Iterable[str]) -> bool:
        """Whether ejection is ignored for these routable replicas: fewer healthy than the panic threshold (or none)
        would be left without the ejected ones, so routing spreads over all of them."""
        names = list(names)
        ejected = sum(1 for n in names if self.is_ejected(n))
        return bool(ejected) and self._panics(len(names), ejected)

    def _panics(self, total: int, ejected: int) -> bool:
        healthy = total - ejected
        return healthy == 0 or healthy / total < self.routing.eject_panic_threshold

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
        self._decay(health)
        period = min(self.routing.eject_max_seconds, self.routing.eject_base_seconds * 2 ** min(health.strikes, 32))
        health.strikes += 1
        health.ejections += 1
        health.ejected_until = self._clock() + period
        health.reason = reason
        log.warning("ejecting %s for %.0fs: %s", name, period, reason)

    def prune(self, live: Collection[str]) -> None:
        """Forget replicas gone from the fleet, except one whose ejection period is still running: an address
        that leaves DNS and comes back within it stays ejected, rather than escape its penalty by flapping."""
        now = self._clock()
        for name in [name for name in self.health if name not in live]:
            until = self.health[name].ejected_until
            if until is None or until <= now:
                del self.health[name]

    def due_for_probe(self) -> list[str]:
        """Ejected replicas whose period is over: they return only after a successful probe."""
        now = self._clock()
        return [name for name, h in self.health.items() if h.ejected_until is not None and h.ejected_until <= now]

    def probe_result(self, name: str, ok: bool) -> None:
        health = self.health_of(name)
        if not health.ejected:
            return
        if ok:
            log.info("%s passed its probe; back in rotation", name)
            health.ejected_until = None
            health.consecutive_failures = 0
            health.ttft_ewma = None  # judge it afresh
            health.in_rotation_since = self._clock()
        else:
            health.ejected_until = None
            self.eject(name, f"probe failed after: {health.reason}")

    def _fresh(self, health: ReplicaHealth, now: float) -> float | None:
        """A replica's TTFT average while it still describes the replica: one without a sample for
        ``latency_outlier_window_seconds`` may have been restarted, redeployed or drained since (a new process, an
        empty cache), and a peer's old reading would make whoever carried the load meanwhile look like an outlier."""
        if health.ttft_at is None or now - health.ttft_at > self.routing.latency_outlier_window_seconds:
            return None
        return health.ttft_ewma

    def _decay(self, health: ReplicaHealth) -> None:
        """Halve the strikes once per full healthy period the replica spent in rotation since its last return."""
        if health.in_rotation_since is None:
            return
        periods = int((self._clock() - health.in_rotation_since) // self.routing.eject_decay_seconds)
        health.strikes >>= min(periods, 32)
        health.in_rotation_since = None

    def _record_ttft(self, name: str, health: ReplicaHealth, ttft: float, peers: Iterable[str]) -> None:
        a = self.TTFT_EWMA_ALPHA
        now = self._clock()
        fresh = self._fresh(health, now)
        health.ttft_ewma = (1 - a) * fresh + a * ttft if fresh is not None else ttft
        health.ttft_at = now
        others = [o for o in (self._fresh(self.health_of(p), now) for p in peers if p != name) if o is not None]
        if not others:
            return  # an outlier needs peers to be an outlier against; never eject the last replica
        median = statistics.median(others)
        if (health.ttft_ewma > self.routing.latency_outlier_factor * median
                and health.ttft_ewma - median > self.routing.latency_outlier_min_seconds):
            self.eject(name, f"TTFT outlier: {health.ttft_ewma:.2f}s vs peers' median {median:.2f}s")

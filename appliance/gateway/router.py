"""Which replica gets the next request.

Policy: among ready, non-ejected replicas under their concurrency limit, the one with the fewest outstanding
requests; ties go to the lower KV-cache usage, then the shorter engine queue (both read from each engine's
/metrics; stale readings count as unknown), then the lower index. Outstanding counts are the gateway's own:
exact, no polling lag. The router keeps that bookkeeping itself (a replica does not know what the gateway sent
it); ejection is ``appliance.gateway.ejection``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from appliance.engine.contract import Replica
from appliance.engine.load import EngineLoad
from appliance.gateway.ejection import Ejector, ReplicaHealth
from appliance.settings import RoutingSettings

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # the replica's fault: connect error, 5xx, timeout, broken stream
    CLIENT_ERROR = "client_error"  # a 4xx: the request's fault, says nothing about the replica
    ABORTED = "aborted"  # the client went away or the request never reached the replica


class Router:
    def __init__(
        self,
        replicas: Callable[[], Sequence[Replica]],
        routing: RoutingSettings | None = None,
        *,
        limit_for: Callable[[str], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replicas = replicas
        self.routing = routing or RoutingSettings()
        self._limit_for = limit_for or (lambda _name: 1 << 30)
        self._clock = clock
        self.ejector = Ejector(self.routing, clock)
        self.outstanding: dict[str, int] = {}  # requests in flight per replica, as the gateway sent them
        self.load: dict[str, EngineLoad] = {}

    # -- views --------------------------------------------------------------------------------------------------

    def replicas(self) -> Sequence[Replica]:
        return self._replicas()

    def in_flight(self, name: str | None = None) -> int:
        """Requests in flight at one replica, or at all of them."""
        if name is None:
            return sum(self.outstanding.values())
        return self.outstanding.get(name, 0)

    def health_of(self, name: str) -> ReplicaHealth:
        return self.ejector.health_of(name)

    def loads(self) -> Mapping[str, EngineLoad]:
        return self.load

    def eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        return [r for r in self._replicas()
                if r.routable and r.name not in exclude and not self.ejector.is_ejected(r.name)]

    def any_eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return bool(self.eligible(exclude))

    def capacity_expected(self) -> bool:
        """A replica is down for a planned restart and will be back: worth queueing for, not a 503."""
        return any(r.status.planned_restart for r in self._replicas())

    # -- routing ------------------------------------------------------------------------------------------------

    def try_acquire(self, exclude: frozenset[str] | set[str] = frozenset()) -> Replica | None:
        """The best replica with room under its limit, its outstanding count already taken; or None."""
        candidates = [r for r in self.eligible(exclude) if self.in_flight(r.name) < self._limit_for(r.name)]
        if not candidates:
            return None
        chosen = min(candidates, key=self._rank)
        self.outstanding[chosen.name] = self.in_flight(chosen.name) + 1
        return chosen

    def release(self, replica: Replica, outcome: Outcome, ttft_seconds: float | None = None) -> None:
        count = self.in_flight(replica.name)
        if count <= 0:  # a bug if it happens: the drain and the limits rely on this count
            log.error("release of %s with no request outstanding (%s)", replica.name, outcome.value)
        else:
            self.outstanding[replica.name] = count - 1
        if outcome is Outcome.FAILURE:
            self.ejector.failure(replica.name)
        elif outcome is Outcome.SUCCESS:
            self.ejector.success(replica.name, ttft_seconds, (r.name for r in self.eligible()))

    def eject(self, name: str, reason: str) -> None:
        self.ejector.eject(name, reason)

    def due_for_probe(self) -> list[str]:
        return self.ejector.due_for_probe()

    def probe_result(self, name: str, ok: bool) -> None:
        self.ejector.probe_result(name, ok)

    # -- engine readings ----------------------------------------------------------------------------------------

    def poll_targets(self) -> list[Replica]:
        """Replicas whose /metrics is worth reading: routable ones, and ejected ones due for their probe."""
        due = set(self.ejector.due_for_probe())
        return [r for r in self._replicas() if r.routable or r.name in due]

    def update_load(self, name: str, load: EngineLoad) -> None:
        self.load[name] = load

    def observe_reading(self, name: str, load: EngineLoad | None) -> None:
        """One poll of a replica's /metrics (None: it did not answer); for an ejected replica it is the probe."""
        if load is not None:
            self.update_load(name, load)
        if name in self.ejector.due_for_probe():
            self.ejector.probe_result(name, ok=load is not None)

    def _fresh_load(self, name: str) -> EngineLoad:
        load = self.load.get(name)
        if load is None or self._clock() - load.read_at > self.routing.metrics_stale_seconds:
            return EngineLoad()
        return load

    def _rank(self, replica: Replica) -> tuple:
        load = self._fresh_load(replica.name)
        # Unknown readings rank in the middle: neither preferred nor avoided.
        kv = 0.5 if load.kv_cache_usage is None else load.kv_cache_usage
        waiting = 0.0 if load.waiting is None else load.waiting
        return (self.in_flight(replica.name), round(kv, 2), waiting)

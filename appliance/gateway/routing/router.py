"""Which replica gets the next request, and the gateway's bookkeeping of what it sent where.

Routing is a pipeline (``appliance.gateway.routing``): filters (routable, not already tried, not ejected unless
too many are: the panic threshold, under its concurrency limit), then a policy: weighted scorers (in-flight
requests, KV-cache usage, engine queue, prefix affinity) or round robin, from ``routing.scorers``. The defaults
choose as the older fixed policy did (fewest outstanding, then lower KV usage, then shorter queue, then lower
index) unless a replica was recently sent the same prompt prefix. Outstanding counts are the gateway's own: exact,
no polling lag. Engine readings count as unknown when stale, or when they contradict those counts (the engine says
idle while the gateway has had a request in flight there since before the reading). Ejection is
``appliance.gateway.routing.ejection``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from prometheus_client import CollectorRegistry

from appliance.engine.contract import Replica
from appliance.engine.load import EngineLoad
from appliance.gateway.observation.metrics import PrefixIndexCollector, RoutingMetrics
from appliance.gateway.routing.ejection import Ejector, ReplicaHealth
from appliance.gateway.routing.filters import ELIGIBLE, passing, sift
from appliance.gateway.routing.pipeline import build_policy
from appliance.gateway.routing.request import Decision, RoutingRequest
from appliance.gateway.routing.scorers import PrefixScorer
from appliance.gateway.routing.settings import PrefixScorerSettings, RoutingSettings

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # the replica's fault: connect error, 5xx, timeout, broken stream
    CLIENT_ERROR = "client_error"  # a 4xx: the request's fault, says nothing about the replica
    TIMED_OUT = "timed_out"  # outlived request_timeout_seconds: the request's length (max_tokens), not a fault
    ABORTED = "aborted"  # the client went away or the request never reached the replica
    # The engine answered an error of its own for this request (a 500, or a 5xx error event): its fault, or the
    # input's (a request that makes vLLM raise fails on every replica). Judged by the shape breaker once known
    # (appliance.gateway.breaker: ``engine_failed``); without one it counts as FAILURE at once.
    SERVER_ERROR = "server_error"


class Router:
    def __init__(
        self,
        replicas: Callable[[], Sequence[Replica]],
        routing: RoutingSettings | None = None,
        *,
        limit_for: Callable[[str], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        affinity_scorer: Callable[[PrefixScorerSettings], PrefixScorer] = PrefixScorer,
    ) -> None:
        self._replicas = replicas
        self.routing = routing or RoutingSettings()
        self._limit_for = limit_for or (lambda _name: 1 << 30)
        self._clock = clock
        self.ejector = Ejector(self.routing, clock)
        # SERVER_ERROR releases wait for a verdict (engine_failed) instead of counting as failures: set by the
        # composition root when the shape breaker judges them.
        self.server_errors_judged = False
        self.outstanding: dict[str, int] = {}  # requests in flight per replica, as the gateway sent them
        self.load: dict[str, EngineLoad] = {}
        self._busy_since: dict[str, float] = {}  # when each replica's in-flight count last rose from 0
        self._relayed_at: dict[str, float] = {}  # when the gateway last relayed response bytes from each replica
        self.policy = build_policy(self.routing.scorers, affinity_scorer)
        registry = registry if registry is not None else CollectorRegistry()
        self.metrics = RoutingMetrics(registry)
        if self.policy.prefix is not None:
            registry.register(PrefixIndexCollector(self.policy.prefix))

    # -- views --------------------------------------------------------------------------------------------------

    def replicas(self) -> Sequence[Replica]:
        return self._replicas()

    def in_flight(self, name: str | None = None) -> int:
        """Requests in flight at one replica, or at all of them."""
        if name is None:
            return sum(self.outstanding.values())
        return self.outstanding.get(name, 0)

    def note_relayed(self, replica: Replica) -> None:
        """Response bytes from ``replica`` just reached the gateway: first-hand evidence that it makes progress,
        with no polling lag (engine counters can lag, or stand still on a loaded host while tokens flow). Kept for
        maintenance (``relayed_at``) and on the replica's status, where its health watch reads it
        (appliance/engine/health.py: a late /health from an engine that streams is not a failure)."""
        now = self._relayed_at[replica.name] = self._clock()
        replica.status.last_progress = now

    def relayed_at(self, name: str) -> float | None:
        """When the gateway last relayed response bytes from ``name`` (the router's clock), or None."""
        return self._relayed_at.get(name)

    def health_of(self, name: str) -> ReplicaHealth:
        return self.ejector.health_of(name)

    def loads(self) -> Mapping[str, EngineLoad]:
        return self.load

    def eligible(self, exclude: Collection[str] = frozenset()) -> list[Replica]:
        return passing(self._replicas(), self, exclude, ELIGIBLE)

    def panic(self) -> bool:
        """Ejection is being ignored: too few routable replicas would be left without the ejected ones."""
        return self.ejector.panic(r.name for r in self._replicas() if r.routable)

    def any_eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return bool(self.eligible(exclude))

    def has_room(self, exclude: Collection[str] = frozenset()) -> bool:
        """Whether a replica outside ``exclude`` would take a request now: ``try_acquire``'s first check, without
        the decision (the queue asks it before working out a tenant's share, which a full fleet makes moot)."""
        return bool(passing(self._replicas(), self, exclude))

    def capacity_expected(self) -> bool:
        """A replica is down for a planned restart and will be back: worth queueing for, not a 503."""
        return any(r.status.planned_restart for r in self._replicas())

    # -- routing ------------------------------------------------------------------------------------------------

    def try_acquire(self, exclude: Collection[str] = frozenset(),
                    request: RoutingRequest | None = None) -> Replica | None:
        """The best replica with room under its limit, its outstanding count already taken; or None.
        ``request`` carries the prompt for prefix affinity (None: route by load alone); its ``decision`` is set,
        explained: every replica considered, the first filter that removed each one left out, the scores."""
        started = time.perf_counter()
        replicas = self._replicas()
        self.policy.observe(replicas)
        candidates, removed = sift(replicas, self, exclude)
        if not candidates:
            return None
        decision = self.policy.choose(candidates, self, request)
        chosen = next(r for r in candidates if r.name == decision.replica)
        self._take(chosen.name)
        self.metrics.duration.observe(time.perf_counter() - started)
        self.metrics.decisions.labels(self.policy.name, decision.decided_by).inc()
        if decision.prefix_match is not None and request is not None and request.prompt:
            self.metrics.prefix_match.observe(decision.prefix_match)
        if request is not None:
            _explain(decision, replicas, removed)
            request.decision = decision
        return chosen

    def _take(self, name: str) -> None:
        count = self.in_flight(name)
        if count == 0:
            self._busy_since[name] = self._clock()
        self.outstanding[name] = count + 1

    def release(self, replica: Replica, outcome: Outcome, ttft_seconds: float | None = None) -> None:
        count = self.in_flight(replica.name)
        if count <= 0:  # a bug if it happens: the drain and the limits rely on this count
            log.error("release of %s with no request outstanding (%s)", replica.name, outcome.value)
        else:
            self.outstanding[replica.name] = count - 1
            if count == 1:
                self._busy_since.pop(replica.name, None)
        if outcome is Outcome.FAILURE or (outcome is Outcome.SERVER_ERROR and not self.server_errors_judged):
            self.ejector.failure(replica.name)
        elif outcome is Outcome.SUCCESS:
            self.ejector.success(replica.name, ttft_seconds, (r.name for r in self.eligible()))

    def engine_failed(self, name: str) -> None:
        """An error answer released as SERVER_ERROR was judged the engine's fault: it counts toward ejection now (a
        success in between has reset the count: "in a row" holds to within one request)."""
        self.ejector.failure(name)

    def prune(self, live: Collection[str]) -> None:
        """Forget what is kept per replica for those gone from the fleet (``live``: the names in it now): engine
        readings, progress times, ejection state, the routing policy's own (prefix index, balance window). A
        gone replica with requests still in flight keeps its count until they end, so their release finds it."""
        for name in [name for name in self.outstanding if name not in live and not self.outstanding[name]]:
            del self.outstanding[name]
        for table in (self.load, self._relayed_at):
            for name in [name for name in table if name not in live]:
                del table[name]
        for name in [name for name in self._busy_since if name not in live and not self.outstanding.get(name)]:
            del self._busy_since[name]
        self.ejector.prune(live)
        self.policy.prune(live)

    def eject(self, name: str, reason: str) -> None:
        self.ejector.eject(name, reason)

    def due_for_probe(self) -> list[str]:
        return self.ejector.due_for_probe()

    def probe_result(self, name: str, ok: bool) -> None:
        self.ejector.probe_result(name, ok)

    # -- engine readings ----------------------------------------------------------------------------------------

    def poll_targets(self) -> list[Replica]:
        """Replicas whose /metrics is worth reading: routable ones, ejected ones due for their probe, and any with
        requests still in flight (a draining replica's counters keep rising until its last request ends: the
        tenants' reconciliation reads them)."""
        due = set(self.ejector.due_for_probe())
        return [r for r in self._replicas() if r.routable or r.name in due or self.in_flight(r.name) > 0]

    def update_load(self, name: str, load: EngineLoad) -> None:
        self.load[name] = load
        prefix = self.policy.prefix
        if prefix is not None and load.kv_capacity_tokens is not None:  # the index models the engine's cache size
            prefix.set_capacity(name, load.kv_capacity_tokens)

    def observe_reading(self, name: str, load: EngineLoad | None) -> None:
        """One poll of a replica's /metrics (None: it did not answer); for an ejected replica it is the probe."""
        if load is not None:
            self.update_load(name, load)
        if name in self.ejector.due_for_probe():
            self.ejector.probe_result(name, ok=load is not None)

    # -- the view filters and scorers read (appliance.gateway.routing.view.RoutingView) -------------------------

    def limit_of(self, name: str) -> int:
        return self._limit_for(name)

    def is_ejected(self, name: str) -> bool:
        """Ejected and routing honours it: under the panic threshold (and always when no routable replica would be
        left) ejection is ignored, so ejection never leaves zero routable replicas."""
        return self.ejector.is_ejected(name) and not self.panic()

    def engine_load(self, name: str) -> EngineLoad | None:
        load = self.load.get(name)
        if load is None or self._clock() - load.read_at > self.routing.metrics_stale_seconds:
            return None
        if self._lagging(name, load):
            return None
        return load

    def _lagging(self, name: str, load: EngineLoad) -> bool:
        """The engine reports nothing running or waiting, yet the gateway has had a request in flight there since
        well before the reading (more than one poll interval): its gauges lag (seen with vLLM's CPU build on two
        loaded cores), so the rest of the reading cannot be trusted either."""
        busy_since = self._busy_since.get(name)
        if busy_since is None or load.read_at - busy_since <= self.routing.metrics_poll_seconds:
            return False
        return not (load.running or 0) and not (load.waiting or 0)


def _explain(decision: Decision, replicas: Sequence[Replica], removed: list[tuple[str, str]]) -> None:
    """Completes the policy's decision with what the filters did: the replicas considered, in order, and those
    the filters removed before the policy's own removals (the balance bound)."""
    decision.considered = [r.name for r in replicas]
    if removed:
        decision.removed[:0] = removed

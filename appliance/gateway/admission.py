"""SLA-driven admission control: an adaptive concurrency limit per replica and a bounded gateway queue.

The seed's "adjust the batch from queue length and compute load", made a feedback loop: each replica's limit
grows by one request per limit's worth of requests that met the TTFT target (additive increase) and shrinks by a
factor when one misses it or fails (multiplicative decrease, at most once per limit's worth of completions so one
slow burst is one cut). Requests beyond the fleet's limits wait in a FIFO queue; when the queue is full, or a
request waited longer than its queue timeout, the gateway answers 429 with Retry-After instead of letting every
request miss its SLA.

What admission hands out is a ``Lease`` (``appliance.gateway.slots``): the request's one hold on its replica's
slot, given back exactly once, and audited on every engine poll (``SlotAudit``).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from appliance.engine.contract import Replica
from appliance.gateway.router import Outcome, Router
from appliance.gateway.routing import RoutingRequest
from appliance.gateway.slots import Lease, LeaseLedger, SlotAudit
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.tenants.directory import Tenant
from appliance.http.errors import APIError


class AIMDLimit:
    """Additive-increase / multiplicative-decrease concurrency limit driven by per-request TTFT."""

    def __init__(self, initial: float, minimum: float, maximum: float, target_seconds: float,
                 decrease_factor: float = 0.9) -> None:
        self.value = float(min(max(initial, minimum), maximum))
        self.minimum = float(minimum)
        self.maximum = float(maximum)
        self.target_seconds = target_seconds
        self.decrease_factor = decrease_factor
        self._since_decrease = math.inf

    @property
    def limit(self) -> int:
        return max(int(self.minimum), int(self.value))

    def on_sample(self, ttft_seconds: float | None, *, failed: bool = False) -> None:
        self._since_decrease += 1
        if failed or (ttft_seconds is not None and ttft_seconds > self.target_seconds):
            if self._since_decrease >= self.value:  # one cut per limit's worth of completions
                self.value = max(self.minimum, self.value * self.decrease_factor)
                self._since_decrease = 0
        elif ttft_seconds is not None:
            self.value = min(self.maximum, self.value + 1.0 / self.value)


class ConcurrencyLimits:
    """One AIMD limit per replica, created on first use; unlimited when admission control is off."""

    UNLIMITED = 1 << 30

    def __init__(self, factory: Callable[[], AIMDLimit] | None) -> None:
        self._factory = factory
        self._limits: dict[str, AIMDLimit] = {}

    def limit_of(self, name: str) -> int:
        if self._factory is None:
            return self.UNLIMITED
        return self._get(name).limit

    def on_sample(self, name: str, ttft_seconds: float | None, *, failed: bool) -> None:
        if self._factory is not None:
            self._get(name).on_sample(ttft_seconds, failed=failed)

    def _get(self, name: str) -> AIMDLimit:
        if name not in self._limits:
            self._limits[name] = self._factory()
        return self._limits[name]


@dataclass(frozen=True, eq=False)
class _Waiter:
    """A queued request: what it waits on (a future that gets its Lease), the replicas it must not get (a retry
    leaves the ones that failed it) and its prompt, for prefix affinity when capacity frees up."""

    future: asyncio.Future
    exclude: frozenset[str]
    request: RoutingRequest | None


class Admission:
    """Hands out replicas under their limits; queues the rest, bounded in length and in time."""

    def __init__(self, router: Router, limits: ConcurrencyLimits, *, max_queue: int,
                 queue_timeout_seconds: float, drift_seconds: float = 30.0) -> None:
        self.router = router
        self.limits = limits
        self.max_queue = max_queue
        self.queue_timeout_seconds = queue_timeout_seconds
        self._waiters: deque[_Waiter] = deque()
        self.rejected = {"queue_full": 0, "queue_timeout": 0}
        self.ledger = LeaseLedger()
        self.audit = SlotAudit(router, self.ledger, drift_seconds=drift_seconds)

    @property
    def queue_length(self) -> int:
        return sum(1 for entry in self._waiters if not entry.future.done())

    async def acquire(self, exclude: frozenset[str] = frozenset(), request: RoutingRequest | None = None, *,
                      tenant: Tenant = DEFAULT_TENANT) -> Lease:
        """A lease on the best replica with room, waiting in the queue for one if need be. ``tenant``: whose
        request it is (fair share between tenants)."""
        lease = self.try_lease(exclude, request)
        if lease is not None:
            return lease
        if not self.router.any_eligible(exclude) and not self.router.capacity_expected():
            raise APIError(503, "no ready replica; retry shortly", code="no_ready_replica",
                           headers={"Retry-After": "5"})
        if self.queue_length >= self.max_queue:
            self.rejected["queue_full"] += 1
            raise self._overloaded("gateway queue is full")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(waiter, exclude, request))
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that arrives as the
            # waiter is handed a lease, so a client that left kept going with a slot (one way slots leaked).
            async with asyncio.timeout(self.queue_timeout_seconds):
                return await asyncio.shield(waiter)
        except TimeoutError:
            self._abandon(waiter)
            self.rejected["queue_timeout"] += 1
            raise self._overloaded(f"waited {self.queue_timeout_seconds:.0f}s in the gateway queue") from None
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: asyncio.Future) -> None:
        """The waiter leaves the queue; a lease handed to it at the last moment goes back."""
        if waiter.done() and not waiter.cancelled():
            waiter.result().release(Outcome.ABORTED)
        waiter.cancel()

    def limit_of(self, name: str) -> int:
        return self.limits.limit_of(name)

    def try_lease(self, exclude: frozenset[str], request: RoutingRequest | None) -> Lease | None:
        replica = self.router.try_acquire(exclude, request)
        if replica is None:
            return None
        self.ledger.taken(replica)
        return Lease(replica, self._given_back, self.ledger.on_reclaimed)

    def _given_back(self, replica: Replica, outcome: Outcome, ttft_seconds: float | None) -> None:
        """A lease was released (once): the slot returns, the replica is judged, the queue moves."""
        self.ledger.given_back(replica)
        self.router.release(replica, outcome, ttft_seconds)
        if outcome in (Outcome.SUCCESS, Outcome.FAILURE):
            self.limits.on_sample(replica.name, ttft_seconds, failed=outcome is Outcome.FAILURE)
        self.dispatch()

    def on_poll(self) -> None:
        """After each engine poll: audit the slots against the leases and the engines, then move the queue."""
        self.audit.check()
        self.dispatch()

    def dispatch(self) -> None:
        """Give freed capacity to the oldest waiters, each within its exclusions: a waiter that may not take
        what is free keeps its place, and the next one is served."""
        for entry in list(self._waiters):
            if entry.future.done():
                self._waiters.remove(entry)
                continue
            lease = self.try_lease(entry.exclude, entry.request)
            if lease is None:
                if not entry.exclude:
                    return  # nothing free for anyone
                continue
            self._waiters.remove(entry)
            entry.future.set_result(lease)

    def _overloaded(self, why: str) -> APIError:
        retry_after = max(1, math.ceil(self.queue_timeout_seconds / 2))
        return APIError(429, f"over capacity: {why}; retry after {retry_after}s", code="over_capacity",
                        headers={"Retry-After": str(retry_after)})

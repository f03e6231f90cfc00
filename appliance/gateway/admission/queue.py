"""SLA-driven admission control: the bounded gateway queue in front of each replica's adaptive limit
(``limit.py``, the seed's "adjust the batch from queue length and compute load" made a feedback loop).

Requests beyond the fleet's limits wait in a queue, ordered by priority then fair share between tenants
(``appliance.gateway.tenants.fair_share``; FIFO within a tenant, or for everyone when ``admission.fair_share`` is
off); when the queue is full, or a request waited longer than its queue timeout, the gateway answers 429 with
Retry-After instead of letting every request miss its SLA.

What admission hands out is a ``Lease`` (``slots.py``): the request's one hold on its replica's slot, given back
exactly once, and audited on every engine poll (``SlotAudit``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.engine.contract import Replica
from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.slots import Lease, LeaseLedger, SlotAudit
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.fair_share import DISPATCH_COST, VirtualClock, share_bound
from appliance.http.auth import revoked_error
from appliance.http.errors import APIError


@dataclass(frozen=True, eq=False)
class _Waiter:
    """A queued request: what it waits on (a future that gets its Lease), the replicas it must not get (a retry
    leaves the ones that failed it), its prompt (prefix affinity when capacity frees up), whose it is and when it
    came (``seq``: FIFO within a tenant, and the whole order when fair share is off)."""

    future: asyncio.Future[Lease]
    exclude: frozenset[str]
    request: RoutingRequest | None
    tenant: Tenant
    seq: int


class Admission:
    """Hands out replicas under their limits; queues the rest, bounded in length and in time.

    The queue is ordered by priority, then fair share among the tenants of one priority (least served by weight
    goes next, FIFO within a tenant: ``appliance.gateway.tenants.fair_share``), and while other tenants want a
    replica a tenant holds at most its weighted max-min share of it. A new request is served through the same
    queue, so it never takes capacity a waiter ahead of it in that order could take. ``fair_share=False``
    (``admission.fair_share``): one FIFO queue, no bound.

    ``over_share_prefills`` (``admission.over_share_prefills``): a tenant that wants more of a replica, by weight,
    than another tenant that wants it may have at most this many requests in prefill there (leased, no first token
    yet: ``prefill_bound``). The share bounds how many requests a tenant holds, not what they cost each engine step:
    a flood whose clients leave at the first token holds its whole share in prefill, and every prefill shares the
    engine's steps with the other tenants' (vLLM's priority orders only its waiting queue, which such a flood never
    fills). None: no such cap.
    """

    def __init__(self, router: Router, limits: ConcurrencyLimits, *, max_queue: int,
                 queue_timeout_seconds: float, drift_seconds: float = 30.0, fair_share: bool = True,
                 share_window_seconds: float = 2.0, idle_headroom: float = 0.25,
                 over_share_prefills: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``idle_headroom``: the share of each replica's limit background work (``acquire_idle``) leaves free."""
        self.router = router
        self.limits = limits
        self.max_queue = max_queue
        self.queue_timeout_seconds = queue_timeout_seconds
        self.fair_share = fair_share
        self.share_window_seconds = share_window_seconds
        self.idle_headroom = idle_headroom
        self.over_share_prefills = over_share_prefills
        # Called when a request has to wait in the queue: background work gives its slots back (appliance.batch).
        self.on_wait: Callable[[], None] | None = None
        # Called when a request arrives (not background work): batch work holds back its next lines (appliance.batch).
        self.on_arrival: Callable[[], None] | None = None
        self._clock = clock
        # Per tenant, oldest first; only waiters still waiting (each leaves its queue as its future is settled), and
        # no empty queue: counting and ordering the waiters costs nothing per waiter on every release.
        self._queues: dict[str, deque[_Waiter]] = {}
        self._seq = itertools.count()
        self._held: dict[str, Counter[str]] = defaultdict(Counter)  # tenant -> replica -> leases held
        self._prefilling: dict[str, Counter[str]] = defaultdict(Counter)  # tenant -> replica -> held, no first token
        self._recent: dict[tuple[str, str], tuple[int, float]] = {}  # (tenant, replica) -> (peak held, last held at)
        self._tenants: dict[str, Tenant] = {}  # the latest word on each tenant's priority and weight
        self._revoked: set[str] = set()  # tenants a reload removed: their requests are refused, not queued
        self.virtual = VirtualClock()
        self.rejected = {"queue_full": 0, "queue_timeout": 0}
        self.ledger = LeaseLedger()
        self.audit = SlotAudit(router, self.ledger, drift_seconds=drift_seconds)

    # -- views ----------------------------------------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def tenant_queued(self, name: str) -> int:
        """Requests of tenant ``name`` waiting in the queue."""
        queue = self._queues.get(name)
        return len(queue) if queue is not None else 0

    def tenant_in_flight(self, name: str, replica: str | None = None) -> int:
        """Leases tenant ``name`` holds (at one replica, or at all)."""
        held = self._held.get(name)
        if held is None:
            return 0
        return held[replica] if replica is not None else sum(held.values())

    def tenant_prefilling(self, name: str, replica: str | None = None) -> int:
        """Leases tenant ``name`` holds whose first token has not come back yet (at one replica, or at all)."""
        prefilling = self._prefilling.get(name)
        if prefilling is None:
            return 0
        return prefilling[replica] if replica is not None else sum(prefilling.values())

    def limit_of(self, name: str) -> int:
        return self.limits.limit_of(name)

    def share_bound(self, tenant: Tenant, replica: str) -> int:
        """How many leases ``tenant`` may hold at ``replica`` now: its weighted max-min share of the replica's limit
        among the tenants that want it (requests held there or queued anywhere, or held there within
        ``share_window_seconds``: a tenant between two requests keeps its room); all of it when alone."""
        limit = self.limit_of(replica)
        if not self.fair_share:
            return limit
        return share_bound(limit, tenant.name, tenant.weight, self._rivals(tenant.name, replica, self._queued()))

    def over_share(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` has been served more than its fair share: its virtual time (served tokens / weight) is
        ahead of the least served active tenant of its priority by more than one dispatch (the request being
        dispatched is not held against it). Never with fair share off, nor for a tenant alone at its priority."""
        if not self.fair_share:
            return False
        peers = [self.virtual.of(name) for name, level in self._active_priorities().items()
                 if level == tenant.priority and name != tenant.name]
        return bool(peers) and self.virtual.of(tenant.name) - DISPATCH_COST / tenant.weight > min(peers) + 1e-9

    def prefill_bound(self, tenant: Tenant, replica: str) -> int | None:
        """How many requests ``tenant`` may have in prefill at ``replica`` now: ``over_share_prefills`` while it wants
        more of the replica by weight (requests held there and queued) than another tenant that wants it; else None
        (no bound but its share). Heaviest, not over its max-min share: a flood arriving one request at a time is
        served while the replica has room, within its share all along, and its prefills are what others wait on."""
        if self.over_share_prefills is None or not self.fair_share:
            return None
        queued = self._queued()
        return self._prefill_bound(tenant, replica, queued, self._rivals(tenant.name, replica, queued))

    def _prefill_bound(self, tenant: Tenant, replica: str, queued: dict[str, int],
                       rivals: dict[str, tuple[float, float]]) -> int | None:
        current = self._tenant(tenant.name)
        demand = (self.tenant_in_flight(tenant.name, replica) + queued.get(tenant.name, 0)) / current.weight
        if self.over_share_prefills is None or not any(demand > want / weight for weight, want in rivals.values()):
            return None
        return self.over_share_prefills

    def _queued(self) -> dict[str, int]:
        return {name: self.tenant_queued(name) for name in self._queues}

    def _rivals(self, tenant: str, replica: str, queued: dict[str, int]) -> dict[str, tuple[float, float]]:
        """The other tenants that want ``replica``: name -> (weight, demand); ``queued``: each tenant's waiters."""
        rivals: dict[str, tuple[float, float]] = {}
        for name in set(self._held) | set(queued) | {name for name, _ in self._recent}:
            if name == tenant:
                continue
            demand = max(self.tenant_in_flight(name, replica) + queued.get(name, 0), self._reserve(name, replica))
            if demand > 0:
                rivals[name] = (self._tenant(name).weight, demand)
        return rivals

    # -- admission ------------------------------------------------------------------------------------------------

    async def acquire(self, exclude: frozenset[str] = frozenset(), request: RoutingRequest | None = None, *,
                      tenant: Tenant = DEFAULT_TENANT) -> Lease:
        """A lease on the best replica with room, waiting in the queue for one if need be. ``tenant``: whose
        request it is (its place in fair order and its share). The request joins the queue and the queue is
        served at once: it is answered now only if no waiter ahead of it in fair order could take the room."""
        if tenant.name in self._revoked:  # authenticated before a reload removed its tenant
            raise revoked_error()
        if self.on_arrival is not None:
            self.on_arrival()
        self._tenants[tenant.name] = tenant
        if not self._active(tenant.name):
            self.virtual.activate(tenant.name, tenant.priority, self._active_priorities())
        entry = _Waiter(asyncio.get_running_loop().create_future(), exclude, request, tenant, next(self._seq))
        self._queues.setdefault(tenant.name, deque()).append(entry)
        self.dispatch()
        if entry.future.done():
            return entry.future.result()
        if not self.router.any_eligible(exclude) and not self.router.capacity_expected():
            self._withdraw(entry)
            raise APIError(503, "no ready replica; retry shortly", code="no_ready_replica",
                           headers={"Retry-After": "5"})
        if self.queue_length > self.max_queue:
            self._withdraw(entry)
            self.rejected["queue_full"] += 1
            raise self._overloaded("gateway queue is full")
        if self.on_wait is not None:
            self.on_wait()
        waiter = entry.future
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that arrives as the
            # waiter is handed a lease, so a client that left kept going with a slot (one way slots leaked).
            async with asyncio.timeout(self.queue_timeout_seconds):
                return await asyncio.shield(waiter)
        except TimeoutError:
            self._abandon(entry)
            self.rejected["queue_timeout"] += 1
            raise self._overloaded(f"waited {self.queue_timeout_seconds:.0f}s in the gateway queue") from None
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(entry)
            raise

    # -- background work (batch lines): idle capacity only --------------------------------------------------------

    def idle_room(self) -> int:
        """Slots background work may take now: none while any request waits in the queue; else, over the replicas
        a request could go to, the room below each one's idle ceiling (its limit less ``idle_headroom`` of it, kept
        for interactive requests)."""
        if self.queue_length:
            return 0
        return sum(max(0, self._idle_ceiling(r.name) - self.router.in_flight(r.name)) for r in self.router.eligible())

    def acquire_idle(self, exclude: frozenset[str], request: RoutingRequest | None, *,
                     tenant: Tenant = DEFAULT_TENANT) -> Lease:
        """A lease for background work on idle capacity only (``idle_room``), never queued and never ahead of a
        waiter: where there is none, 429 ``no_idle_capacity`` at once (the batch runner tries again later)."""
        if tenant.name in self._revoked:
            raise revoked_error()
        if not self.queue_length:
            full = frozenset(r.name for r in self.router.replicas()
                             if self.router.in_flight(r.name) >= self._idle_ceiling(r.name))
            lease = self.try_lease(exclude | full, request, tenant=tenant)
            if lease is not None:
                return lease
        raise APIError(429, "no idle capacity for background work now", code="no_idle_capacity",
                       headers={"Retry-After": "1"})

    def _idle_ceiling(self, replica: str) -> int:
        return math.ceil(self.limit_of(replica) * (1 - self.idle_headroom))

    def revoke(self, names: Iterable[str]) -> int:
        """Tenants a reload removed: their queued requests are answered 401 at once (a removed tenant's work is
        not done later), and their requests still on the way are refused when they reach the queue. Returns how
        many queued requests were ended."""
        ended = 0
        for name in names:
            self._revoked.add(name)
            for entry in self._queues.pop(name, ()):
                if not entry.future.done():
                    entry.future.set_exception(revoked_error())
                    ended += 1
        if ended:
            self.dispatch()
        return ended

    def readmit(self, names: Iterable[str]) -> None:
        """Tenants a reload (re)configured: no longer refused."""
        self._revoked.difference_update(names)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """``tenant`` was served ``tokens`` (the engine's usage): it moves back in fair order by tokens / weight."""
        self._tenants[tenant.name] = tenant
        self.virtual.charge(tenant.name, tokens, tenant.weight)

    def _withdraw(self, entry: _Waiter) -> None:
        """A request refused before it waited leaves the queue (nothing was handed to it)."""
        entry.future.cancel()
        self._leave(entry)

    def _abandon(self, entry: _Waiter) -> None:
        """The waiter leaves the queue; a lease handed to it at the last moment goes back."""
        waiter = entry.future
        if waiter.done() and not waiter.cancelled():
            waiter.result().release(Outcome.ABORTED)
        waiter.cancel()
        self._leave(entry)

    def _leave(self, entry: _Waiter) -> None:
        """``entry`` is out of its tenant's queue, and a queue left empty is gone."""
        queue = self._queues.get(entry.tenant.name, deque())
        if entry in queue:
            queue.remove(entry)
        if not queue:
            self._queues.pop(entry.tenant.name, None)

    def try_lease(self, exclude: frozenset[str], request: RoutingRequest | None, *,
                  tenant: Tenant = DEFAULT_TENANT) -> Lease | None:
        """A lease now if a replica has room, past the queue and fair share (tests fill replicas with it)."""
        replica = self.router.try_acquire(exclude, request)
        if replica is None:
            return None
        name = tenant.name
        self.ledger.taken(replica)
        self._held[name][replica.name] += 1
        self._prefilling[name][replica.name] += 1
        self._note_level(name, replica.name, self._held[name][replica.name])
        prefill = [True]  # until its first token or its release, whichever comes first

        def first_token() -> None:
            if prefill[0]:
                prefill[0] = False
                self._prefilled(name, replica.name)

        def given_back(replica: Replica, outcome: Outcome, ttft_seconds: float | None) -> None:
            if prefill[0]:
                prefill[0] = False
                self._prefilled(name, replica.name, dispatch=False)
            self._given_back(replica, outcome, ttft_seconds, name)

        return Lease(replica, given_back, self.ledger.on_reclaimed, first_token)

    def _prefilled(self, tenant: str, replica: str, *, dispatch: bool = True) -> None:
        """A lease of ``tenant`` at ``replica`` left prefill (its first token came, or it was released): a waiter
        held back by ``over_share_prefills`` may go (``dispatch``; a release moves the queue itself)."""
        prefilling = self._prefilling[tenant]
        prefilling[replica] -= 1
        if prefilling[replica] <= 0:
            del prefilling[replica]
            if not prefilling:
                del self._prefilling[tenant]
        if dispatch and self.over_share_prefills is not None:
            self.dispatch()

    def _given_back(self, replica: Replica, outcome: Outcome, ttft_seconds: float | None, tenant: str) -> None:
        """A lease was released (once): the slot returns, the replica is judged, the queue moves."""
        self.ledger.given_back(replica)
        held = self._held[tenant]
        self._note_level(tenant, replica.name, held[replica.name])
        held[replica.name] -= 1
        if held[replica.name] <= 0:
            del held[replica.name]
            if not held:
                del self._held[tenant]
        self.router.release(replica, outcome, ttft_seconds)
        if outcome in (Outcome.SUCCESS, Outcome.FAILURE):
            self.limits.on_sample(replica.name, ttft_seconds, failed=outcome is Outcome.FAILURE)
        self.dispatch()

    def on_poll(self) -> None:
        """After each engine poll: forget replicas that are gone, audit the slots against the leases and the
        engines, then move the queue."""
        self.prune()
        self.audit.check()
        self.dispatch()

    def prune(self) -> None:
        """Drop the state kept per replica for replicas no longer in the fleet (on Kubernetes every new pod is a
        new address, so without this the gateway's per-replica state grows for ever): the router's, the adaptive
        limits, and the tenants' recent levels. Every poll, not only when the set changes: a request still
        finishing on a replica that left brings some of it back when it ends. O(replicas) a second."""
        live = frozenset(r.name for r in self.router.replicas())
        self.router.prune(live)
        self.limits.retain(live)
        self.audit.retain(live)
        for key in [key for key in self._recent if key[1] not in live]:
            del self._recent[key]

    def dispatch(self) -> None:
        """Give free capacity to waiters in fair order, each within its exclusions and its tenant's share: a
        waiter that may not take what is free keeps its place, and the next one is served. Served one at a time,
        the order recomputed after each (a dispatch moves its tenant back)."""
        while self._queues and any(self._serve_one(group) for group in self._groups()):
            pass

    def _serve_one(self, group: Iterable[_Waiter]) -> bool:
        """Serve the first waiter of ``group`` that can be served; True if one was (and then stop reading
        ``group``: serving it changed the queue). A waiter with no exclusion that cannot be served means none after it
        in its group can (same tenant's share, same free room)."""
        full: frozenset[str] | None = None  # the replicas where the group's tenant holds its share: one per group
        for entry in group:
            if not self.router.has_room(entry.exclude):  # no share to work out: nothing to take
                if not entry.exclude:
                    return False
                continue
            if full is None:
                full = self._at_share_replicas(entry.tenant) if self.fair_share else frozenset()
            lease = self.try_lease(entry.exclude | full, entry.request, tenant=entry.tenant)
            if lease is None:
                if not entry.exclude:
                    return False
                continue
            self._leave(entry)
            self.virtual.charge(entry.tenant.name, DISPATCH_COST, self._tenant(entry.tenant.name).weight)
            entry.future.set_result(lease)
            return True
        return False

    def _at_share_replicas(self, tenant: Tenant) -> frozenset[str]:
        queued = self._queued()
        return frozenset(r.name for r in self.router.replicas() if self._at_share(tenant, r.name, queued))

    def _groups(self) -> list[Iterable[_Waiter]]:
        """The waiters in serving order, read in place (no copy per release): per tenant (FIFO), tenants by
        priority then least virtual time; or, fair share off, all of them in one FIFO group."""
        if not self.fair_share:
            return [heapq.merge(*self._queues.values(), key=lambda entry: entry.seq)]
        waiting = sorted(self._queues.items(),
                         key=lambda item: (-self._tenant(item[0]).priority, self.virtual.of(item[0]), item[1][0].seq))
        return [queue for _, queue in waiting]

    def _at_share(self, tenant: Tenant, replica: str, queued: dict[str, int]) -> bool:
        """``tenant`` holds its share of ``replica`` while others want it (alone, only the replica's limit counts),
        or has as many requests in prefill there as its ``prefill_bound``."""
        rivals = self._rivals(tenant.name, replica, queued)
        if not rivals:
            return False
        current = self._tenant(tenant.name)
        bound = share_bound(self.limit_of(replica), current.name, current.weight, rivals)
        if self.tenant_in_flight(tenant.name, replica) >= bound:
            return True
        cap = self._prefill_bound(tenant, replica, queued, rivals)
        return cap is not None and self.tenant_prefilling(tenant.name, replica) >= cap

    def _tenant(self, name: str) -> Tenant:
        return self._tenants.get(name) or Tenant(name)

    def _active(self, name: str) -> bool:
        return self.tenant_in_flight(name) > 0 or self.tenant_queued(name) > 0

    def _active_priorities(self) -> dict[str, int]:
        names = {name for name in set(self._held) | set(self._queues) if self._active(name)}
        return {name: self._tenant(name).priority for name in names}

    def _note_level(self, tenant: str, replica: str, level: int) -> None:
        """``tenant`` holds (or held until now) ``level`` leases at ``replica``: its recent peak, for the window."""
        now = self._clock()
        peak, at = self._recent.get((tenant, replica), (0, -math.inf))
        if now - at > self.share_window_seconds or level >= peak:
            self._recent[(tenant, replica)] = (level, now)

    def _reserve(self, tenant: str, replica: str) -> int:
        """The most leases ``tenant`` held at ``replica`` within the last ``share_window_seconds`` (0: none)."""
        peak, at = self._recent.get((tenant, replica), (0, -math.inf))
        if self._clock() - at > self.share_window_seconds:
            self._recent.pop((tenant, replica), None)
            return 0
        return peak

    def _overloaded(self, why: str) -> APIError:
        retry_after = max(1, math.ceil(self.queue_timeout_seconds / 2))
        return APIError(429, f"over capacity: {why}; retry after {retry_after}s", code="over_capacity",
                        headers={"Retry-After": str(retry_after)})

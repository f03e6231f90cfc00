"""A worker's side of the decider's socket: the decision state the request path asks for
(``appliance.gateway.decisions``), answered by the decider.

- ``RemoteAdmission``: a slot is one question (``Acquire`` -> ``Granted`` or ``Refused``); the lease it returns is
  a real ``Lease`` whose release is a message. A client that leaves while its request is queued sends ``Cancel``;
  a slot granted as it left goes back at once.
- ``RemoteRouting``: the replicas as the decider last described them (``Fleet``, sent when they change), the
  progress relayed per replica (gathered, sent every ``RELAYED_SECONDS``) and the engines' failures.
- ``RemoteQuotas``: the decider's quota buckets, as a ``QuotaStore`` (a round trip per request of a tenant with a
  quota; unreachable: refused 503, as a shared store failing closed).
- ``RemoteLedger`` and ``RemoteRecords``: the reconciliation's charges and the requests' records, sent.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter

from appliance.engine.contract import NotRestartable, Replica, ReplicaState, ReplicaStatus
from appliance.engine.placement import Placement
from appliance.gateway.admission.slots import Lease
from appliance.gateway.decisions import Held
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import Cost, Refusal
from appliance.gateway.tenants.quota_store import DIRECTIONS, StoreUnavailable, limits_of
from appliance.gateway.workers import messages as m
from appliance.gateway.workers.link import Link, LinkClosed
from appliance.http.errors import APIError

log = logging.getLogger(__name__)

RELAYED_SECONDS = 0.5  # how often the progress relayed per replica is told to the decider


def unwanted(link: Link, answer: Any) -> None:
    """An answer nobody waits for any more: a slot granted to a request that left goes back; a quota reservation
    made for one is refunded."""
    if isinstance(answer, m.Granted):
        link.send(m.Release(answer.lease, Outcome.ABORTED.value))
    elif isinstance(answer, m.Reserved) and answer.reservation:
        link.send(m.Settle(answer.reservation, None))


def decider_gone() -> APIError:
    return APIError(503, "the gateway's decider is not answering; retry shortly", code="decider_unavailable",
                    headers={"Retry-After": "2"})


class RemoteReplica:
    """A replica as the decider described it. The same object stays for as long as the name does (leases hold
    it); its status follows each ``Fleet``."""

    def __init__(self, view: m.ReplicaView) -> None:
        self.status = ReplicaStatus()
        self.view = view
        self.update(view)

    def update(self, view: m.ReplicaView) -> None:
        self.view = view
        self.status.state = ReplicaState(view.state)
        self.status.planned_restart = view.planned_restart

    @property
    def name(self) -> str:
        return self.view.name

    @property
    def url(self) -> str:
        return self.view.url

    @property
    def routable(self) -> bool:
        return self.view.routable

    @property
    def placement(self) -> Placement | None:
        return None

    @property
    def restartable(self) -> bool:
        return False

    @property
    def drainable(self) -> bool:
        return False

    @property
    def kv_cache_space_bytes(self) -> int | None:
        return None

    def drain(self) -> None:
        raise NotRestartable("a worker's replicas are the decider's")

    def undrain(self) -> None:
        raise NotRestartable("a worker's replicas are the decider's")

    async def restart(self) -> None:
        raise NotRestartable("a worker's replicas are the decider's")


class RemoteRouting:
    """The routing state a worker reads (``RoutingState``), and what its prompt tokenizing asks of the decider's
    event indexes (``IndexView``, with precise prefix routing)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._replicas: dict[str, RemoteReplica] = {}
        self._order: list[RemoteReplica] = []
        self._relayed: set[str] = set()
        self._flush: asyncio.TimerHandle | None = None
        self._kv_usable = False
        self._block_sizes: set[int] = set()
        self.described = asyncio.Event()  # the first Fleet came

    def update(self, fleet: m.Fleet) -> None:
        order = []
        for view in fleet.replicas:
            replica = self._replicas.get(view.name)
            if replica is None:
                replica = self._replicas[view.name] = RemoteReplica(view)
            else:
                replica.update(view)
            order.append(replica)
        names = {view.name for view in fleet.replicas}
        for name in [name for name in self._replicas if name not in names]:
            del self._replicas[name]
        self._order = order
        self._kv_usable, self._block_sizes = fleet.kv_usable, set(fleet.block_sizes)
        self.described.set()

    def any_usable(self) -> bool:
        """Whether any engine's event index at the decider is current (precise routing: tokenize the prompt)."""
        return self._kv_usable

    def block_sizes(self) -> set[int]:
        return self._block_sizes

    def replicas(self) -> Sequence[Replica]:
        return self._order

    def replica(self, name: str) -> RemoteReplica | None:
        return self._replicas.get(name)

    def any_eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return any(r.view.eligible and r.name not in exclude for r in self._order)

    def policy_of(self, name: str) -> str | None:
        """The scheduling policy the replica's engine last reported (None: unknown)."""
        replica = self._replicas.get(name)
        return None if replica is None else replica.view.scheduling_policy

    def note_relayed(self, replica: Replica) -> None:
        self._relayed.add(replica.name)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELAYED_SECONDS, self._send_relayed)

    def _send_relayed(self) -> None:
        self._flush = None
        relayed, self._relayed = self._relayed, set()
        self.link.send(m.Relayed(sorted(relayed)))

    def engine_failed(self, name: str) -> None:
        self.link.send(m.EngineFailed(name))


class RemoteAdmission:
    """Admission as a worker asks for it (``AdmissionState``)."""

    def __init__(self, link: Link, routing: RemoteRouting, queue_timeout_seconds: float) -> None:
        self.link = link
        self.routing = routing
        self._queue_timeout_seconds = queue_timeout_seconds
        self._over_share: dict[str, bool] = {}

    @property
    def router(self) -> RemoteRouting:
        return self.routing

    @property
    def queue_timeout_seconds(self) -> float:
        return self._queue_timeout_seconds

    async def acquire(self, exclude: frozenset[str] = frozenset(), request: RoutingRequest | None = None, *,
                      tenant: Tenant = DEFAULT_TENANT) -> Lease:
        ask = m.Acquire(self.link.number(), tenant, sorted(exclude), request.prompt if request else "",
                        request.salt if request else "")
        tokens = request.tokens if request is not None else None
        if tokens is not None:
            ask.token_ids, ask.token_salt = tokens.ids, tokens.salt
        try:
            answer = await self.link.ask(ask, unwanted=partial(unwanted, self.link))
        except asyncio.CancelledError:
            self.link.send(m.Cancel(ask.id))
            raise
        except LinkClosed:
            raise decider_gone() from None
        if isinstance(answer, m.Refused):
            raise APIError(answer.status, answer.message, param=answer.param, code=answer.code,
                           headers=answer.headers or None)
        replica = self.routing.replica(answer.replica)
        if replica is None:  # granted on a replica this worker has not heard of yet: give it back, try again
            self.link.send(m.Release(answer.lease, Outcome.ABORTED.value))
            raise APIError(503, "no ready replica; retry shortly", code="no_ready_replica",
                           headers={"Retry-After": "1"})
        self._over_share[tenant.name] = answer.over_share
        if request is not None:
            request.decision = answer.decision
        send, number = self.link.send, answer.lease

        def release(_replica: Replica, outcome: Outcome, ttft_seconds: float | None) -> None:
            send(m.Release(number, outcome.value, ttft_seconds))

        def reclaimed(_replica: Replica) -> None:  # dropped unreleased: the decider's ledger counts it (an alert)
            send(m.Reclaimed(number))

        return Lease(replica, release, reclaimed, lambda: send(m.FirstToken(number)))

    def acquire_idle(self, exclude: frozenset[str], request: RoutingRequest | None, *,
                     tenant: Tenant = DEFAULT_TENANT) -> Lease:
        raise APIError(503, "background work runs in the decider, not in a worker", code="no_idle_capacity")

    def over_share(self, tenant: Tenant) -> bool:
        """The tenant's fair-share standing as the decider gave its last slot."""
        return self._over_share.get(tenant.name, False)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        self.link.send(m.Charge(tenant, tokens))


class RemoteReservation:
    """A reservation the decider holds: settled or refunded once, by a message."""

    __slots__ = ("link", "number", "done")

    def __init__(self, link: Link, number: int) -> None:
        self.link = link
        self.number = number
        self.done = False

    def settle(self, used: float) -> None:
        if not self.done:
            self.done = True
            self.link.send(m.Settle(self.number, used))

    def refund(self) -> None:
        if not self.done:
            self.done = True
            self.link.send(m.Settle(self.number, None))


class _Unchecked:
    """What ``admit_unchecked`` returns; never used: a worker's quotas fail closed."""

    def settle(self, used: float) -> None:
        pass

    def refund(self) -> None:
        pass


class RemoteQuotas:
    """The decider's quota buckets as a ``QuotaStore``: the decider is the store, and when it does not answer
    the request is refused (closed), as no worker can admit anything without it anyway."""

    fails_open = False

    def __init__(self, link: Link, retry_after_seconds: int, registry: CollectorRegistry) -> None:
        self.link = link
        self._retry_after_seconds = retry_after_seconds
        self.unchecked = Counter("appliance_quota_store_unchecked_requests", "Requests whose quota could not be "
                                 "checked because the store failed, by direction: open (admitted without quota), "
                                 "closed (refused 503).", ["direction"], registry=registry)
        for direction in DIRECTIONS:
            self.unchecked.labels(direction)

    @property
    def retry_after_seconds(self) -> int:
        return self._retry_after_seconds

    def count_unchecked(self, direction: str) -> None:
        self.unchecked.labels(direction).inc()

    async def reserve(self, tenant: Tenant, cost: Cost) -> Held | Refusal | None:
        if not any(limits_of(tenant)):
            return None
        ask = m.Reserve(self.link.number(), tenant, cost.prompt, cost.completion, cost.requests)
        try:
            answer = await self.link.ask(ask, unwanted=partial(unwanted, self.link))
        except LinkClosed:
            raise StoreUnavailable("the gateway's decider is not answering", unsent=True) from None
        if isinstance(answer, m.QuotaRefused):
            return Refusal(answer.tenant, answer.limit, answer.per_minute, answer.retry_after, answer.needed,
                           answer.never)
        return RemoteReservation(self.link, answer.reservation) if answer.reservation else None

    def admit_unchecked(self, tenant: Tenant, cost: Cost) -> Held:
        return _Unchecked()


class RemoteLedger:
    """The reconciliation's charges, sent to the decider's ``Reconciliation``."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def charged(self, name: str, prompt: int, completion: int, finished: int = 0) -> None:
        self.link.send(m.Charged(name, prompt, completion, finished))

    def unseen(self, name: str, tenant: str, n: int, prompt: int, completion: int, room: int) -> None:
        self.link.send(m.Unseen(name, tenant, n, prompt, completion, room))


class RemoteRecords:
    """The requests' records, sent to the decider's ring (``/admin/requests`` reads it there)."""

    def __init__(self, link: Link, enabled: bool) -> None:
        self.link = link
        self._enabled = enabled
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def add(self, record: Any) -> None:
        self.link.send(m.Record(msgspec.Raw(self._encoder.encode(record))))


class DeciderClient:
    """A worker's connection to the decider: it joins, gets the settings and the fleet, then hands every message
    to whom it concerns until the decider goes away (``lost`` is then set: the worker ends its streams and
    exits, as it could admit nothing more)."""

    def __init__(self, link: Link, worker: int) -> None:
        self.link = link
        self.worker = worker
        self.routing = RemoteRouting(link)
        self.settings: Any = None  # the decider's settings (Hello), then each reload's
        self.on_reload: Callable[[Any], None] | None = None
        self.on_drain: Callable[[], None] | None = None
        self.on_cut: Callable[[], None] | None = None
        self.lost = asyncio.Event()
        self._hello = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: Path, worker: int, timeout_seconds: float = 30.0) -> DeciderClient:
        """Join the decider at ``path``; returns once its settings and the fleet came."""
        reader, writer = await asyncio.open_unix_connection(str(path), limit=2**20)
        client = cls(Link(reader, writer, m.to_worker), worker)
        client._task = asyncio.get_running_loop().create_task(client._run())
        client.link.send(m.Join(worker))
        async with asyncio.timeout(timeout_seconds):
            await client._hello.wait()
            await client.routing.described.wait()
        return client

    async def _run(self) -> None:
        try:
            async for message in self.link.messages():
                if not self.link.answered(message):
                    self._handle(message)
        finally:
            self.lost.set()

    def _handle(self, message: Any) -> None:
        kind = type(message)
        if kind is m.Fleet:
            self.routing.update(message)
        elif kind is m.Hello:
            self.settings = pickle.loads(message.settings)  # noqa: S301 - our own decider, a 0600 socket
            self._hello.set()
        elif kind is m.Reload:
            self.settings = pickle.loads(message.settings)  # noqa: S301 - as above
            if self.on_reload is not None:
                self.on_reload(self.settings)
        elif kind is m.Drain:
            if self.on_drain is not None:
                self.on_drain()
        elif kind is m.Cut:
            if self.on_cut is not None:
                self.on_cut()
        else:
            unwanted(self.link, message)

    def report_open(self, count: int) -> None:
        self.link.send(m.Open(count))

    async def close(self) -> None:
        await self.link.drain()
        self.link.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

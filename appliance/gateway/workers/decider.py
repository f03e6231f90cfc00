"""The decider's side of the workers' socket: it answers their decisions with the one admission, router, quota
buckets and records the appliance has, so that limits, fair share, quotas and the slot audit stay exact however
many workers relay.

One ``WorkerSession`` per connected worker holds what the worker holds: its leases, its queued requests, its
quota reservations and its count of open requests. When the worker goes away (it crashed, or was stopped) its
leases are released and its queued requests leave the queue at once: the engines abort its requests as its
connections close, and nothing it held outlives it. Its reservations stay charged as reserved: what its requests
used is not known, and the reservation is their worst case.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from appliance.gateway.admission.queue import Admission
from appliance.gateway.admission.slots import Lease
from appliance.gateway.observation.records import RequestRecord, RequestRecords
from appliance.gateway.routing.kv_events.hook import IndexView
from appliance.gateway.routing.kv_events.tokens import PromptTokens
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.quota import Cost, Quotas, Refusal, Reservation
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.workers import messages as m
from appliance.gateway.workers.link import Link
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.http.errors import APIError

log = logging.getLogger(__name__)

FLEET_SECONDS = 0.25  # how often the workers' view of the replicas is refreshed when it changed


@dataclass(eq=False)  # one per connection, kept in a set by identity
class WorkerSession:
    """What one worker holds at the decider."""

    link: Link
    worker: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    acquiring: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    open: int = 0
    reported_at: float = 0.0  # monotonic: when the worker last said how many requests it has open


def _forget_task(acquiring: dict[int, asyncio.Task[None]], number: int, _done: asyncio.Task[None]) -> None:
    acquiring.pop(number, None)


class Decider:
    """Serves the workers' decisions from the appliance's own admission (and its router), quota buckets,
    reconciliation and records."""

    def __init__(self, admission: Admission, quotas: Quotas, reconciliation: Reconciliation,
                 records: RequestRecords, registry: MergedRegistry | None = None,
                 kv_events: IndexView | None = None) -> None:
        """``registry``: where the workers' metrics are summed in (None: they are dropped, as in tests).
        ``kv_events``: the engines' event indexes, with precise prefix routing (what the workers' tokenizing
        needs to know of them goes out with the fleet)."""
        self.admission = admission
        self.kv_events = kv_events
        self.registry = registry
        self.router: Router = admission.router
        self.quotas = quotas
        self.reconciliation = reconciliation
        self.records = records
        self.sessions: set[WorkerSession] = set()
        self._numbers = iter(range(1, 2**62))
        self._server: asyncio.AbstractServer | None = None
        self._fleet_task: asyncio.Task[None] | None = None
        self._fleet: m.Fleet | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._record_decoder = msgspec.msgpack.Decoder(RequestRecord)
        self.settings = b""  # the settings the workers get (pickled), set by the pool and on every reload
        self.draining_since: float | None = None  # monotonic: when the drain began

    # -- the socket -------------------------------------------------------------------------------------------------

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (a socket only this user can open: the settings a worker is sent hold secrets)."""
        path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, str(path), limit=2**20)
        finally:
            os.umask(old)
        self._fleet_task = asyncio.get_running_loop().create_task(self._refresh_fleet())

    async def stop(self) -> None:
        if self._fleet_task is not None:
            self._fleet_task.cancel()
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions):
            session.link.close()
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = WorkerSession(Link(reader, writer, m.to_decider))
        self.sessions.add(session)
        try:
            async for message in session.link.messages():
                self.handle(session, message)
        finally:
            self.sessions.discard(session)
            self.forget(session)

    def forget(self, session: WorkerSession) -> None:
        """The worker is gone: its leases come back, its queued requests leave the queue."""
        leases = len(session.leases)
        for task in session.acquiring.values():
            task.cancel()
        for lease in session.leases.values():
            lease.release(Outcome.ABORTED)
        session.leases.clear()
        session.open = 0
        if self.registry is not None:
            self.registry.retire(session.worker)
        if leases:
            log.warning("worker %d left holding %d slot(s); they are released", session.worker, leases)

    # -- what workers say --------------------------------------------------------------------------------------------

    def handle(self, session: WorkerSession, message: Any) -> None:
        """One message from a worker (public for tests: a session can be fed without a socket)."""
        kind = type(message)
        if kind is m.Join:
            session.worker = message.worker
            session.link.send(m.Hello(self.settings))
            session.link.send(self._fleet or self.fleet())
        elif kind is m.Release:
            lease = session.leases.pop(message.lease, None)
            if lease is not None:
                lease.release(Outcome(message.outcome), message.ttft_seconds)
        elif kind is m.Reclaimed:
            dropped = session.leases.get(message.lease)
            if dropped is not None:
                self.admission.ledger.on_reclaimed(dropped.replica)
        elif kind is m.FirstToken:
            held = session.leases.get(message.lease)
            if held is not None:
                held.first_token()
        elif kind is m.Acquire:
            task = asyncio.get_running_loop().create_task(self._acquire(session, message))
            session.acquiring[message.id] = task
            task.add_done_callback(partial(_forget_task, session.acquiring, message.id))
        elif kind is m.Cancel:
            queued = session.acquiring.get(message.id)
            if queued is not None:
                queued.cancel()
        elif kind is m.Charge:
            self.admission.charge(message.tenant, message.tokens)
        elif kind is m.Charged:
            self.reconciliation.charged(message.replica, message.prompt, message.completion, message.finished)
        elif kind is m.Unseen:
            self.reconciliation.unseen(message.replica, message.tenant, message.n, message.prompt,
                                       message.completion, message.room)
        elif kind is m.Reserve:
            self._reserve(session, message)
        elif kind is m.Settle:
            reservation = session.reservations.pop(message.reservation, None)
            if reservation is not None:
                reservation.refund() if message.used is None else reservation.settle(message.used)
        elif kind is m.Relayed:
            self._relayed(message.replicas)
        elif kind is m.EngineFailed:
            self.router.engine_failed(message.replica)
        elif kind is m.Record:
            self.records.add(self._record_decoder.decode(message.record))
        elif kind is m.Open:
            session.open, session.reported_at = message.count, time.monotonic()
        elif kind is m.Metrics and self.registry is not None:
            self.registry.push(session.worker, message.families)

    async def _acquire(self, session: WorkerSession, ask: m.Acquire) -> None:
        routing = RoutingRequest(ask.prompt, salt=ask.salt)
        if ask.token_ids is not None:
            routing.tokens = PromptTokens(ask.token_ids, ask.token_salt)
        exclude = frozenset(ask.exclude)
        try:
            if ask.background:
                lease = self.admission.acquire_idle(exclude, routing, tenant=ask.tenant)
            else:
                lease = await self.admission.acquire(exclude, routing, tenant=ask.tenant)
        except APIError as exc:
            session.link.send(m.Refused(ask.id, exc.status, exc.message, exc.code, exc.param, dict(exc.headers)))
            return
        if session.link.closed:  # the worker left while the request was queued
            lease.release(Outcome.ABORTED)
            return
        number = next(self._numbers)
        session.leases[number] = lease
        session.link.send(m.Granted(ask.id, number, lease.replica.name, self.admission.over_share(ask.tenant),
                                    routing.decision))

    def _reserve(self, session: WorkerSession, ask: m.Reserve) -> None:
        held = self.quotas.reserve(ask.tenant, Cost(ask.prompt, ask.completion, ask.requests))
        if isinstance(held, Refusal):
            session.link.send(m.QuotaRefused(ask.id, held.tenant, held.limit, held.per_minute, held.retry_after,
                                             held.needed, held.never))
            return
        number = 0
        if held is not None:
            number = next(self._numbers)
            session.reservations[number] = held
        session.link.send(m.Reserved(ask.id, number))

    def _relayed(self, names: Iterable[str]) -> None:
        wanted = set(names)
        for replica in self.router.replicas():
            if replica.name in wanted:
                self.router.note_relayed(replica)

    # -- what workers are told ---------------------------------------------------------------------------------------

    def broadcast(self, message: msgspec.Struct) -> None:
        for session in self.sessions:
            session.link.send(message)

    def reload(self, settings: object) -> None:
        """The settings changed (a hot reload): new workers get them, running ones apply them."""
        self.settings = pickle.dumps(settings)
        self.broadcast(m.Reload(self.settings))

    def drain(self) -> None:
        """The gateway drains: the workers refuse new requests, and each says at once what it has open."""
        self.draining_since = time.monotonic()
        self.broadcast(m.Drain())

    def open_requests(self) -> int:
        """Requests the workers have forwarded and not answered in full (the drain waits for them too). Once the
        drain began, a worker that has not yet answered it counts one: it may hold a request it has not told of."""
        since = self.draining_since
        return sum(session.open + (since is not None and session.reported_at < since) for session in self.sessions)

    def fleet(self) -> m.Fleet:
        """The replicas as the workers need them now."""
        eligible = {replica.name for replica in self.router.eligible()}
        loads = self.router.loads()
        kv = self.kv_events
        return m.Fleet([m.ReplicaView(r.name, r.url, r.routable, r.name in eligible, r.status.state.value,
                                      r.status.planned_restart,
                                      load.scheduling_policy if (load := loads.get(r.name)) is not None else None)
                        for r in self.router.replicas()],
                       kv_usable=kv is not None and kv.any_usable(),
                       block_sizes=sorted(kv.block_sizes()) if kv is not None else [])

    async def _refresh_fleet(self) -> None:
        while True:
            fleet = self.fleet()
            if fleet != self._fleet:
                self._fleet = fleet
                self.broadcast(fleet)
            await asyncio.sleep(FLEET_SECONDS)

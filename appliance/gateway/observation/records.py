"""The request record: why one request went where it went, and where its time went.

Metrics say how the fleet behaves; a user's complaint is about one request. For each request the gateway keeps a
record (filled by the request path as the request goes: admitted, each attempt, each break or migration, the
end) and adds it to a bounded ring when the request ends, where ``GET /admin/requests`` and ``appliance requests``
read it: the tenant, the admission wait, every attempt with the routing decision explained (the replicas
considered, the filter that removed each one left out, every scorer's value, the pick and what decided it), why an
attempt ended when it did not succeed, the migrations, TTFT and the end.

Memory is bounded by ``gateway.request_records`` (records; 0: none kept). Measured with tracemalloc over 10k
records, decisions included (CPython 3.11, one attempt, the default weighted policy with its 5 scorers, no
migration): 1.7 KB per record with 2 replicas, 2.4 KB with 8 (the scores are float objects, 5 per candidate), so
the default 1000 records hold 1.7 to 2.4 MB; each retry adds about one more decision. Records stay in memory only:
a restart forgets them, and a request still in flight is not listed yet.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway.routing.request import Decision

ID_MAX_CHARS = 128  # a client's x-request-id beyond this is cut: the ring's memory must not be the client's to set


def record_id(given: str | None = None) -> str:
    """The record's id: the client's x-request-id when it sent one (so the user's own id finds the record), else
    a short random one (12 hex digits: unique enough within a ring of a few thousand)."""
    if given is not None and (given := given.strip()):
        return given[:ID_MAX_CHARS]
    return os.urandom(6).hex()


@dataclass(slots=True)
class AttemptRecord:
    """One try of the request on one replica: the routing decision that sent it there and how it ended."""

    replica: str
    decision: Decision | None = None
    queue_wait_seconds: float = 0.0  # waited in the admission queue before this attempt (0: a replica had room)
    outcome: str | None = None  # appliance.gateway.routing.router.Outcome's value; None while it runs
    reason: str | None = None  # why it ended when it did not succeed: "retry: HTTP 503", "migrated: connection"
    started_at: float = field(default_factory=time.time)  # wall clock

    def to_json(self, arrived_at: float) -> dict[str, Any]:
        return {"replica": self.replica, "started_after_seconds": _seconds(self.started_at - arrived_at),
                "queue_wait_seconds": _seconds(self.queue_wait_seconds), "outcome": self.outcome,
                "reason": self.reason, "decision": None if self.decision is None else self.decision.to_json()}


@dataclass(slots=True)
class MigrationRecord:
    """A stream that broke and was continued elsewhere (or could not be): from where, to where, why."""

    from_replica: str
    to_replica: str | None  # None: no replica took the continuation
    reason: str  # appliance.gateway.migration's reasons: "connection", "drain", "engine_error" ...
    sent_tokens: int  # tokens the client had already been sent
    outcome: str  # "continued", "failed", "exhausted", "ineligible"

    def to_json(self) -> dict[str, Any]:
        return {"from_replica": self.from_replica, "to_replica": self.to_replica, "reason": self.reason,
                "sent_tokens": self.sent_tokens, "outcome": self.outcome}


@dataclass(slots=True)
class RequestRecord:
    """One request, from arrival to its end."""

    id: str
    route: str
    tenant: str | None = None
    stream: bool = False
    arrived_at: float = field(default_factory=time.time)  # wall clock
    queue_wait_seconds: float = 0.0  # all its waits in the admission queue together
    attempts: list[AttemptRecord] = field(default_factory=list)
    migrations: list[MigrationRecord] = field(default_factory=list)
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None
    status: int | None = None  # the HTTP status the client got
    outcome: str | None = None  # appliance.gateway.routing.router.Outcome's value for the request as a whole

    @property
    def replica(self) -> str | None:
        """The replica that answered last: where its last migration moved it, else its last attempt's replica.
        (Retries happen before the first byte, migrations after: the moves come last.)"""
        moved = next((m.to_replica for m in reversed(self.migrations) if m.to_replica is not None), None)
        if moved is not None:
            return moved
        return self.attempts[-1].replica if self.attempts else None

    @property
    def decision(self) -> Decision | None:
        """The routing decision of its last attempt that has one."""
        return next((a.decision for a in reversed(self.attempts) if a.decision is not None), None)

    def touched(self, replica: str) -> bool:
        """An attempt or a migration of this request went to (or came from) ``replica``."""
        return (any(a.replica == replica for a in self.attempts)
                or any(replica in (m.from_replica, m.to_replica) for m in self.migrations))

    def to_json(self) -> dict[str, Any]:
        decision = self.decision
        return {"id": self.id, "route": self.route, "tenant": self.tenant, "stream": self.stream,
                "arrived_at": self.arrived_at, "queue_wait_seconds": _seconds(self.queue_wait_seconds),
                "replica": self.replica, "decided_by": None if decision is None else decision.decided_by,
                "retries": max(0, len(self.attempts) - 1), "ttft_seconds": _seconds(self.ttft_seconds),
                "e2e_seconds": _seconds(self.e2e_seconds), "status": self.status, "outcome": self.outcome,
                "attempts": [a.to_json(self.arrived_at) for a in self.attempts],
                "migrations": [m.to_json() for m in self.migrations]}


def _seconds(value: float | None) -> float | None:
    """To the microsecond: what a reader can use, without float noise in the JSON."""
    return None if value is None else round(value, 6)


def status_matches(record: RequestRecord, wanted: str) -> bool:
    """``wanted`` is an HTTP status ("503"), a class of them ("5xx"), or an outcome ("aborted")."""
    if wanted.isdigit():
        return record.status == int(wanted)
    if len(wanted) == 3 and wanted[0].isdigit() and wanted[1:].lower() == "xx":
        return record.status is not None and record.status // 100 == int(wanted[0])
    return record.outcome == wanted


class RequestRecords:
    """The last ``capacity`` records, in a ring (``collections.deque(maxlen)``): each ``add`` past capacity drops
    the oldest, so memory never grows with traffic. Capacity 0 keeps nothing (``add`` does nothing)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self.capacity = capacity
        self._ring: deque[RequestRecord] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def add(self, record: RequestRecord) -> None:
        """The request ended: keep its record (the oldest goes when the ring is full)."""
        if self.capacity:
            self._ring.append(record)

    def recent(self, limit: int = 50, tenant: str | None = None, replica: str | None = None,
               min_seconds: float | None = None, status: str | int | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` records, newest first, JSON-ready: of ``tenant``; that went to (or were moved from)
        ``replica``; that took at least ``min_seconds`` end to end; whose status is ``status`` (503, "5xx", or
        an outcome such as "aborted")."""
        wanted = None if status is None else str(status)
        out: list[dict[str, Any]] = []
        for record in self._newest_first():
            if len(out) >= limit:
                break
            if ((tenant is None or record.tenant == tenant)
                    and (replica is None or record.touched(replica))
                    and (min_seconds is None or (record.e2e_seconds or 0.0) >= min_seconds)
                    and (wanted is None or status_matches(record, wanted))):
                out.append(record.to_json())
        return out

    def get(self, id: str) -> dict[str, Any] | None:
        """The newest record with this id (a client may reuse its x-request-id), JSON-ready; None if not held."""
        return next((record.to_json() for record in self._newest_first() if record.id == id), None)

    def _newest_first(self) -> Iterator[RequestRecord]:
        return reversed(self._ring)

"""The request record as a hook: why a request went where it went, and where its time went.

It fills one ``RequestRecord`` as the request goes (each attempt with its routing decision, why an attempt ended,
each migration, the first byte, the end), adds it to the bounded ring that ``/admin/requests`` reads, names the
replica and the deciding reason in the response headers of every answer the engine produced (``x-appliance-
replica``, ``x-appliance-decided-by``), and puts the same facts on the request's span. Per event it does one
comparison (the first byte); everything else happens once per attempt or per request.
"""

from __future__ import annotations

import time

from appliance.gateway.decisions import RecordSink
from appliance.gateway.observation.records import (
    AttemptRecord,
    MigrationRecord,
    RequestRecord,
    record_id,
)
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Attempt, Block, End, RequestHook

MIGRATED = "migrated: "  # the prefix of the reason an attempt ends with when its stream moves on


class Recording:
    """The hook: built once with the ring the admin view reads. With capacity 0 it touches no request."""

    name = "record"

    def __init__(self, records: RecordSink) -> None:
        self.records = records

    def start(self, exchange: Exchange) -> RecordedRequest | None:
        if not self.records.enabled:
            return None
        record = RequestRecord(id=record_id(exchange.headers.get("x-request-id")), route=exchange.route,
                               tenant=exchange.tenant.name, stream=exchange.stream,
                               arrived_at=time.time() - (time.monotonic() - exchange.arrived))
        return RecordedRequest(self.records, exchange, record)


class RecordedRequest(RequestHook):
    """One request's record, filled as it goes."""

    __slots__ = ("records", "exchange", "record", "first")

    def __init__(self, records: RecordSink, exchange: Exchange, record: RequestRecord) -> None:
        self.records = records
        self.exchange = exchange
        self.record = record
        self.first: float | None = None  # monotonic: the first byte relayed to the client

    def queued(self, seconds: float) -> None:
        self.record.queue_wait_seconds += seconds

    def admitted(self, attempt: Attempt) -> None:
        record = self.record
        if record.migrations and record.migrations[-1].to_replica is None:
            record.migrations[-1].to_replica = attempt.replica  # the continuation found its replica
        record.attempts.append(AttemptRecord(attempt.replica, attempt.decision, attempt.queue_wait))
        root = self.exchange.trace.root
        if attempt.decision is not None:
            root.set_attribute("appliance.routing.removed", [f"{r}:{f}" for r, f in attempt.decision.removed])

    def responding(self, attempt: Attempt, headers: dict[str, str]) -> None:
        """The answer names its record, so a user's report can quote it, and what decided its replica."""
        headers["x-appliance-request-id"] = self.record.id
        if attempt.decision is not None:
            headers["x-appliance-decided-by"] = attempt.decision.decided_by

    def attempt_ended(self, attempt: Attempt) -> None:
        if not self.record.attempts:
            return
        last = self.record.attempts[-1]
        last.outcome = None if attempt.outcome is None else attempt.outcome.value
        last.reason = attempt.reason
        if attempt.reason is not None and attempt.reason.startswith(MIGRATED):
            self.record.migrations.append(MigrationRecord(attempt.replica, None, attempt.reason[len(MIGRATED):],
                                                          attempt.sent_tokens, "continued"))

    def relayed(self, block: Block) -> None:
        if self.first is None and (block.events or not self.exchange.stream):
            self.first = block.at

    def finished(self, end: End) -> None:
        record, exchange = self.record, self.exchange
        record.status, record.outcome = end.status, end.outcome.value
        record.e2e_seconds = end.at - exchange.arrived
        if self.first is not None:
            record.ttft_seconds = self.first - exchange.arrived
        if record.migrations and record.migrations[-1].to_replica is None or record.migrations and end.status >= 400:
            record.migrations[-1].outcome = "failed"
        if record.attempts and record.attempts[-1].outcome is None:
            record.attempts[-1].outcome = end.outcome.value
        self.records.add(record)
        root = exchange.trace.root
        root.set_attribute("appliance.request.id", record.id)
        root.set_attribute("appliance.attempts", len(record.attempts))
        root.set_attribute("appliance.migrations", len(record.migrations))


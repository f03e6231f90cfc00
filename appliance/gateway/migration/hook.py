"""Migration as a hook: a stream that breaks after its first byte is continued on another replica from the exact
token where it broke, in the same client stream, instead of ending with an error event.

With ``routing.migration_limit`` > 0, a stream that can be continued faithfully (``migration.refusal``) asks the
engine for token ids and keeps a ledger of what the client was sent (``migration.StreamLedger``, fed whole events
on the relay's side). At a break (connection reset or closed before [DONE], idle timeout, the engine's own 5xx
error event, a drain that timed out) the hook places the continuation: the broken replica's slot is settled (as a
failure) before the next replica's is taken, so the continuation holds one slot at a time, never on a replica
that already failed it. A non-streaming request whose answer broke mid-body is sent again, whole, by the
transport within the same budget; this hook counts what came of it.
"""

from __future__ import annotations

import logging
from typing import Protocol

import aiohttp
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from appliance.gateway.admission.slots import Lease
from appliance.gateway.migration import ledger as migration
from appliance.gateway.observation.metrics import RequestMetrics
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.failures import (
    SHUTDOWN_EVENT,
    UPSTREAM_ERRORS,
    RetryableUpstreamError,
    describe,
    error_event,
    failure_outcome,
    never_reached_engine,
    request_outlived,
    upstream_failure,
)
from appliance.gateway.upstream.hook import Attempt, Block, Break, End, RequestHook, Resolution, StreamBreak
from appliance.gateway.upstream.labels import client_label
from appliance.gateway.upstream.sse import split_events
from appliance.http.errors import APIError

log = logging.getLogger(__name__)


class Placement(Protocol):
    """What the hook asks of the transport to place a continuation: a slot (waiting, up to the queue timeout, for
    a replica when none is eligible right now) and the request sent on it."""

    max_attempts: int

    async def admit_patiently(self, exchange: Exchange, kind: str) -> Lease: ...

    async def post(self, exchange: Exchange, path: str, body: bytes) -> aiohttp.ClientResponse: ...


class Migration:
    """The hook: built once with the request metrics, the budget and the transport that places continuations."""

    name = "migration"

    def __init__(self, metrics: RequestMetrics, *, limit: int, max_model_len: int | None) -> None:
        self.metrics = metrics
        self.limit = limit  # routing.migration_limit: continuations per request
        self.max_model_len = max_model_len  # engine.max_model_len: what a continuation's prompt may grow to
        self.placement: Placement | None = None  # the transport, once built (it takes the hooks first)

    def start(self, exchange: Exchange) -> MigratingRequest | None:
        if self.limit <= 0:
            return None
        exchange.migration_limit = self.limit
        ledger, refused = None, None
        if exchange.stream:
            body = exchange.parsed()
            if body is not None:
                refused = migration.refusal(exchange.route, body)
                if refused is None:
                    ledger = migration.StreamLedger(exchange.route, body, max_model_len=self.max_model_len)
                    exchange.body = migration.with_token_ids(exchange.body)
        assert self.placement is not None, "Migration.placement not set"
        return MigratingRequest(self.metrics, self.placement, exchange, ledger, refused)


class _Pending:
    """A continuation placed after a break, until its first event is relayed (or it fails)."""

    __slots__ = ("route", "reason", "broke_at", "span")

    def __init__(self, route: str, reason: str, broke_at: float, span: trace.Span) -> None:
        self.route, self.reason, self.broke_at, self.span = route, reason, broke_at, span

    def continued(self, metrics: RequestMetrics, now: float) -> None:
        metrics.migrations.labels(self.reason, migration.CONTINUED).inc()
        metrics.migration_added_seconds.labels(self.route).observe(now - self.broke_at)
        self.span.set_attribute("appliance.migration.added_seconds", now - self.broke_at)
        self.span.end()

    def failed(self, metrics: RequestMetrics) -> None:
        metrics.migrations.labels(self.reason, migration.FAILED).inc()
        self.span.set_status(trace.StatusCode.ERROR)
        self.span.end()


class MigratingRequest(RequestHook):
    """One request's migration: its ledger (streams that can be continued), or why it cannot be."""

    __slots__ = ("metrics", "placement", "exchange", "ledger", "refused", "pending", "rerun", "frames")

    def __init__(self, metrics: RequestMetrics, placement: Placement, exchange: Exchange,
                 ledger: migration.StreamLedger | None, refused: str | None) -> None:
        self.metrics = metrics
        self.placement = placement
        self.exchange = exchange
        self.ledger = ledger
        self.refused = refused  # why its stream could not be continued, if it could not
        self.pending: _Pending | None = None  # a continuation placed, waiting for its first event
        self.rerun: str | None = None  # a non-streaming answer broke: the reason its re-run is for
        self.frames = ledger is not None

    # -- decisions: re-runs of non-streaming answers ---------------------------------------------------------------

    def attempt_ended(self, attempt: Attempt) -> None:
        if attempt.reason is None or not attempt.reason.startswith("rerun: "):
            return
        if self.rerun is not None:
            self.metrics.migrations.labels(self.rerun, migration.FAILED).inc()
        self.rerun = attempt.reason.removeprefix("rerun: ")

    def finished(self, end: End) -> None:
        if self.rerun is not None:
            outcome = migration.CONTINUED if end.answered else migration.FAILED
            self.metrics.migrations.labels(self.rerun, outcome).inc()
        if self.pending is not None:
            self.pending.span.end()

    # -- relay ----------------------------------------------------------------------------------------------------

    def relayed(self, block: Block) -> None:
        """Whole events through the ledger: ids the client did not ask for stripped, a continuation's events
        rewritten into the client's stream, an engine's error event or abort turned into a break."""
        ledger = self.ledger
        if ledger is None or not block.raw:
            return
        fast = ledger.accept_block(block.raw)
        if fast is not None:
            block.out = fast
            return
        out: list[bytes] = []
        for event in split_events(block.raw):
            if not event.endswith(b"\n\n"):
                break  # the stream ended mid-event: never half an event to the client
            try:
                sent = ledger.accept(event)
            except StreamBreak as exc:
                block.broke = exc
                break
            if self.pending is not None:
                self.pending.continued(self.metrics, block.at)
                self.pending = None
            out.append(sent)
            if ledger.aborted:
                ledger.aborted = False
                block.broke = StreamBreak(migration.ENGINE_ERROR, "the engine aborted the request")
                break
        block.out = out[0] if len(out) == 1 else b"".join(out)

    def leg_closed(self) -> None:
        if self.ledger is not None and not self.ledger.done:
            raise StreamBreak(migration.CONNECTION, "the engine closed the stream before [DONE]")

    async def broke(self, brk: Break) -> Resolution | None:
        if self.ledger is None:
            return self._refused(brk)
        if self.pending is not None:  # the continuation broke before its first event
            self.pending.failed(self.metrics)
            self.pending = None
        ledger, exchange, exc = self.ledger, self.exchange, brk.error
        failed = failure_outcome(exc)  # an engine's error event: SERVER_ERROR, judged by the shape breaker
        if ledger.finished():  # only the closing events were lost: the answer is whole
            exchange.settle(failed)
            return Resolution(ledger.closing(), Outcome.SUCCESS, 200)
        why = self._cannot_continue(brk)
        if why is not None:
            return Resolution(self._error(exc, brk.reason, why), failed,
                              504 if isinstance(exc, TimeoutError) else 502)
        log.warning("%s failed mid-stream (%s: %s) after %d token(s); continuing elsewhere",
                    brk.replica, brk.reason, describe(exc), len(ledger.sent_ids))
        exchange.end_attempt(failed, f"migrated: {brk.reason}", len(ledger.sent_ids))
        exchange.settle(failed)  # the broken replica's slot and connection, before the next slot
        exchange.tried.add(brk.replica)
        exchange.migrations += 1
        moved: dict[str, AttributeValue] = {"appliance.migration.reason": brk.reason,
                                            "appliance.migration.from": brk.replica,
                                            "appliance.migration.sent_tokens": len(ledger.sent_ids)}
        pending = _Pending(exchange.route, brk.reason, brk.at,
                           exchange.trace.child("gateway.continuation", trace.SpanKind.CLIENT, **moved))
        try:
            await self._continue(ledger, pending)
        except (APIError, RetryableUpstreamError, *UPSTREAM_ERRORS) as error:
            pending.failed(self.metrics)
            if isinstance(error, APIError) and error.code == "shutting_down":  # cut while it waited
                return Resolution(SHUTDOWN_EVENT, Outcome.ABORTED, 503)
            return Resolution(self._error(exc, brk.reason, f"no replica could continue it ({_for_client(error)})"),
                              Outcome.FAILURE, 502)
        self.pending = pending
        return Resolution(resumed=True)

    def _refused(self, brk: Break) -> Resolution | None:
        """A stream refused up front: it ends with an error event that says why it was not continued."""
        if self.refused is None:
            return None
        error, outcome = upstream_failure(brk.error), failure_outcome(brk.error)
        log.warning("%s failed mid-stream: %s", brk.replica, type(brk.error).__name__)
        message = f"upstream replica failed mid-stream: {error.message}"
        if outcome is Outcome.FAILURE:
            self.metrics.migrations.labels(brk.reason, migration.INELIGIBLE).inc()
            message += f"; not continued elsewhere: {self.refused}"
        return Resolution(error_event(error, message), outcome, error.status)

    def _cannot_continue(self, brk: Break) -> str | None:
        """Why a broken stream is not continued (None: it is): the whole-request timeout is the request's own
        length; the budget; what the ledger could not record."""
        assert self.ledger is not None
        if request_outlived(brk.error):
            return "it outlived request_timeout_seconds"
        exchange = self.exchange
        if exchange.migrations >= exchange.migration_limit:
            self.metrics.migrations.labels(brk.reason, migration.EXHAUSTED).inc()
            return f"routing.migration_limit ({exchange.migration_limit}) reached"
        if not self.ledger.continuable():
            self.metrics.migrations.labels(brk.reason, migration.INELIGIBLE).inc()
            return "the engine did not report the token ids sent"
        return None

    def _error(self, exc: BaseException, reason: str, why: str) -> bytes:
        error = upstream_failure(exc)
        log.warning("stream of %s not continued (%s): %s", self.exchange.route, reason, why)
        return error_event(error, f"upstream replica failed mid-stream: {error.message}; "
                                  f"not continued elsewhere: {why}")

    async def _continue(self, ledger: migration.StreamLedger, pending: _Pending) -> None:
        """Place the rest of a broken stream on another replica: a slot (queueing like any request, never on a
        replica that already failed it), then the continuation request. A connection that fails before reaching
        the engine (a pooled connection the engine had just closed, seen on a real restart) is tried again, like
        any request's, up to the transport's ``max_attempts``."""
        exchange, placement = self.exchange, self.placement
        replayed = len(ledger.prompt_ids or []) + len(ledger.sent_ids) if ledger.started else 0
        for attempt in range(1, placement.max_attempts + 1):
            await placement.admit_patiently(exchange, "continuation")
            path, body = ledger.continuation()  # after the hooks saw the replica (its priority is in the body)
            replica = exchange.replica
            pending.span.set_attribute("appliance.migration.to", replica.name)
            pending.span.set_attribute("appliance.migration.replayed_tokens", replayed)
            try:
                upstream = await placement.post(exchange, path, body)
            except UPSTREAM_ERRORS as exc:
                exchange.settle(failure_outcome(exc))
                exchange.end_attempt(failure_outcome(exc), f"continuation failed: {type(exc).__name__}")
                if not never_reached_engine(exc) or attempt == placement.max_attempts:
                    raise
                log.warning("%s: continuation failed before reaching the engine (%s); trying again", replica.name,
                            type(exc).__name__)
                continue
            if upstream.status != 200:
                status = upstream.status
                detail = (await upstream.read())[:300].decode(errors="replace")
                exchange.settle(Outcome.FAILURE if status >= 500 else Outcome.CLIENT_ERROR)
                exchange.end_attempt(Outcome.FAILURE, f"continuation refused: HTTP {status}")
                log.warning("%s answered a continuation with HTTP %d: %s", replica.name, status, detail)
                raise APIError(502, f"{client_label(replica.name)} answered the continuation with HTTP {status}")
            self.metrics.migration_replayed_tokens.inc(replayed)
            return
        raise AssertionError("unreachable")


def _for_client(error: BaseException) -> str:
    """Why a continuation could not be placed, in words a client may read: the gateway's own answer, or the kind
    of connection failure (never its text: aiohttp's names the engine's internal address)."""
    return error.message if isinstance(error, APIError) else type(error).__name__

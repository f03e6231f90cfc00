"""Forwarding one request to a replica: bodies pass through as bytes, streams chunk by chunk, no buffering.

Retry rule: a request goes to another replica only when the failed one cannot still be working on it, so that
no request is ever run twice or charged to two replicas: the connection could not be made (refused, connect
timeout), the engine closed or reset it without answering (vLLM aborts a request whose connection is gone), or it
answered 502/503 (it refused the work). Never after a timeout once connected (the engine may still be generating:
the client gets a 504), never on a 504 answer (a timeout somewhere behind it, same reason), never once the
response headers arrived, and never back to a replica that already failed this request. Once the first byte is
out, a failure ends the stream with an error event instead.

Ownership: the ``Exchange`` holds the request's slot lease and its upstream response until it hands both to the
``RelayedStream`` that serves a stream; whatever the exchange still holds when ``forward`` ends (the client left,
an error, a cancellation at any await, a response built but never returned) is settled there, in one place. The
stream settles what it holds when it is served, including when its body was never iterated.

Timeouts: a request that outlives ``request_timeout_seconds`` is the request's own length (a long max_tokens),
not the replica's fault, so it does not count toward ejection; connect and idle-read timeouts do.

Migration (``appliance.gateway.migration``): with ``routing.migration_limit`` > 0, a stream that breaks after its
first byte (connection reset or closed before [DONE], idle timeout, the engine's own 5xx error event, a drain that
timed out) is continued on another replica from the exact token where it broke, in the same client stream,
instead of ending with an error event. The continuation runs under the same exchange and holds one slot at a
time: the broken replica's lease is settled (as a failure) before the next replica's is taken. A non-streaming
request whose answer broke mid-body is sent again, whole, to another replica: nothing of it reached the client.

Tenants (``appliance.gateway.tenants``): the tenant's quotas are checked before the request queues (429
``rate_limit_exceeded`` with Retry-After); its answer, latency and the engines' usage are counted per tenant, and
the usage corrects the quota's and fair share's charges at the end. A stream whose client did not ask for usage
asks the engine for it, and the relay hides that event (framing whole events to do so), so the client's bytes are
those it would have had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from starlette.types import Receive, Scope, Send

from appliance.engine.contract import Replica, ReplicaState
from appliance.gateway import migration
from appliance.gateway.admission import Admission
from appliance.gateway.metrics import COUNTED, RequestMetrics
from appliance.gateway.router import Outcome
from appliance.gateway.routing import RoutingRequest
from appliance.gateway.slots import Lease
from appliance.gateway.tenants.accounting import USAGE, HiddenUsage, TenantAccounting, Usage, ask_for_usage, final_usage
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import Quotas, estimate_prompt_tokens
from appliance.gateway.tracing import RequestTrace
from appliance.http.errors import APIError, error_body

log = logging.getLogger(__name__)

# Headers worth carrying to the engine; the client's Authorization is the gateway's business, not vLLM's.
FORWARDED_HEADERS = ("content-type", "x-request-id")
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
RETRYABLE_STATUS = frozenset({502, 503})
UPSTREAM_KEEPALIVE_SECONDS = 4.0
CONTINUATION_RETRY_SECONDS = 0.1  # how often a continuation that found no replica looks again
# What a stream still open at the drain timeout ends with, instead of a silent cut when the server stops.
SHUTDOWN_EVENT = ("data: " + json.dumps(error_body(
    503, "the gateway is shutting down; the stream was cut at the drain timeout", code="shutting_down")) + "\n\n"
).encode()
T = TypeVar("T")


class RetryableUpstreamError(Exception):
    """The replica failed before it could have done any work; another replica may take the request.
    ``stale``: the connection dropped without an answer, as a pooled keep-alive connection that the engine closed
    does; the same replica may take the request on a new connection."""

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


def dropped_connection(exc: BaseException) -> bool:
    """An established connection dropped without an answer (not a refused connect, not a timeout): what reusing a
    keep-alive connection the engine has just closed looks like. A gateway whose loop runs late can miss its own
    idle-connection deadline (UPSTREAM_KEEPALIVE_SECONDS) and reuse one; a CI run on a loaded host saw a stream's
    continuation get 502 that way, the only other replica being restarted."""
    return (isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            and not isinstance(exc, aiohttp.ClientConnectorError))


class RerunElsewhere(RetryableUpstreamError):
    """A non-streaming answer broke mid-body (the engine died): nothing reached the client, so the whole request
    is sent again to another replica, within the migration budget rather than the retry attempts."""


def never_reached_engine(exc: BaseException) -> bool:
    """Whether an upstream failure left no work behind on the engine, so that a retry duplicates nothing."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # the connection was never made
        return True
    if isinstance(exc, asyncio.TimeoutError):  # connected and sent: the engine may still be generating
        return False
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                            ConnectionError))


def failure_outcome(exc: BaseException) -> Outcome:
    """How a failed upstream call judges the replica: the whole-request timeout measures the request (its
    max_tokens), not the replica; connect and idle-read timeouts (aiohttp's ServerTimeoutError) and broken
    connections do."""
    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ServerTimeoutError):
        return Outcome.TIMED_OUT
    return Outcome.FAILURE


def upstream_failure(exc: BaseException) -> APIError:
    """The client's answer to a failure that is not retried."""
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(504, f"the replica did not answer in time ({type(exc).__name__}); not retried, since it "
                             "may still be working on the request", code="upstream_timeout")
    return APIError(502, f"upstream failed: {type(exc).__name__}", code="upstream_error")


@dataclass(eq=False)  # one object per request, compared and hashed by identity (Upstream.open_requests)
class Exchange:
    """One client request on its way through the gateway."""

    route: str
    path: str
    body: bytes
    stream: bool
    arrived: float  # monotonic
    headers: dict[str, str]
    trace: RequestTrace
    request: Request
    tried: set[str] = field(default_factory=set)
    routing: RoutingRequest | None = None  # the prompt, for prefix affinity
    dispatched: float = 0.0  # monotonic: when a replica was assigned (after any gateway queueing)
    lease: Lease | None = None  # the slot of the current attempt, until settled
    upstream: aiohttp.ClientResponse | None = None  # the current attempt's response, until settled
    handed_off: bool = False  # a RelayedStream owns the lease and upstream from here on
    counted: bool = False  # the request's outcome is counted (once)
    migration_limit: int = 0  # continuations this request may be given (routing.migration_limit; 0: none)
    migrations: int = 0  # continuations it was given
    ledger: migration.StreamLedger | None = None  # a migratable stream's record of what the client was sent
    refused: str | None = None  # why its stream could not be continued, if it could not
    tenant: Tenant = DEFAULT_TENANT  # whose request (the API key's tenant; appliance.gateway.tenants)
    hidden_usage: HiddenUsage | None = None  # the gateway asked the engine for usage the client did not ask for
    usage: Usage | None = None  # what the engines reported (every leg of a continued stream), once known
    charged: int = 0  # tokens charged to the tenant's quota so far (estimate, then one per streamed event)

    def to_client(self, events: bytes) -> bytes:
        """Whole events on their way to the client, less the usage event it did not ask for."""
        return events if self.hidden_usage is None else self.hidden_usage.feed(events)

    def held_back(self) -> bytes:
        """What ``to_client`` still holds (the stream ends or breaks here)."""
        return b"" if self.hidden_usage is None else self.hidden_usage.flush()

    def reported(self, usage: dict[str, Any] | None) -> None:
        """One engine usage report for this request (a continued stream has one per leg)."""
        found = Usage.of(usage)
        if found is not None:
            self.usage = found if self.usage is None else self.usage + found

    @property
    def replica(self) -> Replica:
        assert self.lease is not None, "no replica assigned"
        return self.lease.replica

    def settle(self, outcome: Outcome, ttft_seconds: float | None = None) -> None:
        """Give back what the current attempt holds: the upstream connection (kept for reuse only after a
        complete answer; closing it makes vLLM abort the request) and the slot. Safe to call any number of times."""
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if outcome is Outcome.SUCCESS or outcome is Outcome.CLIENT_ERROR:
                upstream.release()
            else:
                upstream.close()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release(outcome, ttft_seconds)


class Upstream:
    """One pooled HTTP client for all replicas, plus admission, retries, metrics and spans around it."""

    def __init__(self, admission: Admission, metrics: RequestMetrics, tracer: trace.Tracer, *,
                 timeout_seconds: float, tracing: bool, max_attempts: int = 2,
                 idle_timeout_seconds: float | None = None, accounting: TenantAccounting | None = None,
                 quotas: Quotas | None = None, migration_limit: int = 0, max_model_len: int | None = None,
                 connect_timeout_seconds: float = 5.0) -> None:
        self.admission = admission
        self.migration_limit = migration_limit  # routing.migration_limit: continuations per request (0: none)
        self.max_model_len = max_model_len  # engine.max_model_len: what a continuation's prompt may grow to
        self.metrics = metrics
        self.accounting = accounting  # per-tenant metrics (None: not kept, and streams are relayed untouched)
        self.quotas = quotas
        self.tracer = tracer
        self.tracing = tracing
        self.max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=connect_timeout_seconds)
        # Streams also get an idle-read timeout: a silent engine must not hold a slot for the whole request
        # timeout. Not for non-streaming requests: their answer comes in one piece at the end of the generation.
        self._stream_timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=connect_timeout_seconds,
                                                     sock_read=idle_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._streams: set[aiohttp.ClientResponse] = set()  # streams being relayed
        # Every request forwarded and not yet answered in full: queued, at a replica, or between two replicas (a
        # continuation or a retry waiting for one, which holds no slot and is in no queue). Weak, with the same
        # backstop as a lease: a stream response dropped unserved is forgotten when it is collected.
        self._open: weakref.WeakSet[Exchange] = weakref.WeakSet()
        self._cut: set[aiohttp.ClientResponse] = set()  # ...that the gateway cut on purpose (shutdown)
        self._waiting: set[Exchange] = set()  # requests between two replicas, waiting for the next one
        self._shutting_down = False  # set by cut_streams: what waits for a replica now ends instead

    async def open(self) -> None:
        # Idle upstream connections are dropped before vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)
        # closes them: reusing a connection the engine just closed fails the request for nothing.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS), auto_decompress=False
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def open_requests(self) -> int:
        """Requests forwarded whose answer has not ended: what a drain waits for. Unlike the router's slots, it
        counts a stream whose continuation waits for a replica."""
        return len(self._open)

    async def cut_streams(self, grace_seconds: float = 2.0) -> int:
        """End every stream still being relayed with an error event saying the gateway is shutting down (the
        drain's last step, instead of a silent cut when the server stops); wait up to ``grace_seconds`` for the
        events to go out. Returns how many streams were cut. A request waiting between two replicas (a
        continuation, or a retry, waiting for one) is ended too: it stops waiting and answers with an error."""
        self._shutting_down = True
        streams = list(self._streams)
        waiting = len(self._waiting)
        for upstream in streams:
            self._cut.add(upstream)
            upstream.close()  # the relay's read ends; it sees the cut and writes the error event
        deadline = time.monotonic() + grace_seconds
        while (self._streams or self._waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(streams) + waiting

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool,
                      arrived: float, prompt: str | None = None) -> Response:
        exchange = Exchange(route=route, path=path, body=body, stream=stream, arrived=arrived,
                            headers={k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))},
                            trace=RequestTrace(self.tracer, route, request.headers, recording=self.tracing),
                            request=request, routing=None if prompt is None else RoutingRequest(prompt),
                            tenant=getattr(request.state, "tenant", DEFAULT_TENANT))
        self._open.add(exchange)
        self._ask_for_usage(exchange)
        self._plan_migration(exchange)
        try:
            self._check_quota(exchange, prompt)
            response = await unless_client_leaves(self._forward_with_retry(exchange), request.receive)
            if isinstance(response, RelayedStream):
                exchange.handed_off = True  # the stream serves the rest and settles it
            else:
                self._finish(exchange, response.status_code)
            return response
        except ClientGone:
            self._finish(exchange, 499)
            return Response(status_code=499)  # nobody reads it; the status is for the gateway's own logs
        except APIError as exc:
            self._finish(exchange, exc.status)
            raise
        except BaseException:
            self._finish(exchange, 499)  # cancelled: the client went away
            raise
        finally:
            if not exchange.handed_off:  # whatever happened, nothing outlives the request unowned
                exchange.settle(Outcome.ABORTED)
                self._open.discard(exchange)

    def _check_quota(self, exchange: Exchange, prompt: str | None) -> None:
        """The tenant's quotas, before the request queues: a 429 with Retry-After when spent; else one request
        taken and the prompt's estimate charged (the engine's usage corrects it at the end)."""
        if self.quotas is None:
            return
        estimate = estimate_prompt_tokens(prompt)
        refusal = self.quotas.admit(exchange.tenant, estimate)
        if refusal is None:
            exchange.charged = estimate
            return
        if self.accounting is not None:
            self.accounting.limited(exchange.tenant.name, refusal.limit)
        raise APIError(429, refusal.message, code="rate_limit_exceeded",
                       headers={"Retry-After": str(refusal.retry_after)})

    def _charge_streamed(self, exchange: Exchange, tokens: int) -> None:
        """Completion tokens as they stream (one per event), so a long stream spends its quota while it runs."""
        if self.quotas is not None and tokens > 0:
            self.quotas.charge(exchange.tenant, tokens)
            exchange.charged += tokens

    def _ask_for_usage(self, exchange: Exchange) -> None:
        """A stream whose client did not ask for usage asks the engine for it anyway (accounting counts what the
        engine reports), and hides it from the client."""
        if self.accounting is None or not exchange.stream:
            return
        try:
            body = json.loads(exchange.body)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        asked = ask_for_usage(exchange.body, body)
        if asked is not None:
            exchange.body = asked
            exchange.hidden_usage = HiddenUsage()

    def _plan_migration(self, exchange: Exchange) -> None:
        """Whether this request's stream may be continued elsewhere; if so, ask the engine for token ids."""
        if self.migration_limit <= 0:
            return
        exchange.migration_limit = self.migration_limit
        if not exchange.stream:
            return  # a broken non-streaming answer is simply sent again (RerunElsewhere)
        try:
            body = json.loads(exchange.body)
        except ValueError:
            return
        exchange.refused = migration.refusal(exchange.route, body)
        if exchange.refused is None:
            exchange.ledger = migration.StreamLedger(exchange.route, body,
                                                     max_model_len=self.max_model_len)
            exchange.body = migration.with_token_ids(exchange.body)

    async def _forward_with_retry(self, exchange: Exchange) -> Response:
        last_error = "no attempt"
        attempts = 0
        rerun: str | None = None  # a non-streaming answer broke: the reason its re-run is for
        patient = False  # a retry whose only other replicas are ejected for now waits for one (_admit_patiently)
        dropped: set[str] = set()  # replicas that dropped a connection unanswered once: each gets one more try
        while attempts < self.max_attempts:
            exchange.lease = await (self._admit_patiently(exchange) if patient else self._admit(exchange))
            replica = exchange.replica
            try:
                response = await self._send(exchange)
            except RerunElsewhere as exc:
                if rerun is not None:
                    self.metrics.migrations.labels(rerun, migration.FAILED).inc()
                rerun = migration.DRAIN if _draining(replica) else migration.CONNECTION
                exchange.tried.add(replica.name)
                last_error = str(exc)
                log.warning("%s failed mid-answer (%s); running the request again elsewhere", replica.name, exc)
                if not self.admission.router.any_eligible(exchange.tried):
                    break
                continue
            except RetryableUpstreamError as exc:
                last_error = str(exc)
                if exc.stale and replica.name not in dropped:
                    dropped.add(replica.name)  # likely a stale pooled connection, not the replica: once more
                    log.warning("%s dropped the connection before answering (%s); trying it once more",
                                replica.name, exc)
                    continue
                attempts += 1
                exchange.tried.add(replica.name)
                log.warning("%s failed before first byte (%s); retrying elsewhere", replica.name, exc)
                if not self.admission.router.any_eligible(exchange.tried):
                    if not self._routable_besides(exchange.tried):
                        break
                    patient = True  # e.g. the engine died while the other replica sat out a TTFT ejection
                continue
            except BaseException:
                if rerun is not None:
                    self.metrics.migrations.labels(rerun, migration.FAILED).inc()
                raise
            if rerun is not None:
                self.metrics.migrations.labels(rerun, migration.CONTINUED).inc()
            return response
        if rerun is not None:
            self.metrics.migrations.labels(rerun, migration.FAILED).inc()
        raise APIError(502, f"upstream failed: {last_error}", code="upstream_error")

    async def _admit(self, exchange: Exchange) -> Lease:
        span = exchange.trace.child("gateway.queue_wait")
        queued_at = time.monotonic()
        try:
            lease = await self.admission.acquire(frozenset(exchange.tried), exchange.routing, tenant=exchange.tenant)
            exchange.dispatched = time.monotonic()
        finally:
            waited = time.monotonic() - queued_at
            self.metrics.queue_wait.observe(waited)
            if self.accounting is not None:
                self.accounting.queue_wait.labels(exchange.tenant.name).observe(waited)
            span.end()
        exchange.trace.root.set_attribute("appliance.replica", lease.replica.name)
        if exchange.routing is not None and exchange.routing.decision is not None:
            exchange.trace.root.set_attribute("appliance.routing.score", exchange.routing.decision.score)
            exchange.trace.root.set_attribute("appliance.routing.decided_by", exchange.routing.decision.decided_by)
        return lease

    async def _send(self, exchange: Exchange) -> Response:
        assert self._session is not None, "Upstream.open() not called"
        replica = exchange.replica
        span = exchange.trace.child("gateway.upstream", trace.SpanKind.CLIENT, **{"appliance.replica": replica.name})
        headers = exchange.trace.propagate(span, dict(exchange.headers))
        try:
            exchange.upstream = await self._session.post(
                replica.url + exchange.path, data=exchange.body, headers=headers,
                timeout=self._stream_timeout if exchange.stream else self._timeout)
        except UPSTREAM_ERRORS as exc:
            span.end()
            exchange.settle(failure_outcome(exc))
            if never_reached_engine(exc):
                raise RetryableUpstreamError(type(exc).__name__, stale=dropped_connection(exc)) from exc
            raise upstream_failure(exc) from exc
        except BaseException:
            span.end()
            raise  # forward() settles the attempt
        upstream = exchange.upstream
        if upstream.status in RETRYABLE_STATUS:
            span.end()
            exchange.settle(Outcome.FAILURE)
            raise RetryableUpstreamError(f"HTTP {upstream.status}")
        if exchange.stream and upstream.status == 200:
            relay = self._relay_migrating if exchange.ledger is not None else self._relay
            return RelayedStream(
                relay(exchange, span), exchange, on_served=self._served,
                status_code=200,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-appliance-replica": replica.name},
            )
        return await self._read_whole(exchange, span)

    def _served(self, exchange: Exchange) -> None:
        """A stream response is over, however it ended. Most often its relay settled and counted it already; if
        it was never iterated (the client left between the upstream's headers and the first byte), that is done
        here."""
        exchange.settle(Outcome.ABORTED)
        self._finish(exchange, 499)
        self._open.discard(exchange)

    async def _read_whole(self, exchange: Exchange, span: trace.Span) -> Response:
        upstream, replica = exchange.upstream, exchange.replica
        assert upstream is not None
        try:
            content = await upstream.read()
        except UPSTREAM_ERRORS as exc:  # failed mid-body
            exchange.settle(failure_outcome(exc))
            # The connection broke (the engine died): its work is gone and the client has nothing, so the request
            # runs again elsewhere, within the migration budget. Not after a timeout: that engine may still be
            # generating, and the work would be done twice.
            if (not isinstance(exc, asyncio.TimeoutError) and exchange.migrations < exchange.migration_limit
                    and self.admission.router.any_eligible(exchange.tried | {replica.name})):
                exchange.migrations += 1
                raise RerunElsewhere(type(exc).__name__) from exc
            raise upstream_failure(exc) from exc
        finally:
            span.end()  # a cancellation (the client left) is settled by forward(): the engine request is aborted
        outcome = Outcome.SUCCESS if upstream.status < 400 else Outcome.CLIENT_ERROR
        if upstream.status >= 500:
            outcome = Outcome.FAILURE
        exchange.settle(outcome)
        if outcome is Outcome.SUCCESS:
            usage = _usage(content)
            self.metrics.observe_usage(usage)
            exchange.reported(usage)
        return Response(content=content, status_code=upstream.status,
                        media_type=upstream.headers.get("content-type", "application/json"),
                        headers={"x-appliance-replica": replica.name})

    async def _relay(self, exchange: Exchange, span: trace.Span) -> AsyncIterator[bytes]:
        """Yield the engine's SSE bytes as they arrive; a client disconnect closes the upstream connection,
        which makes vLLM abort the request."""
        upstream, replica = exchange.upstream, exchange.replica
        assert upstream is not None
        outcome, status = Outcome.ABORTED, 499
        first = last = None
        chunks = 0
        tail = b""
        stream_span = exchange.trace.child("gateway.stream")
        # Raw chunks pass as they come, unless a usage event must be hidden: then whole events (one may be split
        # across chunks), so that event can be taken out.
        events = migration.SSEEvents() if exchange.hidden_usage is not None else None
        self._streams.add(upstream)
        try:
            async for chunk in upstream.content.iter_any():
                now = time.monotonic()
                if first is None:
                    first = now
                    span.add_event("first_token")
                    span.end()
                elif last is not None:  # set together with first
                    self.metrics.itl.labels(exchange.route).observe(now - last)
                last = now
                self.admission.router.note_relayed(replica)
                sent = chunk.count(b"data: ")
                chunks += sent
                self._charge_streamed(exchange, sent)
                tail = (tail + chunk)[-2048:]  # usage and [DONE] may come in two chunks
                if events is not None:
                    chunk = exchange.to_client(events.feed_block(chunk))
                    if not chunk:
                        continue
                yield chunk
            if events is not None:
                rest, events = exchange.held_back() + events.pending, None
                if rest:
                    yield rest
            if upstream in self._cut:
                raise aiohttp.ClientConnectionError("cut by the gateway")
            outcome, status = Outcome.SUCCESS, 200
        except UPSTREAM_ERRORS as exc:
            if events is not None and (rest := exchange.held_back() + events.pending):
                yield rest
            if upstream in self._cut:  # not the replica's fault: the gateway is shutting down
                outcome, status = Outcome.ABORTED, 503
                yield SHUTDOWN_EVENT
                return
            error = upstream_failure(exc)
            outcome, status = failure_outcome(exc), error.status
            log.warning("%s failed mid-stream: %s", replica.name, type(exc).__name__)
            message = f"upstream replica failed mid-stream: {error.message}"
            if exchange.refused is not None and outcome is Outcome.FAILURE:
                self.metrics.migrations.labels(_break_reason(exc, replica), migration.INELIGIBLE).inc()
                message += f"; not continued elsewhere: {exchange.refused}"
            yield f"data: {json.dumps(error_body(error.status, message, code=error.code))}\n\n".encode()
        finally:
            self._streams.discard(upstream)
            self._cut.discard(upstream)
            exchange.reported(_final_usage_in(tail))
            self._end_stream(exchange, stream_span, first=first, replica_first=first, last=last, chunks=chunks,
                             tail=tail, outcome=outcome, status=status)

    async def _relay_migrating(self, exchange: Exchange, span: trace.Span) -> AsyncIterator[bytes]:
        """``_relay`` for a stream that may be continued elsewhere: whole events are relayed (so the ledger knows
        exactly which tokens the client has), token ids the client did not ask for are stripped, and a break is
        answered by a continuation on another replica, up to ``migration_limit`` times."""
        ledger = exchange.ledger
        assert ledger is not None
        outcome, status = Outcome.ABORTED, 499
        first = last = leg_first = None
        chunks = 0
        tail = b""
        stream_span = exchange.trace.child("gateway.stream")
        pending: _Pending | None = None  # a continuation placed, waiting for its first event
        itl = self.metrics.itl.labels(exchange.route)  # looked up once, not per event
        try:
            while True:
                upstream, replica = exchange.upstream, exchange.replica
                assert upstream is not None
                events = migration.SSEEvents()
                self._streams.add(upstream)
                try:
                    async for chunk in upstream.content.iter_any():
                        self.admission.router.note_relayed(replica)
                        # The whole events of one read go to the client together, one ASGI message and one write
                        # instead of one per event: a loaded gateway reads several at a time, and a write per
                        # event was much of the relay's cost, paid by every request's first token (issue 25).
                        # A break mid-read still sends the client the events before it, first.
                        batch: list[bytes] = []
                        broke: migration.StreamBreak | None = None
                        for event in events.feed(chunk):
                            if USAGE in event and (final := final_usage(event)) is not None:
                                exchange.reported(final["usage"])  # as the engine reported it, every leg
                            try:
                                out = ledger.accept(event)
                            except migration.StreamBreak as exc:
                                broke = exc
                                break
                            now = time.monotonic()
                            if leg_first is None:
                                leg_first = now
                                span.add_event("first_token")
                                span.end()
                                if pending is not None:
                                    pending.continued(self.metrics, now)
                                    pending = None
                            if first is None:
                                first = now
                            elif last is not None:  # set together with first
                                itl.observe(now - last)
                            last = now
                            chunks += 1
                            self._charge_streamed(exchange, 1)
                            tail = (tail + out)[-2048:]  # whole events one by one: usage and [DONE] are two
                            if out := exchange.to_client(out):
                                batch.append(out)
                            if ledger.aborted:
                                ledger.aborted = False
                                broke = migration.StreamBreak(migration.ENGINE_ERROR, "the engine aborted the request")
                                break
                        if batch:
                            yield batch[0] if len(batch) == 1 else b"".join(batch)
                        if broke is not None:
                            raise broke
                    if upstream in self._cut:
                        raise aiohttp.ClientConnectionError("cut by the gateway")
                    if not ledger.done:
                        raise migration.StreamBreak(migration.CONNECTION, "the engine closed the stream before "
                                                    "[DONE]")
                    outcome, status = Outcome.SUCCESS, 200
                    return
                except (migration.StreamBreak, *UPSTREAM_ERRORS) as exc:
                    if held := exchange.held_back():  # a finish held for a usage event that never came
                        yield held
                    if upstream in self._cut:  # not the replica's fault: the gateway is shutting down
                        outcome, status = Outcome.ABORTED, 503
                        yield SHUTDOWN_EVENT
                        return
                    if pending is not None:  # the continuation broke before its first event
                        pending.failed(self.metrics)
                        pending = None
                    if ledger.finished():  # only the closing events were lost: the answer is whole
                        exchange.settle(Outcome.FAILURE)
                        out = ledger.closing()
                        tail = (tail + out)[-2048:]  # whole events one by one: usage and [DONE] are two
                        if out := exchange.to_client(out):
                            yield out
                        outcome, status = Outcome.SUCCESS, 200
                        return
                    failed = _failed_outcome(exc)
                    reason = _break_reason(exc, replica)
                    why = self._cannot_continue(exchange, ledger, exc)
                    if why is not None:
                        outcome, status = failed, 504 if isinstance(exc, asyncio.TimeoutError) else 502
                        yield self._stream_error(exchange, exc, reason, why)
                        return
                    broke_at = time.monotonic()
                    log.warning("%s failed mid-stream (%s: %s) after %d token(s); continuing elsewhere",
                                replica.name, reason, _describe(exc), len(ledger.sent_ids))
                    exchange.settle(failed)  # the broken replica's slot and connection, before the next slot
                    self._streams.discard(upstream)  # no longer relayed: a cut now ends the wait instead
                    exchange.tried.add(replica.name)
                    exchange.migrations += 1
                    moved: dict[str, AttributeValue] = {"appliance.migration.reason": reason,
                                                        "appliance.migration.from": replica.name,
                                                        "appliance.migration.sent_tokens": len(ledger.sent_ids)}
                    pending = _Pending(exchange.route, reason, replica.name, broke_at,
                                       exchange.trace.child("gateway.continuation", trace.SpanKind.CLIENT, **moved))
                    try:
                        span = await self._continue(exchange, ledger, pending)
                    except (APIError, RetryableUpstreamError, *UPSTREAM_ERRORS) as error:
                        pending.failed(self.metrics)
                        pending = None
                        if isinstance(error, APIError) and error.code == "shutting_down":  # cut while it waited
                            outcome, status = Outcome.ABORTED, 503
                            yield SHUTDOWN_EVENT
                            return
                        outcome, status = Outcome.FAILURE, 502
                        yield self._stream_error(exchange, exc, reason, f"no replica could continue it "
                                                 f"({_describe(error)})")
                        return
                    leg_first = None
                finally:
                    self._streams.discard(upstream)
                    self._cut.discard(upstream)
        finally:
            if pending is not None:
                pending.span.end()
            self._end_stream(exchange, stream_span, first=first, replica_first=leg_first, last=last,
                             chunks=chunks, tail=tail, outcome=outcome, status=status)

    def _end_stream(self, exchange: Exchange, stream_span: trace.Span, *, first: float | None,
                    replica_first: float | None, last: float | None, chunks: int, tail: bytes, outcome: Outcome,
                    status: int) -> None:
        """Both relays' last step: settle the slot, end the span, observe, log. ``replica_first``: the first event
        from the replica that answered last (a continuation's own leg). The replica is judged on its own time to
        first token: gateway queueing is admission's doing, and feeding it back would cut the limit because of
        the queue, queue more, and cut again."""
        ttft = None if first is None else first - exchange.arrived
        replica_ttft = None if replica_first is None else replica_first - exchange.dispatched
        exchange.settle(outcome, replica_ttft if outcome is Outcome.SUCCESS else None)
        stream_span.end()
        self._observe_stream(exchange, ttft, first, last, chunks, tail, outcome)
        self._finish(exchange, status)

    def _cannot_continue(self, exchange: Exchange, ledger: migration.StreamLedger, exc: BaseException
                         ) -> str | None:
        """Why a broken stream is not continued (None: it is): the whole-request timeout is the request's own
        length; the budget; what the ledger could not record; no replica left to take it."""
        if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ServerTimeoutError):
            return "it outlived request_timeout_seconds"
        reason = _break_reason(exc, exchange.replica)
        if exchange.migrations >= exchange.migration_limit:
            self.metrics.migrations.labels(reason, migration.EXHAUSTED).inc()
            return f"routing.migration_limit ({exchange.migration_limit}) reached"
        if not ledger.continuable():
            self.metrics.migrations.labels(reason, migration.INELIGIBLE).inc()
            return "the engine did not report the token ids sent"
        return None

    def _routable_besides(self, tried: set[str]) -> bool:
        """Whether a replica not yet tried is in routing (ejected or not): one worth waiting for."""
        return any(r.routable and r.name not in tried for r in self.admission.router.replicas())

    async def _admit_patiently(self, exchange: Exchange) -> Lease:
        """A slot for a continuation. Right after an engine dies, the only other replica may be ejected (a TTFT
        outlier, say) while the dead one still counts as routable and healthy, so the router does not panic and
        finds no replica at all; a moment later the dead one is ejected or out of routing and the router panics,
        or the ejection ends. A new request would get its 503 at once; a stream already half-sent is worth
        waiting for, up to the queue timeout, like a queued request."""
        deadline = time.monotonic() + self.admission.queue_timeout_seconds
        self._waiting.add(exchange)
        try:
            while not self._shutting_down:
                try:
                    return await self._admit(exchange)
                except APIError as exc:
                    if exc.code != "no_ready_replica" or time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(CONTINUATION_RETRY_SECONDS)
            raise APIError(503, "the gateway is shutting down (drain timeout)", code="shutting_down")
        finally:
            self._waiting.discard(exchange)

    def _stream_error(self, exchange: Exchange, exc: BaseException, reason: str, why: str) -> bytes:
        error = upstream_failure(exc) if not isinstance(exc, migration.StreamBreak) else \
            APIError(502, f"upstream failed: {exc.detail}", code="upstream_error")
        log.warning("stream of %s not continued (%s): %s", exchange.route, reason, why)
        message = f"upstream replica failed mid-stream: {error.message}; not continued elsewhere: {why}"
        return f"data: {json.dumps(error_body(error.status, message, code=error.code))}\n\n".encode()

    async def _continue(self, exchange: Exchange, ledger: migration.StreamLedger, pending: _Pending) -> trace.Span:
        """Place the rest of a broken stream on another replica: a slot (queueing like any request, never on a
        replica that already failed it), then the continuation request. A connection that fails before reaching
        the engine (a pooled connection the engine had just closed, seen on a real restart) is tried again, like
        any request's, up to ``max_attempts``. Returns the continuation's upstream span."""
        assert self._session is not None, "Upstream.open() not called"
        path, body = ledger.continuation()
        replayed = len(ledger.prompt_ids or []) + len(ledger.sent_ids) if ledger.started else 0
        for attempt in range(1, self.max_attempts + 1):
            exchange.lease = await self._admit_patiently(exchange)
            replica = exchange.replica
            pending.span.set_attribute("appliance.migration.to", replica.name)
            pending.span.set_attribute("appliance.migration.replayed_tokens", replayed)
            span = exchange.trace.child("gateway.upstream", trace.SpanKind.CLIENT,
                                        **{"appliance.replica": replica.name})
            headers = exchange.trace.propagate(span, dict(exchange.headers, **{"content-type": "application/json"}))
            try:
                exchange.upstream = await self._session.post(replica.url + path, data=body, headers=headers,
                                                             timeout=self._stream_timeout)
            except BaseException as exc:
                span.end()
                if not isinstance(exc, UPSTREAM_ERRORS):
                    raise
                exchange.settle(failure_outcome(exc))
                if not never_reached_engine(exc) or attempt == self.max_attempts:
                    raise
                log.warning("%s: continuation failed before reaching the engine (%s); trying again", replica.name,
                            type(exc).__name__)
                continue
            if exchange.upstream.status != 200:
                span.end()
                status = exchange.upstream.status
                detail = (await exchange.upstream.read())[:300].decode(errors="replace")
                exchange.settle(Outcome.FAILURE if status >= 500 else Outcome.CLIENT_ERROR)
                raise APIError(502, f"{replica.name} answered the continuation with HTTP {status}: {detail}")
            self.metrics.migration_replayed_tokens.inc(replayed)
            return span
        raise AssertionError("unreachable")

    def _observe_stream(self, exchange: Exchange, ttft: float | None, first: float | None, last: float | None,
                        chunks: int, tail: bytes, outcome: Outcome) -> None:
        if outcome is not Outcome.SUCCESS or ttft is None:
            return
        self.metrics.ttft.labels(exchange.route).observe(ttft)
        if self.accounting is not None:
            self.accounting.ttft.labels(exchange.tenant.name).observe(ttft)
        usage = _stream_usage(tail)
        self.metrics.observe_usage(usage)
        # Tokens from the engine's usage report when the client asked for it, else one per content event
        # (vLLM streams one token per event; the final "[DONE]" is not one).
        tokens = (usage or {}).get("completion_tokens") or max(0, chunks - 1)
        if tokens > 1 and last is not None and first is not None:
            self.metrics.tpot.labels(exchange.route).observe((last - first) / (tokens - 1))

    def _finish(self, exchange: Exchange, status: int) -> None:
        if exchange.counted:
            return
        exchange.counted = True
        exchange.request.scope[COUNTED] = True  # the error handlers must not count it again
        self.metrics.requests.labels(exchange.route, str(status)).inc()
        if status < 400:
            self.metrics.e2e.labels(exchange.route).observe(time.monotonic() - exchange.arrived)
        self._account(exchange, status)
        exchange.trace.finish(status)

    def _account(self, exchange: Exchange, status: int) -> None:
        """The tenant's answer and usage; its quota and fair-share charges corrected to what the engines reported
        (a usage never reported leaves the charges as they were: the estimate and the events streamed)."""
        tenant, usage = exchange.tenant, exchange.usage
        if self.accounting is not None:
            self.accounting.answered(tenant.name, status)
            if usage is not None:
                self.accounting.used(tenant.name, usage)
        if usage is None:
            return
        if self.quotas is not None:
            self.quotas.charge(tenant, usage.total - exchange.charged)
            exchange.charged = usage.total
        self.admission.charge(tenant, usage.total)


@dataclass
class _Pending:
    """A continuation placed after a break, until its first event is relayed (or it fails)."""

    route: str
    reason: str
    source: str  # the replica that failed
    broke_at: float  # monotonic
    span: trace.Span

    def continued(self, metrics: RequestMetrics, now: float) -> None:
        metrics.migrations.labels(self.reason, migration.CONTINUED).inc()
        metrics.migration_added_seconds.labels(self.route).observe(now - self.broke_at)
        self.span.set_attribute("appliance.migration.added_seconds", now - self.broke_at)
        self.span.end()

    def failed(self, metrics: RequestMetrics) -> None:
        metrics.migrations.labels(self.reason, migration.FAILED).inc()
        self.span.set_status(trace.StatusCode.ERROR)
        self.span.end()


def _draining(replica: Replica) -> bool:
    status = getattr(replica, "status", None)
    return status is not None and (status.planned_restart or status.state in (ReplicaState.DRAINING,
                                                                             ReplicaState.STOPPING))


def _break_reason(exc: BaseException, replica: Replica) -> str:
    """The label of a break: a replica being drained or restarted explains any break; then the break itself."""
    if _draining(replica):
        return migration.DRAIN
    if isinstance(exc, migration.StreamBreak):
        return exc.reason
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return migration.IDLE_TIMEOUT
    return migration.CONNECTION


def _failed_outcome(exc: BaseException) -> Outcome:
    return Outcome.FAILURE if isinstance(exc, migration.StreamBreak) else failure_outcome(exc)


def _describe(exc: BaseException) -> str:
    return exc.detail if isinstance(exc, migration.StreamBreak) else (str(exc) or type(exc).__name__)


class RelayedStream(StreamingResponse):
    """A streamed answer that owns its exchange's lease and upstream connection once ``forward`` hands it over, and
    settles them when it has been served, however that ended: the relay settles them itself when it ran; a body
    that was never iterated (the client left before the first byte) or a relay left suspended at a ``yield``
    (closed here, so its own cleanup runs now, not whenever the garbage collector gets to it) is settled here."""

    def __init__(self, content: AsyncIterator[bytes], exchange: Exchange, *,
                 on_served: Callable[[Exchange], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.exchange = exchange
        self._on_served = on_served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_served(self.exchange)  # settles and counts it, unless the relay did

    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        """Starlette's ``StreamingResponse.__call__`` for uvicorn (ASGI spec < 2.4, whose ``send`` drops what a gone
        client is sent without a word): stream, and stop as soon as the client disconnects, so that the relay
        closes the upstream connection and the engine aborts the request. Starlette runs the two in an anyio task
        group (a cancel scope, a second task, a task repr per cancel), which cost every stream more CPU than the
        relay of its first token, on the path of every other request's first token too (issue 25). Here the
        stream runs in this task and one plain watcher task cancels it when the client leaves."""
        streaming = asyncio.current_task()
        assert streaming is not None
        done = left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            if not done:
                left = True
                streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left or streaming.uncancel() > 0:  # not (only) the watcher's cancel: someone else's
                raise
        finally:
            done = True
            watcher.cancel()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T:
    """Run ``work`` (queue wait, upstream request, non-streaming body) while watching the client; if it hangs up
    first, cancel the work and raise ClientGone. Cancelling closes the upstream connection, which makes vLLM abort
    the request, and takes a queued request out of the queue, so work nobody will read is neither done nor
    dispatched. Once a stream starts, Starlette's response notices the disconnect instead.

    The request body is already read, so the only ASGI message that can arrive now is the disconnect.

    The work runs in the caller's task and the watcher cancels it: no task of its own for the work and no
    ``asyncio.wait`` (a request's path to its first token is short; each task and wait on it costs the first token
    of every request queued behind it on the event loop: issue 25)."""
    task = asyncio.current_task()
    assert task is not None
    done = left = False

    async def watch() -> None:
        nonlocal left
        await receive()
        if not done:  # the work is still running (it cannot have finished: it would have set done)
            left = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # only the watcher's cancel: the client left, the work is cancelled
            raise ClientGone from None
        raise  # this handler itself was cancelled
    finally:
        done = True
        watcher.cancel()


def _usage(content: bytes) -> dict[str, Any] | None:
    try:
        usage: dict[str, Any] | None = json.loads(content).get("usage")
        return usage
    except (ValueError, AttributeError):
        return None


def _final_usage_in(tail: bytes) -> dict[str, Any] | None:
    """The usage of the final usage event in a stream's tail (not a running total on a content chunk)."""
    for line in reversed(tail.split(b"\n")):
        if USAGE in line and (final := final_usage(line)) is not None:
            usage: dict[str, Any] = final["usage"]
            return usage
    return None


def _stream_usage(tail: bytes) -> dict[str, Any] | None:
    """The usage object of the last data event before [DONE], present when the client asked for it."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return _usage(line[6:])
    return None

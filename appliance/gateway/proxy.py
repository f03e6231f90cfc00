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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from appliance.engine.contract import Replica
from appliance.gateway.admission import Admission
from appliance.gateway.metrics import COUNTED, RequestMetrics
from appliance.gateway.router import Outcome
from appliance.gateway.routing import RoutingRequest
from appliance.gateway.slots import Lease
from appliance.gateway.tracing import RequestTrace
from appliance.http.errors import APIError, error_body

log = logging.getLogger(__name__)

# Headers worth carrying to the engine; the client's Authorization is the gateway's business, not vLLM's.
FORWARDED_HEADERS = ("content-type", "x-request-id")
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
RETRYABLE_STATUS = frozenset({502, 503})
UPSTREAM_KEEPALIVE_SECONDS = 4.0
T = TypeVar("T")


class RetryableUpstreamError(Exception):
    """The replica failed before it could have done any work; another replica may take the request."""


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


@dataclass
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
                 idle_timeout_seconds: float | None = None) -> None:
        self.admission = admission
        self.metrics = metrics
        self.tracer = tracer
        self.tracing = tracing
        self.max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5)
        # Streams also get an idle-read timeout: a silent engine must not hold a slot for the whole request
        # timeout. Not for non-streaming requests: their answer comes in one piece at the end of the generation.
        self._stream_timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5,
                                                     sock_read=idle_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._streams: set[aiohttp.ClientResponse] = set()  # streams being relayed
        self._cut: set[aiohttp.ClientResponse] = set()  # ...that the gateway cut on purpose (shutdown)

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

    async def cut_streams(self, grace_seconds: float = 2.0) -> int:
        """End every stream still being relayed with an error event saying the gateway is shutting down (the
        drain's last step, instead of a silent cut when the server stops); wait up to ``grace_seconds`` for the
        events to go out. Returns how many streams were cut."""
        streams = list(self._streams)
        for upstream in streams:
            self._cut.add(upstream)
            upstream.close()  # the relay's read ends; it sees the cut and writes the error event
        deadline = time.monotonic() + grace_seconds
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(streams)

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool,
                      arrived: float, prompt: str | None = None) -> Response:
        exchange = Exchange(route=route, path=path, body=body, stream=stream, arrived=arrived,
                            headers={k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))},
                            trace=RequestTrace(self.tracer, route, request.headers, recording=self.tracing),
                            request=request, routing=None if prompt is None else RoutingRequest(prompt))
        try:
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

    async def _forward_with_retry(self, exchange: Exchange) -> Response:
        last_error = "no attempt"
        for _ in range(self.max_attempts):
            exchange.lease = await self._admit(exchange)
            replica = exchange.replica
            try:
                return await self._send(exchange)
            except RetryableUpstreamError as exc:
                exchange.tried.add(replica.name)
                last_error = str(exc)
                log.warning("%s failed before first byte (%s); retrying elsewhere", replica.name, exc)
                if not self.admission.router.any_eligible(exchange.tried):
                    break
        raise APIError(502, f"upstream failed: {last_error}", code="upstream_error")

    async def _admit(self, exchange: Exchange) -> Lease:
        span = exchange.trace.child("gateway.queue_wait")
        queued_at = time.monotonic()
        try:
            lease = await self.admission.acquire(frozenset(exchange.tried), exchange.routing)
            exchange.dispatched = time.monotonic()
        finally:
            self.metrics.queue_wait.observe(time.monotonic() - queued_at)
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
                raise RetryableUpstreamError(type(exc).__name__) from exc
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
            return RelayedStream(
                self._relay(exchange, span), exchange, on_unserved=self._unserved,
                status_code=200,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-appliance-replica": replica.name},
            )
        return await self._read_whole(exchange, span)

    def _unserved(self, exchange: Exchange) -> None:
        """A stream response that ended before its relay could settle (never iterated: the client left between
        the upstream's headers and the first byte)."""
        exchange.settle(Outcome.ABORTED)
        self._finish(exchange, 499)

    async def _read_whole(self, exchange: Exchange, span: trace.Span) -> Response:
        upstream, replica = exchange.upstream, exchange.replica
        assert upstream is not None
        try:
            content = await upstream.read()
        except UPSTREAM_ERRORS as exc:  # failed mid-body: the engine did the work, so it is not sent again
            exchange.settle(failure_outcome(exc))
            raise upstream_failure(exc) from exc
        finally:
            span.end()  # a cancellation (the client left) is settled by forward(): the engine request is aborted
        outcome = Outcome.SUCCESS if upstream.status < 400 else Outcome.CLIENT_ERROR
        if upstream.status >= 500:
            outcome = Outcome.FAILURE
        exchange.settle(outcome)
        if outcome is Outcome.SUCCESS:
            self.metrics.observe_usage(_usage(content))
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
        self._streams.add(upstream)
        try:
            async for chunk in upstream.content.iter_any():
                now = time.monotonic()
                if first is None:
                    first = now
                    span.add_event("first_token")
                    span.end()
                else:
                    self.metrics.itl.labels(exchange.route).observe(now - last)
                last = now
                self.admission.router.note_relayed(replica.name)
                chunks += chunk.count(b"data: ")
                tail = chunk[-2048:]
                yield chunk
            if upstream in self._cut:
                raise aiohttp.ClientConnectionError("cut by the gateway")
            outcome, status = Outcome.SUCCESS, 200
        except UPSTREAM_ERRORS as exc:
            if upstream in self._cut:  # not the replica's fault: the gateway is shutting down
                outcome, status = Outcome.ABORTED, 503
                message = "the gateway is shutting down; the stream was cut at the drain timeout"
                yield f"data: {json.dumps(error_body(503, message, code='shutting_down'))}\n\n".encode()
                return
            error = upstream_failure(exc)
            outcome, status = failure_outcome(exc), error.status
            log.warning("%s failed mid-stream: %s", replica.name, type(exc).__name__)
            message = f"upstream replica failed mid-stream: {error.message}"
            yield f"data: {json.dumps(error_body(error.status, message, code=error.code))}\n\n".encode()
        finally:
            self._streams.discard(upstream)
            self._cut.discard(upstream)
            ttft = None if first is None else first - exchange.arrived
            # The replica is judged on its own time to first token: gateway queueing is admission's doing, and
            # feeding it back would cut the limit because of the queue, queue more, and cut again.
            replica_ttft = None if first is None else first - exchange.dispatched
            exchange.settle(outcome, replica_ttft if outcome is Outcome.SUCCESS else None)
            stream_span.end()
            self._observe_stream(exchange, ttft, first, last, chunks, tail, outcome)
            self._finish(exchange, status)

    def _observe_stream(self, exchange: Exchange, ttft: float | None, first: float | None, last: float | None,
                        chunks: int, tail: bytes, outcome: Outcome) -> None:
        if outcome is not Outcome.SUCCESS or ttft is None:
            return
        self.metrics.ttft.labels(exchange.route).observe(ttft)
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
        exchange.trace.finish(status)


class RelayedStream(StreamingResponse):
    """A streamed answer that owns its exchange's lease and upstream connection once ``forward`` hands it over, and
    settles them when it has been served, however that ended: the relay settles them itself when it ran; a body
    that was never iterated (the client left before the first byte) or a relay left suspended at a ``yield``
    (closed here, so its own cleanup runs now, not whenever the garbage collector gets to it) is settled here."""

    def __init__(self, content: AsyncIterator[bytes], exchange: Exchange, *,
                 on_unserved: Callable[[Exchange], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.exchange = exchange
        self._on_unserved = on_unserved

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_unserved(self.exchange)  # a no-op when the relay settled and counted it


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T:
    """Run ``work`` (queue wait, upstream request, non-streaming body) while watching the client; if it hangs up
    first, cancel the work and raise ClientGone. Cancelling closes the upstream connection, which makes vLLM abort
    the request, and takes a queued request out of the queue, so work nobody will read is neither done nor
    dispatched. Once a stream starts, Starlette's response notices the disconnect instead.

    The request body is already read, so the only ASGI message that can arrive now is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        task.cancel()
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
    if task.done():  # finished first, or at the same moment as the disconnect: the response handles the rest
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


def _usage(content: bytes) -> dict | None:
    try:
        return json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None


def _stream_usage(tail: bytes) -> dict | None:
    """The usage object of the last data event before [DONE], present when the client asked for it."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return _usage(line[6:])
    return None

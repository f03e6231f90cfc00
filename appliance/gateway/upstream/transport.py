"""Forwarding one request to a replica: a slot, one pooled connection, the retry rule, and whole events relayed.

This is the transport and nothing else. Bodies pass through as bytes and streams as they are read, no buffering;
what else a request goes through (tenant metering, migration, observation, the request record) is a hook
(``appliance.gateway.upstream.hook``), started per request in the order the composition root declares. The retry
rule is ``appliance.gateway.upstream.failures``; ownership of the slot and the connection is
``appliance.gateway.upstream.exchange``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import Response

from appliance.engine.contract import Replica
from appliance.gateway.admission.slots import Lease
from appliance.gateway.decisions import AdmissionState
from appliance.gateway.migration import ledger as migration
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.upstream.client import ClientGone, RelayedStream, unless_client_leaves
from appliance.gateway.upstream.exchange import Exchange, Hook
from appliance.gateway.upstream.failures import (
    ENGINE_ERROR_REASON,
    RETRYABLE_STATUS,
    SHUTDOWN_EVENT,
    UPSTREAM_ERRORS,
    ConfirmElsewhere,
    RerunElsewhere,
    RetryableUpstreamError,
    answer_outcome,
    break_reason,
    draining,
    dropped_connection,
    error_event,
    error_message,
    failure_outcome,
    never_reached_engine,
    once_more,
    upstream_failure,
)
from appliance.gateway.upstream.hook import Block, Break, End, HookChain, Resolution, StreamBreak
from appliance.gateway.upstream.sse import SSEEvents
from appliance.http.errors import APIError

log = logging.getLogger(__name__)

# Headers worth carrying to the engine; the client's Authorization is the gateway's business, not vLLM's.
FORWARDED_HEADERS = ("content-type", "x-request-id")
UPSTREAM_KEEPALIVE_SECONDS = 4.0
CONTINUATION_RETRY_SECONDS = 0.1  # how often a request waiting between two replicas looks again


class Upstream:
    """One pooled HTTP client for all replicas: admission, the retry rule and the relay, with the hooks around."""

    def __init__(self, admission: AdmissionState, hooks: Sequence[Hook], *, timeout_seconds: float,
                 idle_timeout_seconds: float | None = None, connect_timeout_seconds: float = 5.0,
                 max_attempts: int = 2, engine_headers: Mapping[str, str] | None = None) -> None:
        """``engine_headers``: sent to the engines on every request, after the hooks' (the engine key's
        Authorization: engines refuse everyone else)."""
        self.admission = admission
        self.engine_headers = dict(engine_headers or {})
        self.hooks = tuple(hooks)
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

    # -- one request ----------------------------------------------------------------------------------------------

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool,
                      arrived: float, prompt: str | None = None, background: bool = False,
                      parsed: dict[str, Any] | None = None) -> Response:
        """``background``: batch work (appliance.batch), admitted on idle capacity only and never queued.
        ``parsed``: ``body`` as the caller parsed it, given away (the hooks read and change it), so it is not
        parsed twice; None: parsed here when a hook first reads it."""
        exchange = Exchange(route=route, path=path, body=body, stream=stream, arrived=arrived,
                            headers={k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))},
                            request=request, routing=RoutingRequest(prompt or ""),
                            tenant=getattr(request.state, "tenant", DEFAULT_TENANT), background=background,
                            parsed_body=parsed)
        self._open.add(exchange)
        try:
            exchange.hooks = HookChain([h for hook in self.hooks if (h := hook.start(exchange)) is not None])
            pending = exchange.hooks.arrived()
            if pending is not None:  # a hook's check needs a round trip (the shared quota store)
                await pending
            response = await unless_client_leaves(self._forward_with_retry(exchange), request.receive)
            if isinstance(response, RelayedStream):
                exchange.handed_off = True  # the stream serves the rest and settles it
            else:
                self._finish(exchange, response.status_code, Outcome.SUCCESS, answered=True)
            return response
        except ClientGone:
            self._finish(exchange, 499, Outcome.ABORTED)
            return Response(status_code=499)  # nobody reads it; the status is for the gateway's own logs
        except APIError as exc:
            self._finish(exchange, exc.status, Outcome.ABORTED)
            raise
        except BaseException:
            self._finish(exchange, 499, Outcome.ABORTED)  # cancelled: the client went away
            raise
        finally:
            if not exchange.handed_off:  # whatever happened, nothing outlives the request unowned
                exchange.settle(Outcome.ABORTED)
                self._open.discard(exchange)

    async def _forward_with_retry(self, exchange: Exchange) -> Response:
        if exchange.routing.preparing is not None:  # the prompt's tokens, for precise prefix routing
            await exchange.routing.preparing
        last_error = "no attempt"
        attempts = 0
        kind = "first"
        patient = False  # a retry whose only other replicas are ejected for now waits for one (admit_patiently)
        again: set[str] = set()  # replicas given one more try (``once_more``): each gets one only
        told: ConfirmElsewhere | None = None  # an engine's error answer, to be told from its input's elsewhere
        while attempts < self.max_attempts:
            try:
                await (self.admit_patiently(exchange, kind) if patient else self.admit(exchange, kind))
            except APIError:
                if told is None:
                    raise
                return self._untold(exchange, told)
            replica = exchange.replica
            try:
                return await self._send(exchange, confirmable=attempts + 1 < self.max_attempts)
            except RerunElsewhere as exc:
                kind, last_error = "rerun", str(exc)
                reason = migration.DRAIN if draining(replica) else migration.CONNECTION
                exchange.end_attempt(Outcome.FAILURE, f"rerun: {reason}", dropped=True)
                exchange.tried.add(replica.name)
                log.warning("%s failed mid-answer (%s); running the request again elsewhere", replica.name, exc)
                if not self.admission.router.any_eligible(exchange.tried):
                    break
            except RetryableUpstreamError as exc:
                last_error = str(exc)
                exchange.end_attempt(Outcome.FAILURE, f"retry: {exc}", dropped=exc.stale)
                alone = not self._routable_besides(exchange.tried | {replica.name})
                if replica.name not in again and (why := once_more(exc, alone=alone)):
                    again.add(replica.name)
                    log.warning("%s %s (%s); trying it once more", replica.name, why, exc)
                    continue
                attempts += 1
                kind = "confirm" if isinstance(exc, ConfirmElsewhere) else "retry"
                told = exc if isinstance(exc, ConfirmElsewhere) else told
                exchange.tried.add(replica.name)
                log.warning("%s failed before first byte (%s); %s elsewhere", replica.name, exc,
                            "confirming" if kind == "confirm" else "retrying")
                if not self.admission.router.any_eligible(exchange.tried):
                    if alone:
                        break
                    patient = True  # e.g. the engine died while the other replica sat out a TTFT ejection
        raise APIError(502, f"upstream failed: {last_error}", code="upstream_error")

    async def admit(self, exchange: Exchange, kind: str) -> Lease:
        """A slot for the exchange's next attempt, queueing like any request; the attempt begins."""
        queued_at = time.monotonic()
        exchange.routing.decision = None  # the router explains the decision that gives this attempt its slot
        try:
            if exchange.background:
                lease = self.admission.acquire_idle(frozenset(exchange.tried), exchange.routing,
                                                    tenant=exchange.tenant)
            else:
                lease = await self.admission.acquire(frozenset(exchange.tried), exchange.routing,
                                                     tenant=exchange.tenant)
        finally:
            waited = time.monotonic() - queued_at
            exchange.hooks.queued(waited)
        exchange.begin(lease, waited, kind)
        return lease

    async def admit_patiently(self, exchange: Exchange, kind: str) -> Lease:
        """A slot for a request already under way (a retry, a continuation). Right after an engine dies, the only
        other replica may be ejected (a TTFT outlier, say) while the dead one still counts as routable and
        healthy, so the router does not panic and finds no replica at all; a moment later the dead one is ejected
        or out of routing and the router panics, or the ejection ends. A new request would get its 503 at once; a
        request already under way is worth waiting for, up to the queue timeout, like a queued request."""
        deadline = time.monotonic() + self.admission.queue_timeout_seconds
        self._waiting.add(exchange)
        try:
            while not self._shutting_down:
                try:
                    return await self.admit(exchange, kind)
                except APIError as exc:
                    if exc.code != "no_ready_replica" or time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(CONTINUATION_RETRY_SECONDS)
            raise APIError(503, "the gateway is shutting down (drain timeout)", code="shutting_down")
        finally:
            self._waiting.discard(exchange)

    def _routable_besides(self, tried: set[str]) -> bool:
        """Whether a replica not yet tried is in routing (ejected or not): one worth waiting for."""
        return any(r.routable and r.name not in tried for r in self.admission.router.replicas())

    async def post(self, exchange: Exchange, path: str, body: bytes) -> aiohttp.ClientResponse:
        """Send the current attempt to its replica (the hooks add their headers); the response is the exchange's."""
        assert self._session is not None, "Upstream.open() not called"
        headers = dict(exchange.headers)
        if path != exchange.path:
            headers["content-type"] = "application/json"
        exchange.hooks.sending(exchange.attempt, headers)
        headers.update(self.engine_headers)
        exchange.upstream = await self._session.post(
            exchange.replica.url + path, data=body, headers=headers,
            timeout=self._stream_timeout if exchange.stream else self._timeout)
        return exchange.upstream

    async def answers_health(self, replica: Replica, timeout_seconds: float) -> bool:
        """Whether the engine answers /health with 200 within ``timeout_seconds`` (engines answer /health without
        the engine key): what the shape breaker asks of a replica that sent no first byte in time."""
        assert self._session is not None, "Upstream.open() not called"
        try:
            async with self._session.get(replica.url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as answer:
                return answer.status == 200
        except UPSTREAM_ERRORS:
            return False

    async def _send(self, exchange: Exchange, *, confirmable: bool = False) -> Response:
        """One attempt. ``confirmable``: an error answer of the engine's own may be tried once more elsewhere (an
        attempt is left for it)."""
        try:
            upstream = await self.post(exchange, exchange.path, exchange.body)
        except UPSTREAM_ERRORS as exc:
            exchange.settle(failure_outcome(exc))
            if never_reached_engine(exc):
                raise RetryableUpstreamError(type(exc).__name__, stale=dropped_connection(exc),
                                             unconnected=isinstance(exc, aiohttp.ConnectionTimeoutError)) from exc
            exchange.end_attempt(failure_outcome(exc), type(exc).__name__)
            raise upstream_failure(exc) from exc
        if upstream.status in RETRYABLE_STATUS:
            exchange.settle(Outcome.FAILURE)
            raise RetryableUpstreamError(f"HTTP {upstream.status}")
        if exchange.stream and upstream.status == 200:
            return RelayedStream(
                self._relay(exchange), exchange, on_served=self._served,
                status_code=200,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers=self._response_headers(exchange),
            )
        return await self._read_whole(exchange, confirmable)

    @staticmethod
    def _response_headers(exchange: Exchange) -> dict[str, str]:
        """The client's response headers: which replica answered, by a label that never shows an internal
        address (appliance.gateway.upstream.labels), then the hooks'."""
        from appliance.gateway.upstream.labels import client_label

        headers = {"x-appliance-replica": client_label(exchange.attempt.replica)}
        exchange.hooks.responding(exchange.attempt, headers)
        return headers

    def _served(self, exchange: Exchange) -> None:
        """A stream response is over, however it ended. Most often its relay settled and counted it already; if
        it was never iterated (the client left between the upstream's headers and the first byte), that is done
        here."""
        exchange.settle(Outcome.ABORTED)
        self._finish(exchange, 499, Outcome.ABORTED, answered=True)
        self._open.discard(exchange)

    async def _read_whole(self, exchange: Exchange, confirmable: bool = False) -> Response:
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
            exchange.end_attempt(failure_outcome(exc), type(exc).__name__)
            raise upstream_failure(exc) from exc
        outcome = answer_outcome(upstream.status, content)
        exchange.settle(outcome)
        media_type = upstream.headers.get("content-type", "application/json")
        if outcome is Outcome.SERVER_ERROR:
            self._judge_error_answer(exchange, ConfirmElsewhere(upstream.status, content, media_type), confirmable)
        block = Block(content, content, time.monotonic())
        if outcome is Outcome.SUCCESS:
            exchange.hooks.relayed(block)
        return Response(content=block.out, status_code=upstream.status, media_type=media_type,
                        headers=self._response_headers(exchange))

    def _judge_error_answer(self, exchange: Exchange, answer: ConfirmElsewhere, confirmable: bool) -> None:
        """An engine's own error answer, nothing sent to the client yet: the hooks hear it; a hook that finds the
        input at fault ends the request with its error; else, when a hook judges such answers, the request is tried
        once more elsewhere to tell the input's fault from the engine's (``ConfirmElsewhere``), on a replica in
        routing, even one sitting out an ejection for now (the retry waits for it): only another replica tells, and
        without one the error counts against the one replica left. Otherwise the client gets the engine's answer,
        as it came: also where no replica took the request to tell by the queue timeout (``_untold``)."""
        replica = exchange.attempt.replica
        message = error_message(answer.content)
        exchange.end_attempt(Outcome.SERVER_ERROR, f"{ENGINE_ERROR_REASON}HTTP {answer.status}, {message}")
        blamed = exchange.hooks.judge_error(exchange.attempt)
        if blamed is not None:
            raise blamed
        if confirmable and exchange.hooks.judges_errors and self._routable_besides(exchange.tried | {replica}):
            raise answer

    def _untold(self, exchange: Exchange, answer: ConfirmElsewhere) -> Response:
        """No replica took the request to tell its engine's error answer from its input's: that answer, as it came
        (its verdict is the engine's, as where no other replica is in routing)."""
        log.warning("%s answered an error of its own (%s) and no other replica took the request to tell; the client "
                    "gets that answer", exchange.attempt.replica, answer)
        return Response(content=answer.content, status_code=answer.status, media_type=answer.media_type,
                        headers=self._response_headers(exchange))

    # -- the relay ------------------------------------------------------------------------------------------------

    async def _relay(self, exchange: Exchange) -> AsyncIterator[bytes]:
        """Yield the engine's SSE bytes as they arrive, through the hooks: whole events when a hook needs them,
        the reads as they come otherwise. A client disconnect closes the upstream connection, which makes vLLM
        abort the request; a break is the hooks' to resolve (a continuation elsewhere) or ends with an error
        event."""
        hooks = exchange.hooks
        outcome, status = Outcome.ABORTED, 499
        leg_first: float | None = None  # the current leg's first read: the replica is judged on its own TTFT
        try:
            while True:
                upstream, replica = exchange.upstream, exchange.replica
                assert upstream is not None
                events = SSEEvents() if hooks.frames else None
                self._streams.add(upstream)
                try:
                    async for chunk in upstream.content.iter_any():
                        now = time.monotonic()
                        self.admission.router.note_relayed(replica)
                        raw = chunk if events is None else events.feed_block(chunk)
                        if not raw:
                            continue
                        if leg_first is None:
                            leg_first = now
                        block = Block(raw, raw, now, raw.count(b"data: "))
                        hooks.relayed(block)
                        if block.out:
                            yield block.out
                        if block.broke is not None:
                            raise block.broke
                    if events is not None and events.pending:
                        yield events.pending
                    if upstream in self._cut:
                        raise aiohttp.ClientConnectionError("cut by the gateway")
                    hooks.leg_closed()
                    if held := hooks.held():
                        yield held
                    outcome, status = Outcome.SUCCESS, 200
                    return
                except (StreamBreak, *UPSTREAM_ERRORS) as exc:
                    if held := hooks.held():  # e.g. a finish held for a usage event that never came
                        yield held
                    resolution = await self._resolve(exchange, exc, upstream, replica, silent=leg_first is None)
                    if resolution.out:
                        yield resolution.out
                    if not resolution.resumed:
                        outcome, status = resolution.outcome, resolution.status
                        return
                    leg_first = None
                finally:
                    self._streams.discard(upstream)
                    self._cut.discard(upstream)
        finally:
            replica_ttft = None if leg_first is None else leg_first - exchange.dispatched
            exchange.settle(outcome, replica_ttft if outcome is Outcome.SUCCESS else None)
            self._finish(exchange, status, outcome, answered=True)

    async def _resolve(self, exchange: Exchange, exc: BaseException, upstream: aiohttp.ClientResponse,
                       replica: Replica, *, silent: bool = False) -> Resolution:
        """A leg broke: a cut by the gateway ends the stream with the shutdown event (not the replica's fault);
        otherwise the hooks resolve the break (a continuation elsewhere), or it ends with an error event.
        ``silent``: the leg had relayed nothing."""
        if upstream in self._cut:
            return Resolution(SHUTDOWN_EVENT, Outcome.ABORTED, 503)
        self._streams.discard(upstream)  # no longer relayed: a cut now ends a wait instead
        brk = Break(exc, replica.name, break_reason(exc, replica), time.monotonic(), silent)
        return await exchange.hooks.broke(brk) or _unresolved(exc, replica)

    def _finish(self, exchange: Exchange, status: int, outcome: Outcome, *, answered: bool = False) -> None:
        """The request is over: the hooks hear it once."""
        if exchange.counted:
            return
        exchange.counted = True
        exchange.hooks.finished(End(status, outcome, answered, time.monotonic()))


def _unresolved(exc: BaseException, replica: Replica) -> Resolution:
    """A break no hook resolved: the stream ends with an error event."""
    error = upstream_failure(exc)
    log.warning("%s failed mid-stream: %s", replica.name, type(exc).__name__)
    return Resolution(error_event(error, f"upstream replica failed mid-stream: {error.message}"),
                      failure_outcome(exc), error.status)

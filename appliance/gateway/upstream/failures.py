"""The retry rule: which upstream failures may be tried again, and how each is judged and answered.

A request goes to another replica only when the failed one cannot still be working on it, so that no request is
ever run twice or charged to two replicas: the connection could not be made (refused, connect timeout), the engine
closed or reset it without answering (vLLM aborts a request whose connection is gone), or it answered 502/503 (it
refused the work). Never after a timeout once connected (the engine may still be generating: the client gets a
504), never on a 504 answer (a timeout somewhere behind it, same reason), never once the response headers arrived,
and never back to a replica that already failed this request. Once the first byte is out, a failure ends the
stream with an error event instead, unless a hook resolves the break (migration).

Timeouts: a request that outlives ``request_timeout_seconds`` is the request's own length (a long max_tokens), not
the replica's fault, so it does not count toward ejection; connect and idle-read timeouts do (but a stream's first
byte later than the idle timeout from an engine that answers /health is a long prefill: appliance.gateway.breaker).

Error answers: an engine that answers 500 (or 501), or ends a stream with such an error event, raised on this
request; that is its fault or the input's (vLLM answers 500 to any unexpected exception a request causes, on every
replica alike). Such an answer is an ``Outcome.SERVER_ERROR``: judged by the shape breaker, which may try it once
more elsewhere to tell (``ConfirmElsewhere``), unless the engine says its core died (``ENGINE_DEAD``): that is the
engine's failure, whatever the request.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from appliance.engine.contract import Replica, ReplicaState
from appliance.gateway.migration import ledger as migration
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.hook import StreamBreak
from appliance.http.errors import APIError, error_body

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
RETRYABLE_STATUS = frozenset({502, 503})
# What vLLM answers when a request raised in it: 500 for an unexpected exception (or a request its engine core
# finished with an error), 501 for NotImplementedError (vllm/entrypoints/serve/exception_handling/).
ERROR_ANSWER_STATUS = frozenset({500, 501})
# vLLM's EngineDeadError: the engine core died, every request on it fails; never the input's doing.
ENGINE_DEAD = "EngineCore encountered an issue"
ENGINE_ERROR_REASON = "engine error: "  # how an attempt that an engine's error answer ended is explained
# What a stream still open at the drain timeout ends with, instead of a silent cut when the server stops.
SHUTDOWN_EVENT = ("data: " + json.dumps(error_body(
    503, "the gateway is shutting down; the stream was cut at the drain timeout", code="shutting_down")) + "\n\n"
).encode()


class RetryableUpstreamError(Exception):
    """The replica failed before it could have done any work; another replica may take the request.
    ``stale``: the connection dropped without an answer, as a pooled keep-alive connection that the engine closed
    does; the same replica may take the request on a new connection. ``unconnected``: no connection within the
    connect timeout, which on a busy host is as often the gateway's own loop running late past its deadline as the
    engine; where no other replica could take the request, the same one may, once."""

    def __init__(self, message: str, *, stale: bool = False, unconnected: bool = False) -> None:
        super().__init__(message)
        self.stale = stale
        self.unconnected = unconnected


class ConfirmElsewhere(RetryableUpstreamError):
    """An engine answered an error of its own (SERVER_ERROR) before anything reached the client: the request is
    tried once more on another replica, which tells the engine's fault (it succeeds there) from the input's (it
    fails there too). The failed engine finished with the request: nothing runs twice. Its answer is kept: where
    no replica can take the request to tell (the only other one stayed ejected past the queue timeout), the client
    gets it as it came."""

    def __init__(self, status: int, content: bytes, media_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.content = content
        self.media_type = media_type


class RerunElsewhere(RetryableUpstreamError):
    """A non-streaming answer broke mid-body (the engine died): nothing reached the client, so the whole request
    is sent again to another replica, within the migration budget rather than the retry attempts."""


def dropped_connection(exc: BaseException) -> bool:
    """An established connection dropped without an answer (not a refused connect, not a timeout): what reusing a
    keep-alive connection the engine has just closed looks like. A gateway whose loop runs late can miss its own
    idle-connection deadline and reuse one."""
    return (isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            and not isinstance(exc, aiohttp.ClientConnectorError))


def once_more(exc: RetryableUpstreamError, *, alone: bool) -> str | None:
    """Why the replica that just failed a request before reaching its engine should have it once more, first
    (None: it should not): a dropped connection is most likely a stale pooled one, not the replica; a connect
    timeout where no other replica could take the request (``alone``) is as likely the gateway's own loop, run late
    past its deadline on a busy host, and the only alternative is a 502."""
    if exc.stale:
        return "dropped the connection before answering"
    if exc.unconnected and alone:
        return "made no connection in time and no other replica could take the request"
    return None


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
    max_tokens), not the replica; connect and idle-read timeouts (aiohttp's ServerTimeoutError), broken
    connections and broken streams do; an engine's error event for this request is a SERVER_ERROR (judged)."""
    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ServerTimeoutError):
        return Outcome.TIMED_OUT
    if isinstance(exc, StreamBreak) and error_answer(exc.status, exc.detail):
        return Outcome.SERVER_ERROR
    return Outcome.FAILURE


def error_answer(status: int | None, message: str) -> bool:
    """An engine's error answer for one request (a 500 or 501, as status or error event), not its core's death:
    the engine's fault or the input's, which the shape breaker judges."""
    return status in ERROR_ANSWER_STATUS and ENGINE_DEAD not in message


def error_message(body: bytes) -> str:
    """The message of an engine's error answer (vLLM's ``{"error": {"message": ...}}``), cut to 200 characters."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("message") or "")[:200] if isinstance(error, dict) else ""


def answer_outcome(status: int, body: bytes) -> Outcome:
    """How a whole answer judges the replica: a 4xx is the request's; an error answer (``error_answer``) is judged;
    any other 5xx is the replica's failure."""
    if status < 400:
        return Outcome.SUCCESS
    if status < 500:
        return Outcome.CLIENT_ERROR
    return Outcome.SERVER_ERROR if error_answer(status, body[:4096].decode(errors="replace")) else Outcome.FAILURE


def request_outlived(exc: BaseException) -> bool:
    """The whole-request timeout: the request's own length, never worth continuing elsewhere."""
    return isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ServerTimeoutError)


def upstream_failure(exc: BaseException) -> APIError:
    """The client's answer to a failure that is not retried."""
    if isinstance(exc, StreamBreak):
        return APIError(502, f"upstream failed: {exc.detail}", code="upstream_error")
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(504, f"the replica did not answer in time ({type(exc).__name__}); not retried, since it "
                             "may still be working on the request", code="upstream_timeout")
    return APIError(502, f"upstream failed: {type(exc).__name__}", code="upstream_error")


def describe(exc: BaseException) -> str:
    return exc.detail if isinstance(exc, StreamBreak) else (str(exc) or type(exc).__name__)


def error_event(error: APIError, message: str) -> bytes:
    """An OpenAI error as the stream's last event."""
    return f"data: {json.dumps(error_body(error.status, message, code=error.code))}\n\n".encode()


def draining(replica: Replica) -> bool:
    """Being drained or restarted (planned): what explains a break on it, whatever the break was."""
    status = getattr(replica, "status", None)
    return status is not None and (status.planned_restart or status.state in (ReplicaState.DRAINING,
                                                                             ReplicaState.STOPPING))


def break_reason(exc: BaseException, replica: Replica) -> str:
    """The label of a break: a replica being drained or restarted explains any break; then the break itself."""
    if draining(replica):
        return migration.DRAIN
    if isinstance(exc, StreamBreak):
        return exc.reason
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return migration.IDLE_TIMEOUT
    return migration.CONNECTION

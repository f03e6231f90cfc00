"""The retry rule: which upstream failures may be tried again, and how each is judged and answered.

A request goes to another replica only when the failed one cannot still be working on it, so that no request is
ever run twice or charged to two replicas: the connection could not be made (refused, connect timeout), the engine
closed or reset it without answering (vLLM aborts a request whose connection is gone), or it answered 502/503 (it
refused the work). Never after a timeout once connected (the engine may still be generating: the client gets a
504), never on a 504 answer (a timeout somewhere behind it, same reason), never once the response headers arrived,
and never back to a replica that already failed this request. Once the first byte is out, a failure ends the
stream with an error event instead, unless a hook resolves the break (migration).

Timeouts: a request that outlives ``request_timeout_seconds`` is the request's own length (a long max_tokens), not
the replica's fault, so it does not count toward ejection; connect and idle-read timeouts do.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.hook import StreamBreak
from appliance.http.errors import APIError, error_body

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
RETRYABLE_STATUS = frozenset({502, 503})
# What a stream still open at the drain timeout ends with, instead of a silent cut when the server stops.
SHUTDOWN_EVENT = ("data: " + json.dumps(error_body(
    503, "the gateway is shutting down; the stream was cut at the drain timeout", code="shutting_down")) + "\n\n"
).encode()


class RetryableUpstreamError(Exception):
    """The replica failed before it could have done any work; another replica may take the request.
    ``stale``: the connection dropped without an answer, as a pooled keep-alive connection that the engine closed
    does; the same replica may take the request on a new connection."""

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


class RerunElsewhere(RetryableUpstreamError):
    """A non-streaming answer broke mid-body (the engine died): nothing reached the client, so the whole request
    is sent again to another replica, within the migration budget rather than the retry attempts."""


def dropped_connection(exc: BaseException) -> bool:
    """An established connection dropped without an answer (not a refused connect, not a timeout): what reusing a
    keep-alive connection the engine has just closed looks like. A gateway whose loop runs late can miss its own
    idle-connection deadline and reuse one."""
    return (isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            and not isinstance(exc, aiohttp.ClientConnectorError))


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
    connections and broken streams do."""
    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ServerTimeoutError):
        return Outcome.TIMED_OUT
    return Outcome.FAILURE


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

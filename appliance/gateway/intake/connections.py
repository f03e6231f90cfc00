"""The connection level of the intake: what uvicorn (0.55, httptools) does not bound by itself.

uvicorn arms no timer until a connection's first response, so a client that sends half a request line, or
headers one byte at a time, holds its connection forever (slowloris); headers have no size limit under httptools;
its ``limit_concurrency`` answers plain text without Retry-After; and after an answer given before the body ended
(a 401, 408, 413 from RequestIntake, or any route that does not read its body) it keeps reading that body, with no
timer while bytes keep coming. ``GuardedHttpToolsProtocol`` is uvicorn's httptools protocol plus:

- ``header_timeout``: the request line and headers must arrive within it, from the connection's start (or a
  kept-alive connection's next request's first byte); else 408 and close. Between requests uvicorn's own
  keep-alive timeout (5 s) closes an idle connection, as before.
- ``max_header_bytes``: request line plus headers; beyond it 431 and close (counted as they arrive).
- ``max_connections``: a request on a connection beyond the cap gets 503 + Retry-After and its connection is
  closed. 503, not 429: the cap is the gateway's capacity, not this client's rate (nginx's limit_conn answers 503
  too); load balancers move such a request to another instance. Idle connections over the cap cost a file
  descriptor each until ``header_timeout``, never memory.
- ``max_connections_per_client``: the same, for the connections of one client address. The global cap comes
  before authentication, so without it one client's idle keep-alive connections would take every slot and lock
  everyone else out; with it, that client is refused and the others are not.
- a lingering close after an answer given before its request's body ended: the answer and a FIN go out (so the
  client reads the answer rather than a reset), what still arrives is dropped unparsed, and uvicorn's keep-alive
  timer (which no longer restarts on data) closes the connection. Nothing of that body is buffered.

Refusals here are OpenAI error JSON like the app's; they happen outside the app, so they are logged (at most one
line per kind every ``LOG_EVERY_SECONDS``), not counted in appliance_requests_total.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.gateway.intake.limits import RETRY_AFTER_SECONDS
from appliance.http.errors import error_body, error_response

log = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 10.0


def raw_response(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 error response, for answers given outside any request cycle; it closes the connection."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# Where the server's own ``send`` waits in an HTTP request's scope for a streamed answer's body: past the
# middleware, each of which wraps ``send`` only to see the response start, a relay's every chunk would otherwise
# pass through each wrapper's coroutine (appliance/gateway/upstream/client.py).
SERVER_SEND = "appliance.server_send"


class _Throttled:
    """One log line per kind at most every LOG_EVERY_SECONDS, with how many happened since the last one."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        self._count[kind] = self._count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_SECONDS) >= LOG_EVERY_SECONDS:
            log.warning("%s (%d since the last such line)", message, self._count.pop(kind))
            self._last[kind] = now


_warnings = _Throttled()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout: ClassVar[float] = 10.0
    max_header_bytes: ClassVar[int] = 65536
    max_connections: ClassVar[int] = 1024
    max_connections_per_client: ClassVar[int] = 256
    # Open connections per client address, all connections of one server (``configured`` gives each its own).
    per_client: ClassVar[Counter[str]] = Counter()

    @classmethod
    def configured(cls, *, header_timeout: float, max_header_bytes: int, max_connections: int,
                   max_connections_per_client: int | None = None) -> type[GuardedHttpToolsProtocol]:
        """A subclass with these limits: uvicorn builds one protocol per connection from a class (``http=``)."""
        per_client = max_connections if max_connections_per_client is None else max_connections_per_client
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes,
                                           "max_connections": max_connections,
                                           "max_connections_per_client": per_client, "per_client": Counter()})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # ours is max_connections, answered in OpenAI's shape
        self._app = self.app
        self.app = self._admit
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # of the request being read, while its headers are incomplete
        self._reading_headers = False
        self._lingering = False
        self._close_after_answer = False
        self._counted_as: str | None = None  # the client address this connection is counted under

    # -- headers: time and size ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            self._counted_as = str(self.client[0])
            self.per_client[self._counted_as] += 1
        self._headers_begin()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_begin()  # a kept-alive connection's next request; no-op for the first (armed above)

    def _headers_begin(self) -> None:
        if not self._reading_headers:
            self._reading_headers = True
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._stop_header_timer()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is out: the rest of that body is dropped unparsed
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._reading_headers and self._header_bytes > self.max_header_bytes:
            self._refuse_raw(431, f"request line and headers exceed {self.max_header_bytes} bytes "
                                  "(intake.max_header_bytes)", "headers_too_large")

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._refuse_raw(408, f"request headers not received within {self.header_timeout:g}s "
                              "(intake.header_timeout_seconds)", "header_timeout")

    def _refuse_raw(self, status: int, message: str, code: str) -> None:
        _warnings.warn(code, f"refused a connection from {self.client}: {message}")
        self._reading_headers = False
        self._stop_header_timer()
        if not self.transport.is_closing():
            self.transport.write(raw_response(status, message, code))
            self.transport.close()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        address, self._counted_as = self._counted_as, None
        if address is not None:
            self.per_client[address] -= 1
            if self.per_client[address] <= 0:
                del self.per_client[address]

    def _client_connections(self) -> int:
        """Connections open now from this connection's client address (this one included)."""
        return self.per_client[self._counted_as] if self._counted_as is not None else 0

    # -- requests: the connection cap, and headers that were complete but too large ------------------------------

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        scope[SERVER_SEND] = send
        refused: tuple[int, str, str, dict[str, str]] | None = None  # status, message, code, headers
        if scope["type"] == "http":
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
                len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_header_bytes:
                refused = (431, f"request line and headers exceed {self.max_header_bytes} bytes "
                                "(intake.max_header_bytes)", "headers_too_large", {})
            elif len(self.connections) > self.max_connections:
                refused = (503, f"the gateway holds {self.max_connections} connections already "
                                "(intake.max_connections); retry shortly", "too_many_connections",
                           {"retry-after": str(RETRY_AFTER_SECONDS)})
            elif self._client_connections() > self.max_connections_per_client:
                refused = (503, f"this client holds {self.max_connections_per_client} connections to the gateway "
                                "already (intake.max_connections_per_client); reuse them, or retry shortly",
                           "too_many_client_connections", {"retry-after": str(RETRY_AFTER_SECONDS)})
        if refused is None:
            await self._app(scope, receive, send)
            return
        status, message, code, headers = refused
        _warnings.warn(code, f"refused a request from {self.client}: {message}")
        self._close_after_answer = True
        await error_response(status, message, code=code, headers=headers)(scope, receive, send)

    # -- after an answer: close rather than read a body nobody reads ---------------------------------------------

    def on_response_complete(self) -> None:
        # Before the body ended, no next request can have been parsed: self.cycle is the one just answered.
        unread = self.cycle is not None and self.cycle.more_body and not self.cycle.disconnected
        if self.transport.is_closing():
            pass
        elif unread:
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()  # after the answer: the client reads it, then EOF
        elif self._close_after_answer:
            self.transport.close()
        super().on_response_complete()  # lingering: arms the keep-alive timer, which closes the connection

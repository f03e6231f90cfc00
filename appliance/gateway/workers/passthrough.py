"""A worker passes every route but the OpenAI ones to the decider's own server (a Unix socket): /metrics,
/health, /admin, the Batch API, the runbooks. Those answer from state only the decider has (the whole fleet, the
merged metrics, the readiness a drain turns off), so a client or a load balancer gets the same answer whichever
worker its connection landed on. Bodies and answers stream through; hop-by-hop headers stay behind, and the
client's address goes along as ``x-forwarded-for``.

A request without a body goes without one: sent as an empty chunked body, the decider could answer before the
chunk's end arrived and then close the connection rather than read it, and the next request on that pooled
connection would meet a closed socket. The pool keeps an idle connection for less time than the decider's server
does (``POOL_IDLE_SECONDS`` < ``DECIDER_KEEP_ALIVE_SECONDS``); a request that still finds its reused connection
closed before any answer is sent again once on a new one when it is safe to (no body: GET, HEAD, OPTIONS)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from appliance.http.errors import APIError

POOL_IDLE_SECONDS = 30.0
DECIDER_KEEP_ALIVE_SECONDS = 75  # the decider's server (appliance.serve.workers_server)
RESENDABLE = frozenset({"GET", "HEAD", "OPTIONS"})

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})


class PassThrough:
    def __init__(self, socket_path: Path, timeout_seconds: float = 300.0) -> None:
        self.socket_path = socket_path
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5.0)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.UnixConnector(path=str(self.socket_path), keepalive_timeout=POOL_IDLE_SECONDS)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: Request) -> Response:
        """``request`` as the decider answers it."""
        assert self._session is not None, "PassThrough.open() not called"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if request.client is not None:
            seen = request.headers.get("x-forwarded-for")
            headers["x-forwarded-for"] = f"{seen}, {request.client.host}" if seen else request.client.host
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        tries = 1 if has_body or request.method not in RESENDABLE else 2
        for attempt in range(1, tries + 1):
            try:
                answer = await self._session.request(request.method, "http://decider" + target, headers=headers,
                                                     data=request.stream() if has_body else None,
                                                     timeout=self._timeout, allow_redirects=False)
                break
            except aiohttp.ServerDisconnectedError as exc:
                if attempt == tries:
                    raise _unavailable(exc) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise _unavailable(exc) from None
        out = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(_body(answer), status_code=answer.status, headers=out)


def _unavailable(exc: Exception) -> APIError:
    return APIError(503, f"the gateway's decider is not answering ({type(exc).__name__}); retry shortly",
                    code="decider_unavailable", headers={"Retry-After": "2"})


async def _body(answer: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.content.iter_any():
            yield chunk
    finally:
        answer.release()

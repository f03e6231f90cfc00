"""A worker passes every route but the OpenAI ones to the decider's own server (a Unix socket): /metrics,
/health, /admin, the Batch API, the runbooks. Those answer from state only the decider has (the whole fleet, the
merged metrics, the readiness a drain turns off), so a client or a load balancer gets the same answer whichever
worker its connection landed on. Bodies and answers stream through; hop-by-hop headers stay behind, and the
client's address goes along as ``x-forwarded-for``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from appliance.http.errors import APIError

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})


class PassThrough:
    def __init__(self, socket_path: Path, timeout_seconds: float = 300.0) -> None:
        self.socket_path = socket_path
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5.0)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.socket_path)),
                                              auto_decompress=False)

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
        try:
            answer = await self._session.request(request.method, "http://decider" + target, headers=headers,
                                                 data=request.stream(), timeout=self._timeout,
                                                 allow_redirects=False)
        except (aiohttp.ClientError, OSError) as exc:
            raise APIError(503, f"the gateway's decider is not answering ({type(exc).__name__}); retry shortly",
                           code="decider_unavailable", headers={"Retry-After": "2"}) from None
        out = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(_body(answer), status_code=answer.status, headers=out)


async def _body(answer: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.content.iter_any():
            yield chunk
    finally:
        answer.release()

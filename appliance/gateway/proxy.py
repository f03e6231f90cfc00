"""Forwarding one request to a replica: bodies pass through as bytes, streams chunk by chunk, no buffering."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from appliance.gateway.errors import APIError, error_body
from appliance.gateway.router import Routable, Router

log = logging.getLogger(__name__)

# Headers worth carrying to the engine; the client's Authorization is the gateway's business, not vLLM's.
FORWARDED_HEADERS = ("content-type", "traceparent", "tracestate", "x-request-id")
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class Upstream:
    """One pooled HTTP client for all replicas, plus the retry rule: another replica only before the first byte."""

    def __init__(self, router: Router, *, timeout_seconds: float, max_attempts: int = 2) -> None:
        self.router = router
        self.max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), auto_decompress=False
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: Request, path: str, body: bytes, *, stream: bool) -> Response:
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        tried: set[str] = set()
        last_error: Exception | None = None
        for _ in range(self.max_attempts):
            replica = self.router.acquire(exclude=tried)
            try:
                return await self._send(replica, path, body, headers, stream=stream)
            except UPSTREAM_ERRORS as exc:  # nothing reached the client yet: safe to try another replica
                self.router.release(replica)
                tried.add(replica.name)
                last_error = exc
                log.warning("%s failed before first byte (%s); retrying elsewhere", replica.name, exc)
                if not self.router.any_ready():
                    break
        raise APIError(502, f"upstream failed: {type(last_error).__name__}", code="upstream_error")

    async def _send(
        self, replica: Routable, path: str, body: bytes, headers: dict[str, str], *, stream: bool
    ) -> Response:
        assert self._session is not None, "Upstream.open() not called"
        upstream = await self._session.post(replica.url + path, data=body, headers=headers, timeout=self._timeout)
        if stream and upstream.status == 200:
            return StreamingResponse(
                self._relay(upstream, replica),
                status_code=200,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-appliance-replica": replica.name},
            )
        try:
            content = await upstream.read()
        finally:
            upstream.release()
        self.router.release(replica)
        return Response(
            content=content,
            status_code=upstream.status,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers={"x-appliance-replica": replica.name},
        )

    async def _relay(self, upstream: aiohttp.ClientResponse, replica: Routable) -> AsyncIterator[bytes]:
        """Yield the engine's SSE bytes as they arrive; a client disconnect closes the upstream connection,
        which makes vLLM abort the request."""
        completed = False
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
            completed = True
        except UPSTREAM_ERRORS as exc:
            log.warning("%s failed mid-stream: %s", replica.name, exc)
            message = f"upstream replica failed mid-stream: {type(exc).__name__}"
            yield f"data: {json.dumps(error_body(502, message, code='upstream_error'))}\n\n".encode()
        finally:
            if completed:
                upstream.release()
            else:
                upstream.close()
            self.router.release(replica)

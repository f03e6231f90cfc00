"""The worker's pass-through to the decider's own server: what it sends, and a pooled connection the decider
closed while a request was on its way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from appliance.gateway.workers.passthrough import PassThrough
from appliance.http.errors import install_error_handlers

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


class DeciderStandIn:
    """A raw HTTP/1.1 server on a Unix socket: answers ``answered_per_connection`` requests on a connection, then
    closes it as the next one arrives, unanswered: the moment a keep-alive timer and a pooled connection's reuse
    meet. Keeps each request's head (request line and headers) as it arrived."""

    def __init__(self, path: Path, answered_per_connection: int) -> None:
        self.path = path
        self.answered_per_connection = answered_per_connection
        self.heads: list[bytes] = []
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> DeciderStandIn:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for _ in range(self.answered_per_connection):
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                if b"transfer-encoding: chunked" in head.lower():
                    await reader.readuntil(b"0\r\n\r\n")
                writer.write(ANSWER)
                await writer.drain()
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))  # the next one: dropped with the connection
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "http.sock"


def worker_app(passthrough: PassThrough) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request) -> Response:
        return await passthrough.forward(request)

    return app


async def requests(socket_path: Path, calls: list[tuple[str, str]]) -> AsyncIterator[httpx.Response]:
    passthrough = PassThrough(socket_path)
    await passthrough.open()
    try:
        transport = httpx.ASGITransport(app=worker_app(passthrough))
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            for method, path in calls:
                yield await client.request(method, path, content=b"{}" if method == "POST" else None)
    finally:
        await passthrough.close()


def answers(socket_path: Path, calls: list[tuple[str, str]], answered_per_connection: int,
            ) -> tuple[list[httpx.Response], DeciderStandIn]:
    """``calls`` through a pass-through to a stand-in decider; the answers and the stand-in."""
    async def run() -> tuple[list[httpx.Response], DeciderStandIn]:
        async with DeciderStandIn(socket_path, answered_per_connection) as decider:
            return [response async for response in requests(socket_path, calls)], decider

    return asyncio.run(run())


def test_a_request_without_a_body_goes_without_one(socket_path: Path) -> None:
    got, decider = answers(socket_path, [("GET", "/metrics"), ("POST", "/admin/drain")], answered_per_connection=10)
    assert [r.status_code for r in got] == [200, 200]
    get, post = (head.lower() for head in decider.heads)
    assert b"transfer-encoding" not in get and b"content-length" not in get
    assert b"transfer-encoding: chunked" in post or b"content-length: 2" in post


def test_a_get_whose_pooled_connection_was_closed_is_sent_again_on_a_new_one(socket_path: Path) -> None:
    got, decider = answers(socket_path, [("GET", "/metrics")] * 3, answered_per_connection=1)
    assert [r.status_code for r in got] == [200, 200, 200]
    assert decider.connections == 3 and len(decider.heads) == 5  # the second and the third each sent twice


def test_a_post_whose_connection_was_closed_is_not_sent_twice(socket_path: Path) -> None:
    got, decider = answers(socket_path, [("GET", "/metrics"), ("POST", "/admin/drain")], answered_per_connection=1)
    assert got[0].status_code == 200
    assert got[1].status_code == 503 and got[1].json()["error"]["code"] == "decider_unavailable"
    assert got[1].headers["retry-after"] == "2"
    assert [head.split(b" ")[0] for head in decider.heads] == [b"GET", b"POST"]  # the POST reached it once

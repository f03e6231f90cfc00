"""The gateway app served by a real uvicorn in a thread, for tests that need a real client connection: one that
hangs up mid-request (TestClient cannot: its transport never disconnects). ``DrainWatch`` wraps the app to check,
while a storm runs, that a drain would wait for every stream the gateway has open."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.engine.contract import Replica
from appliance.serve import in_flight
from appliance.settings import Settings


def app_clients(replicas: Sequence[Replica], settings: Callable[..., Settings]) -> Iterator[Callable[..., TestClient]]:
    """A fixture's body (``yield from``): ``make(**overrides)`` opens a TestClient on an app over ``replicas`` with
    ``settings(**overrides)``; every client it opened is closed (its lifespan ended) after the test."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        client = TestClient(create_app(settings(**overrides), replicas=lambda: replicas),
                            raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


class LiveGateway:
    def __init__(self, app: Any, server: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server,
                 **config: Any) -> None:
        self.app = app
        self._server = server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning",
                                             access_log=False, **config))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.port = 0

    def __enter__(self) -> LiveGateway:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def server(self) -> uvicorn.Server:
        return self._server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(20)

    def post_and_hang_up(self, path: str, body: bytes, after_seconds: float) -> None:
        """Send a request, wait, then close the connection without reading the answer."""
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(after_seconds)


class LiveWorkers:
    """The gateway as ``appliance serve`` runs it with ``gateway.workers`` above 1: this process is the decider
    (its server on a Unix socket, in a thread) and the workers are real processes accepting on a port of their own.
    ``app`` must have been built with a ``MergedRegistry`` (the workers' metrics are summed into it)."""

    def __init__(self, app: Any, settings: Settings) -> None:
        from appliance.context import context_of
        from appliance.gateway.workers.metrics import MergedRegistry
        from appliance.gateway.workers.pool import listening_socket
        from appliance.serve import workers_server

        self.app = app
        registry = context_of(app).registry
        assert isinstance(registry, MergedRegistry), "build the app with registry=MergedRegistry()"
        self._folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="appl-"))  # a socket's path is short
        self._listener = listening_socket("127.0.0.1", 0)
        self.port = self._listener.getsockname()[1]
        self._server = workers_server(settings, app, registry, self._listener, self._folder)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> LiveWorkers:
        self._thread.start()
        deadline = time.monotonic() + 60
        pool = self._server._workers
        assert pool is not None
        while len(pool.decider.sessions) < pool.count or not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the decider or its workers did not start")
            time.sleep(0.05)
        return self

    @property
    def server(self) -> uvicorn.Server:
        return self._server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._listener.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class DrainWatch:
    """The app, wrapped to count the event streams it has open (from their 200 to their last byte, or to the end of
    the ASGI call when the client left) and to check, on the event loop at every message sent and every 2 ms while
    one is open, that the drain would wait for at least that many requests."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.open = 0
        self.checks = 0
        self.violations: list[str] = []
        self._sampler: asyncio.Task | None = None

    def check(self, where: str) -> None:
        self.checks += 1
        owed = in_flight(self.app)
        if owed < self.open:
            self.violations.append(f"{where}: the drain would wait for {owed} request(s), {self.open} stream(s) open")

    async def _sample(self) -> None:
        while self.open:
            self.check("sampled")
            await asyncio.sleep(0.002)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        streaming = False

        async def counted_send(message) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                streaming = message["status"] == 200 and any(
                    k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"])
                self.open += streaming
                if streaming and (self._sampler is None or self._sampler.done()):
                    self._sampler = asyncio.get_running_loop().create_task(self._sample())
            elif message["type"] == "http.response.body" and not message.get("more_body") and streaming:
                streaming = False
                self.open -= 1
            self.check(message["type"])
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            if streaming:  # the client left: the call ended without a last message
                self.open -= 1

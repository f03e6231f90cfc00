"""The gateway app served by a real uvicorn in a thread, for tests that need a real client connection: one that
hangs up mid-request (TestClient cannot: its transport never disconnects)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI


class LiveGateway:
    def __init__(self, app: FastAPI, server: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server,
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


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

"""Request intake as pure ASGI middleware: stamps each request's arrival time (latency is measured from it, so
time spent in the gateway counts) and enforces the size limit before any body is buffered, with or without
Content-Length (chunked uploads are counted as they arrive)."""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http.errors import ErrorHook, error_body


class BodyTooLarge(Exception):
    pass


class RequestIntake:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: ErrorHook | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["appliance.arrived"] = time.monotonic()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        try:
            # `send` is passed through unwrapped: it runs once per streamed chunk. The gateway's routes read the
            # whole body before answering, so an oversized body is always caught before the response starts.
            await self.app(scope, counting_receive, send)
        except BodyTooLarge:
            await self._reject(scope, send)

    async def _reject(self, scope: Scope, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject(scope["path"], scope, 413)
        body = json.dumps(error_body(413, f"request body exceeds {self.max_bytes} bytes "
                                          "(max_request_bytes)")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

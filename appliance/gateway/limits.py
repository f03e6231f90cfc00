"""Request intake as pure ASGI middleware: stamps each request's arrival time (latency is measured from it, so
time spent in the gateway counts) and enforces the size limit before any body is buffered, with or without
Content-Length (chunked uploads are counted as they arrive)."""

from __future__ import annotations

import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http.errors import ErrorHook, error_body


class BodyTooLarge(HTTPException):
    """Raised from the body stream as an HTTPException on purpose: FastAPI re-raises those from its body parsing
    (any other exception there becomes its 400 "error parsing the body"), so the app's error handlers answer
    413, and count it, like every other error."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, too_large_message(max_bytes))


def too_large_message(max_bytes: int) -> str:
    return f"request body exceeds {max_bytes} bytes (max_request_bytes)"


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
                    raise BodyTooLarge(self.max_bytes)
            return message

        try:
            # `send` is passed through unwrapped: it runs once per streamed chunk. The gateway's routes read the
            # whole body before answering, so an oversized body is always caught before the response starts.
            await self.app(scope, counting_receive, send)
        except BodyTooLarge:  # read outside FastAPI's handlers: answer here
            await self._reject(scope, send)

    async def _reject(self, scope: Scope, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject(scope["path"], scope, 413)
        body = json.dumps(error_body(413, too_large_message(self.max_bytes))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

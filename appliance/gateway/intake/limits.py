"""Request intake as pure ASGI middleware, the first thing every request meets. In order, before any work:

1. stamps the request's arrival (latency is measured from it, so time spent in the gateway counts);
2. checks the bearer token for /v1, /admin, /metrics and /sd/targets from the headers alone
   (appliance/http/auth.py, the same constant-time matching the routes' dependencies use): a stranger gets 401
   before one byte of its body is read, so it cannot make the gateway buffer anything; a request with more than
   one Authorization header gets 401 on every path, since which one a check would read is ambiguous;
3. refuses a declared Content-Length over ``max_request_bytes`` (413), or over a path's own limit (``limits``:
   /v1/files takes batch files up to ``batch.max_file_bytes``);
4. takes the body's bytes from the global body budget (``intake.body_budget_bytes``): the declared length up
   front, a chunked body as it arrives; what does not fit is 503 with Retry-After;
5. while the app reads the body: counts it against ``max_request_bytes`` (413, chunked uploads too), and cuts it
   at ``intake.body_timeout_seconds`` after the headers (408). The budget is given back once the body has all
   arrived, or when the request ends.

Status codes, as an SRE reads them: 401/413/408 are the client's doing (408: RFC 9110 "did not receive a complete
request message within the time it was prepared to wait"). A full body budget is the gateway's capacity, not the
client's fault: 503 + Retry-After (retry here shortly, or on another instance; load balancers and OpenAI's clients
retry it), not 429, which says "you, slow down" and belongs to admission's per-capacity queue. None of these answers
closes the connection itself: the connection level (appliance/gateway/intake/connections.py) sends the answer, stops
reading a body the app did not read, and closes (a lingering close, so the client sees the answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http.auth import authorization_of, refusal
from appliance.http.credentials import Credentials
from appliance.http.errors import APIError, ErrorHook, error_response

RETRY_AFTER_SECONDS = 1  # a full budget frees as uploads finish (or time out): retry soon, or elsewhere


class IntakeRefusal(HTTPException):
    """Raised from the body stream as an HTTPException on purpose: FastAPI re-raises those from its body parsing
    (any other exception there becomes its 400 "error parsing the body"), so the app's error handlers answer
    with this status and code, and count it, like every other error."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers=headers)
        self.code = code

    def as_api_error(self) -> APIError:
        return APIError(self.status_code, str(self.detail), code=self.code, headers=dict(self.headers or {}))


class BodyTooLarge(IntakeRefusal):
    def __init__(self, max_bytes: int, setting: str = "max_request_bytes") -> None:
        super().__init__(413, too_large_message(max_bytes, setting), "request_too_large")


class BodyTimeout(IntakeRefusal):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"request body not received within {seconds:g}s (intake.body_timeout_seconds)",
                         "body_timeout")


class BodyBudgetExhausted(IntakeRefusal):
    def __init__(self, budget: int) -> None:
        super().__init__(503, f"the gateway is receiving {budget} bytes of request bodies already "
                              "(intake.body_budget_bytes); retry shortly", "body_budget_exhausted",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def too_large_message(max_bytes: int, setting: str = "max_request_bytes") -> str:
    return f"request body exceeds {max_bytes} bytes ({setting})"


class BodyBudget:
    """Bytes of request bodies being received, all requests together, against one limit. Only the event loop
    touches it: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def take(self, size: int) -> bool:
        if self.in_flight + size > self.limit:
            return False
        self.in_flight += size
        return True

    def give(self, size: int) -> None:
        self.in_flight -= size


class _Body:
    """One request's body as the app reads it: counted, timed, and paid for from the budget."""

    def __init__(self, receive: Receive, intake: RequestIntake, held: int, limit: BodyLimit) -> None:
        self._receive = receive
        self._intake = intake
        self._limit = limit
        self._deadline = asyncio.get_running_loop().time() + intake.body_timeout
        self.held = held
        self.received = 0
        self.done = False

    async def receive(self) -> Message:
        if self.done:  # the body is in: what is left is waiting for a disconnect, which has no deadline
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            self.release()
            raise BodyTimeout(self._intake.body_timeout) from None
        if message["type"] != "http.request":
            self.done = True
            self.release()
            return message
        self.received += len(message.get("body", b""))
        if self.received > self._limit.max_bytes:
            self.release()
            raise BodyTooLarge(*self._limit)
        if self.received > self.held:  # no Content-Length: paid for as it arrives
            if not self._intake.budget.take(self.received - self.held):
                self.release()
                raise BodyBudgetExhausted(self._intake.budget.limit)
            self.held = self.received
        if not message.get("more_body", False):
            self.done = True
            self.release()
        return message

    def release(self) -> None:
        self._intake.budget.give(self.held)
        self.held = 0


class BodyLimit(NamedTuple):
    """The largest body a path takes, and the setting that says so (named in the 413)."""

    max_bytes: int
    setting: str


class RequestIntake:
    def __init__(self, app: ASGIApp, max_bytes: int, *, credentials: Callable[[], Credentials], body_timeout: float,
                 budget: BodyBudget, on_reject: ErrorHook | None = None,
                 limits: Mapping[str, BodyLimit] | None = None) -> None:
        """``limits``: paths whose bodies have a limit of their own instead of ``max_bytes`` (batch uploads)."""
        self.app = app
        self.credentials = credentials  # the live ones (a reload replaces the keys the key check reads)
        self.max_bytes = max_bytes
        self.limits = dict(limits or {})
        self.body_timeout = body_timeout
        self.budget = budget
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["appliance.arrived"] = time.monotonic()
        headers = dict(scope["headers"])
        try:
            authorization = authorization_of([value.decode("latin-1") for name, value in scope["headers"]
                                              if name == b"authorization"])
            denied = refusal(self.credentials(), route_path(scope), authorization)
        except APIError as exc:  # more than one Authorization header
            denied = exc
        if denied is not None:
            await self._answer(scope, receive, send, denied)
            return
        declared = headers.get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        limit = self.limits.get(route_path(scope)) or BodyLimit(self.max_bytes, "max_request_bytes")
        if size is not None and size > limit.max_bytes:
            await self._answer(scope, receive, send, BodyTooLarge(*limit).as_api_error())
            return
        if size and not self.budget.take(size):
            await self._answer(scope, receive, send, BodyBudgetExhausted(self.budget.limit).as_api_error())
            return
        body = _Body(receive, self, held=size or 0, limit=limit)
        try:
            # `send` is passed through unwrapped: it runs once per streamed chunk. The gateway's routes read the
            # whole body before answering, so a refused body is always caught before the response starts.
            await self.app(scope, body.receive, send)
        except IntakeRefusal as exc:  # read outside FastAPI's handlers: answer here
            await self._answer(scope, receive, send, exc.as_api_error())
        finally:
            body.release()

    async def _answer(self, scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        if self.on_reject is not None:
            self.on_reject(scope["path"], scope, error.status)
        response = error_response(error.status, error.message, param=error.param, code=error.code,
                                  headers=error.headers)
        await response(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path Starlette routes on (without the root_path a proxy mounted the app under)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path

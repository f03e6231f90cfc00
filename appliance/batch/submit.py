"""How a batch line is sent: in process, through the gateway's own request path, as background work.

The line becomes what a client's request becomes after the route checked it: ``Upstream.forward`` with the line's
body, its tenant, and its prompt for routing, so it goes through every hook (metering charges the tenant's quota
and counts its tokens, the request record keeps it under the line's request id, observation counts it) and through
admission and routing like any request. Marked ``background``, it takes a slot only where one is idle (admission's
``acquire_idle``: no request queued, the replica below its headroom) and never queues; where none is, it is
answered 429 ``no_idle_capacity`` at once and the line waits.

No HTTP loop to itself: no socket, no second parse, no API key to hold. The client's side of the exchange is a
``Submission``: the runner "hangs up" (``abandon``) to give a line back (preemption, cancel, drain), and the
transport does what it does for any client that leaves: closes the upstream connection, so the engine aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Message

from appliance.batch.lines import routing_prompt
from appliance.batch.model import ENDPOINTS, PendingLine, line_request_id
from appliance.gateway.tenants.directory import Tenant
from appliance.http.errors import APIError, error_body

NO_IDLE_CAPACITY = "no_idle_capacity"


class Forward(Protocol):
    """The transport's one call (``appliance.gateway.upstream.transport.Upstream``)."""

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool, arrived: float,
                      prompt: str | None = None, background: bool = False) -> Response: ...


class IdleGate(Protocol):
    """Admission's view of idle capacity (``appliance.gateway.admission.queue.Admission``)."""

    def idle_room(self) -> int:
        """Slots background work may take now (0 while any request waits in the queue)."""
        ...


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    code: str | None = None  # the gateway's error code, for a refusal (rate_limit_exceeded, no_idle_capacity ...)
    retry_after: float | None = None


class Submission:
    """The client's side of one line in flight: the runner abandons it to give the line back."""

    def __init__(self) -> None:
        self.abandoned: str | None = None  # why it was given back
        self._gone = asyncio.Event()

    def abandon(self, why: str) -> None:
        if self.abandoned is None:
            self.abandoned = why
            self._gone.set()

    async def receive(self) -> Message:
        """ASGI's receive after the body was read: the only message left is the disconnect."""
        await self._gone.wait()
        return {"type": "http.disconnect"}


class GatewaySubmitter:
    def __init__(self, upstream: Forward, gate: IdleGate, tenant_of: Callable[[str], Tenant | None]) -> None:
        self.upstream = upstream
        self.gate = gate
        self.tenant_of = tenant_of

    async def send(self, line: PendingLine, endpoint: str, tenant_name: str, submission: Submission) -> Answer:
        """The line's answer (the gateway's refusals included, as OpenAI error JSON)."""
        tenant = self.tenant_of(tenant_name)
        if tenant is None:
            return refusal(APIError(401, f"tenant {tenant_name!r} is no longer configured", code="tenant_removed"))
        # Checked right before forwarding, with no await between here and admission taking the slot: a line that
        # would only be refused is not sent, so it is not counted as a 429 among the clients' answers.
        if self.gate.idle_room() <= 0:
            return refusal(APIError(429, "no idle capacity for batch work now", code=NO_IDLE_CAPACITY))
        request_id = line_request_id(line.batch_id, line.index)
        scope = {"type": "http", "method": "POST", "path": endpoint, "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())],
                 "state": {"tenant": tenant}}
        request = Request(scope, submission.receive)
        try:
            response = await self.upstream.forward(request, ENDPOINTS[endpoint], endpoint, line.body.encode(),
                                                   stream=False, arrived=time.monotonic(),
                                                   prompt=routing_prompt(endpoint, line.body), background=True)
        except APIError as exc:
            return refusal(exc)
        return Answer(response.status_code, bytes(response.body))


def refusal(exc: APIError) -> Answer:
    retry = exc.headers.get("Retry-After")
    body = json.dumps(error_body(exc.status, exc.message, param=exc.param, code=exc.code)).encode()
    return Answer(exc.status, body, exc.code, float(retry) if retry and retry.isdigit() else None)

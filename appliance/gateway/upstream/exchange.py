"""One client request on its way through the gateway, and each attempt to have a replica answer it.

Ownership: the ``Exchange`` holds the current attempt's slot lease and upstream response until it hands both to
the ``RelayedStream`` that serves a stream; whatever it still holds when the transport's ``forward`` ends (the
client left, an error, a cancellation at any await, a response built but never returned) is settled there, in one
place. The stream settles what it holds when it is served, including when its body was never iterated.
"""

from __future__ import annotations

import json
import time
from dataclasses import InitVar, dataclass, field
from typing import Any, Protocol

import aiohttp
from fastapi import Request

from appliance.engine.contract import Replica
from appliance.gateway.admission.slots import Lease
from appliance.gateway.observation.tracing import UNTRACED, RequestTrace
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.directory import DEFAULT as DEFAULT_TENANT
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.usage import Usage
from appliance.gateway.upstream.hook import Attempt, HookChain, RequestHook

NO_HOOKS = HookChain(())  # read-only: a chain holds tuples


@dataclass(eq=False)  # one object per request, compared and hashed by identity (the transport's open set)
class Exchange:
    """One client request: what it is, whose it is, and what the transport holds for it right now."""

    route: str
    path: str
    body: bytes
    stream: bool
    arrived: float  # monotonic
    headers: dict[str, str]
    request: Request
    routing: RoutingRequest
    tenant: Tenant = DEFAULT_TENANT  # whose request (the API key's tenant; appliance.gateway.tenants)
    background: bool = False  # batch work (appliance.batch): idle capacity only, never queued
    hooks: HookChain = NO_HOOKS  # until the transport starts the request's own (one chain per request, not two)
    trace: RequestTrace = UNTRACED  # the request's spans (the observation hook's; untraced without it)
    tried: set[str] = field(default_factory=set)
    dispatched: float = 0.0  # monotonic: when the current attempt's replica was assigned
    attempts: list[Attempt] = field(default_factory=list)
    lease: Lease | None = None  # the slot of the current attempt, until settled
    upstream: aiohttp.ClientResponse | None = None  # the current attempt's response, until settled
    handed_off: bool = False  # a RelayedStream owns the lease and upstream from here on
    counted: bool = False  # the request's end was reported to the hooks (once)
    migration_limit: int = 0  # continuations and re-runs this request may be given (0: none)
    migrations: int = 0  # continuations and re-runs it was given
    usage: Usage | None = None  # what the engines reported, every leg (None: no report yet)
    # ``body`` as the route parsed it, given to the exchange to own (None: parsed on first use; see ``parsed``)
    parsed_body: InitVar[dict[str, Any] | None] = None
    _parsed: Any = field(default=None, repr=False)  # the body as JSON, once parsed (see ``parsed``)

    def __post_init__(self, parsed_body: dict[str, Any] | None) -> None:
        if parsed_body is not None:
            self._parsed = parsed_body

    def parsed(self) -> dict[str, Any] | None:
        """The client's body as a JSON object, parsed once for every hook that reads it (None: not an object).
        A hook that rewrites ``body`` keeps this in step, so the next hook reads what the engine will get."""
        if self._parsed is None:
            try:
                value = json.loads(self.body)
            except ValueError:
                value = False
            self._parsed = value if isinstance(value, dict) else False
        return self._parsed or None

    def override(self, key: str, value: Any) -> None:
        """Set ``key`` of the body the engine gets, whatever the client sent there: appended to the client's bytes
        (the last key wins in vLLM's JSON parser, so nothing else of the client's bytes changes) and written into
        ``parsed`` (a continuation built from it carries the same value)."""
        parsed = self.parsed()
        if parsed is None:
            return
        parsed[key] = value
        end = self.body.rstrip().rfind(b"}")
        head = self.body[:end].rstrip()
        separator = b"" if head.endswith(b"{") else b","
        self.body = (head + separator + json.dumps(key).encode() + b":"
                     + json.dumps(value, separators=(",", ":")).encode() + b"}")

    def reported(self, usage: object) -> None:
        """One engine usage report for this request (a continued stream has one per leg)."""
        found = Usage.of(usage)
        if found is not None:
            self.usage = found if self.usage is None else self.usage + found

    @property
    def replica(self) -> Replica:
        assert self.lease is not None, "no replica assigned"
        return self.lease.replica

    @property
    def attempt(self) -> Attempt:
        return self.attempts[-1]

    def begin(self, lease: Lease, queue_wait: float, kind: str) -> Attempt:
        """A replica took the request: a new attempt."""
        self.lease = lease
        self.dispatched = time.monotonic()
        decision = self.routing.decision
        attempt = Attempt(lease.replica.name, self.dispatched, queue_wait,
                          decision if decision is not None and decision.replica == lease.replica.name else None,
                          kind)
        self.attempts.append(attempt)
        self.hooks.admitted(attempt)
        return attempt

    def end_attempt(self, outcome: Outcome, reason: str, sent_tokens: int = 0, dropped: bool = False) -> None:
        """The current attempt ended without an answer for the client; the hooks hear why."""
        if not self.attempts:
            return
        attempt = self.attempts[-1]
        if attempt.outcome is None:
            attempt.outcome, attempt.reason, attempt.sent_tokens = outcome, reason, sent_tokens
            attempt.dropped = dropped
            self.hooks.attempt_ended(attempt)

    def settle(self, outcome: Outcome, ttft_seconds: float | None = None) -> None:
        """Give back what the current attempt holds: the upstream connection (kept for reuse only after a
        complete answer; closing it makes vLLM abort the request) and the slot. Safe to call any number of times."""
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if outcome is Outcome.SUCCESS or outcome is Outcome.CLIENT_ERROR:
                upstream.release()
            else:
                upstream.close()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release(outcome, ttft_seconds)


class Hook(Protocol):
    """A concern on the request path, built once in the composition root.

    Its ``RequestHook`` decides synchronously, except ``arrived``: a check that needs a round trip (the tenants'
    quota in a shared store) returns an awaitable, which the chain awaits before the next hook's ``arrived``; a
    hook that decides at once returns None and costs no coroutine. Work at the end that needs a round trip
    (settling that quota) is the hook's own tracked background task, never awaited on the response path."""

    name: str

    def start(self, exchange: Exchange) -> RequestHook | None:
        """This request's part (None: not this hook's business). May rewrite ``exchange.body`` or refuse the
        request by raising ``APIError``."""
        ...

"""The engine's door: inside each vLLM server, every request but ``/health`` and ``/metrics`` needs the engine key.

vLLM's own ``--api-key`` (here its ``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``, ``/inference``
and ``/cohere`` (vllm/entrypoints/serve/middleware/authenticate.py, ``GUARDED_PREFIX``): ``/invocations`` (the
same completions and chat as ``/v1``, for SageMaker), ``/tokenize``, ``/pause``, ``/abort_requests``, ``/classify``
and the rest stay open to anyone who reaches the port. This middleware, which the appliance adds to every engine it
runs (``--middleware appliance.engine.guard.EngineKeyGuard``, appliance/engine/command.py), refuses them too, with
the 401 vLLM answers. It reads the same key from the same variable, so vLLM's check and this one agree; without
one it lets everything through, as vLLM does. ``/health`` (the gateway's health probe) and ``/metrics`` (its load
poll, Prometheus' scrape) stay open: they reveal no prompt and act on nothing.

It also says, on every ``/metrics`` answer, the scheduling policy the engine really runs
(``x-appliance-scheduling-policy``, read from vLLM's own configuration in the app's state): the gateway's load poll
reads it, and writes a request's ``priority`` only for engines that schedule by it (an engine without this guard,
one the appliance does not run, says nothing and is treated as first come, first served).

Standard library only: it is imported inside the vLLM server, before anything of the appliance is needed there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

ENGINE_KEY_ENV = "VLLM_API_KEY"  # vLLM's own name for --api-key (vllm/envs.py)
OPEN_PATHS = frozenset({"/health", "/metrics"})
METRICS_PATH = "/metrics"
POLICY_HEADER = b"x-appliance-scheduling-policy"  # read by appliance/engine/load.py
UNAUTHORIZED = json.dumps({"error": "Unauthorized"}, separators=(",", ":")).encode()  # as vLLM answers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def engine_authorization(key: str | None) -> dict[str, str]:
    """The header the appliance sends with every request to an engine (none without a key)."""
    return {"authorization": f"Bearer {key}"} if key else {}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bearer_matches(authorization: str | None, key_digest: bytes) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time (on digests: the lengths leak nothing)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), key_digest)


class EngineKeyGuard:
    """Pure ASGI middleware; vLLM adds it with ``app.add_middleware(EngineKeyGuard)`` (no arguments)."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(ENGINE_KEY_ENV)
        self._digest = _digest(key) if key else None
        self._policy: bytes | None = None  # vLLM's scheduling policy, once read from its configuration

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _path(scope) == METRICS_PATH:
            await self.app(scope, receive, self._with_policy(scope, send))
            return
        if self._digest is None or scope["type"] not in ("http", "websocket") or self._admitted(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(UNAUTHORIZED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})

    def _with_policy(self, scope: Scope, send: Send) -> Send:
        """``send`` that adds the engine's scheduling policy to the response's headers (when vLLM's configuration
        says it: nothing otherwise)."""
        policy = self._policy = self._policy or scheduling_policy(scope)
        if policy is None:
            return send

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (POLICY_HEADER, policy)]
            await send(message)

        return with_header

    def _admitted(self, scope: Scope) -> bool:
        path = _path(scope)
        if path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        assert self._digest is not None
        return bearer_matches(authorization, self._digest)


def _path(scope: Scope) -> str:
    path: str = scope["path"]
    return path.removeprefix(scope.get("root_path", ""))


def scheduling_policy(scope: Scope) -> bytes | None:
    """The policy vLLM's scheduler runs (``fcfs``, ``priority``), from the configuration vLLM keeps in its app's
    state (``app.state.vllm_config``, set before it serves); None where there is none (not a vLLM server)."""
    state = getattr(scope.get("app"), "state", None)
    config = getattr(getattr(state, "vllm_config", None), "scheduler_config", None)
    policy = getattr(config, "policy", None)
    policy = getattr(policy, "value", policy)  # an enum in some versions, a string in 0.32
    return policy.encode() if isinstance(policy, str) and policy.isalnum() else None

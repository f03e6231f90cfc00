"""The engine's door: inside each vLLM server, every request but ``/health`` and ``/metrics`` needs the engine key.

vLLM's own ``--api-key`` (here its ``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``, ``/inference``
and ``/cohere`` (vllm/entrypoints/serve/middleware/authenticate.py, ``GUARDED_PREFIX``): ``/invocations`` (the
same completions and chat as ``/v1``, for SageMaker), ``/tokenize``, ``/pause``, ``/abort_requests``, ``/classify``
and the rest stay open to anyone who reaches the port. This middleware, which the appliance adds to every engine it
runs (``--middleware appliance.engine.guard.EngineKeyGuard``, appliance/engine/command.py), refuses them too, with
the 401 vLLM answers. It reads the same key from the same variable, so vLLM's check and this one agree; without
one it lets everything through, as vLLM does. ``/health`` (the gateway's health probe) and ``/metrics`` (its load
poll, Prometheus' scrape) stay open: they reveal no prompt and act on nothing.

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

    def _admitted(self, scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        assert self._digest is not None
        return bearer_matches(authorization, self._digest)

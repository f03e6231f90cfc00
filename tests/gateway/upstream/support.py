"""What a hook's unit test needs instead of a transport: an exchange as the transport makes one, attempts begun on
fake leases, and events in vLLM's shape."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request

from appliance.gateway.admission.slots import Lease
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Attempt, Block, HookChain, RequestHook
from tests.doubles import FakeReplica

RELEASED: list[tuple[str, Outcome]] = []


def request(headers: dict[str, str] | None = None) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw, "state": {}})


def exchange(body: dict[str, Any], *, route: str = "completions", tenant: str = "team-a",
             headers: dict[str, str] | None = None) -> Exchange:
    return Exchange(route=route, path=f"/v1/{'chat/' if route == 'chat' else ''}completions",
                    body=json.dumps(body).encode(), stream=bool(body.get("stream")), arrived=time.monotonic(),
                    headers=dict(headers or {}), request=request(headers), routing=RoutingRequest("hello"),
                    tenant=Tenant(tenant))


def chain(ex: Exchange, *hooks: RequestHook | None) -> HookChain:
    ex.hooks = HookChain([h for h in hooks if h is not None])
    return ex.hooks


def begin(ex: Exchange, replica: str = "replica-0", kind: str = "first") -> Attempt:
    lease = Lease(FakeReplica(replica), lambda r, o, t: RELEASED.append((r.name, o)), lambda r: None)
    return ex.begin(lease, 0.0, kind)


def block(raw: bytes) -> Block:
    return Block(raw, raw, time.monotonic(), raw.count(b"data: "))


def chunk(text: str, ids: list[int] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo", "choices": [choice],
                **extra})


def usage_event(prompt: int, completion: int) -> bytes:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo", "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}})


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

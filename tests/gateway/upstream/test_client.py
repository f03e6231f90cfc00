"""The client's side of an exchange (``appliance.gateway.upstream.client``) on a real server: a streamed answer's
chunks go out by the server's own ``send``, past the middleware's wrappers, and arrive whole and in order."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.serve import server_options
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import FakeEngine
from tests.gateway.live import LiveGateway

TOKENS = 12


class WatchedSends:
    """A pure ASGI middleware, outermost of the app's own: the type of every message of a completion that passes its
    ``send``."""

    seen: list[str] = []

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return

        async def watched(message: dict[str, Any]) -> None:
            WatchedSends.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, watched)


def test_a_streams_chunks_go_out_by_the_servers_send_and_arrive_whole() -> None:
    engine = FakeEngine(tokens=TOKENS).start()
    settings = Settings(served_model_name="demo")
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0", engine.url)], registry=CollectorRegistry())
    app.add_middleware(WatchedSends)
    WatchedSends.seen = []
    try:
        with LiveGateway(app, **server_options(settings)) as live, httpx.Client(base_url=live.url) as http:
            body = {"model": "demo", "prompt": "hi", "max_tokens": TOKENS, "stream": True}
            with http.stream("POST", "/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        engine.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum(1 for chunk in chunks if chunk["choices"] and chunk["choices"][0]["text"]) == TOKENS
    assert WatchedSends.seen == ["http.response.start"]  # every body chunk, the last one too, went past it

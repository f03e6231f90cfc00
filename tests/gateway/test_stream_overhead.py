"""What keeps the gateway's path to a stream's first token short (bench/stream_overhead.py measures it), where
it can be seen from outside: the relay's writes, where the routes' dependency runs, the collector's frozen heap."""

from __future__ import annotations

import gc
import inspect
import json
from typing import get_args

import pytest
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.context import Context
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, FakeEngine


@pytest.fixture
def one_read_upstream():
    """A vLLM-shaped stream whose events all leave in one write, as a loaded engine's socket delivers them to a
    loaded gateway: three token chunks (with their ids when asked, as the gateway does for migration), the usage
    event when asked, [DONE]."""
    upstream = FakeEngine(model=CountingModel(pieces=(" a", " b", " c")), tokens=3, writes="one").start()
    yield upstream
    upstream.stop()


@pytest.mark.parametrize("client_asks_usage", [False, True])
def test_the_events_of_one_upstream_read_reach_the_client_in_one_write(one_read_upstream, client_asks_usage):
    """One ASGI body message (one write to the client's socket) per upstream read, not one per event: the same bytes
    in fewer writes. The ids the gateway asked for are still cut out, and the usage event it asked for hidden."""
    app = create_app(Settings(served_model_name="demo"), replicas=lambda: [FakeReplica("r0", one_read_upstream.url)])
    bodies: list[bytes] = []

    async def recording(scope, receive, send):
        async def record(message):
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
            await send(message)

        await app(scope, receive, record if scope["type"] == "http" else send)

    request = {"model": "demo", "prompt": "hi", "max_tokens": 3, "stream": True}
    if client_asks_usage:
        request["stream_options"] = {"include_usage": True}
    with TestClient(recording) as client:
        bodies.clear()
        answer = client.post("/v1/completions", json=request)
    assert answer.status_code == 200
    assert len(bodies) == 1, bodies
    events = [e for e in bodies[0].split(b"\n\n") if e]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events if e.startswith(b"data: {") and b'"text"' in e]
    assert texts == [" a", " b", " c"]
    assert events[-1] == b"data: [DONE]"
    assert b'token_ids":[' not in bodies[0]  # the ids the gateway asked for: null, as vLLM writes them unasked
    assert (b'"usage"' in bodies[0]) is client_asks_usage


def test_the_routes_context_dependency_runs_on_the_event_loop():
    """FastAPI runs a plain function dependency in its thread pool: a thread hop, and a wait for the GIL, on every
    request's way to its first token. The routes' ``ctx: Context`` is a coroutine, run on the loop."""
    dependency = get_args(Context)[1].dependency
    assert inspect.iscoroutinefunction(dependency)


def test_the_heap_alive_at_startup_is_frozen_while_the_app_runs():
    """The collector's full passes skip what lives as long as the app; thawed when the app stops."""
    with TestClient(create_app(Settings(served_model_name="demo"), replicas=lambda: [])):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0

"""Rotating secrets by `appliance reload`: a replaced token or key stays valid for gateway.secret_overlap_seconds,
then is refused; a removed tenant is revoked at once (its queued requests answered 401, its streams ended with an
error event), keeps its quota debt if added back; the docs close when a reload adds keys; a YAML error never
echoes the file. Against a real uvicorn (real connections that stream while the reload happens) over the fake
engines, with the configuration file edited as an operator would."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.settings import load_settings
from tests.gateway.live import LiveGateway, wait_until
from tests.maintenance.support import fleet
from tests.maintenance.test_reload import BASE, StagingFleet, edit

TENANTS = [{"name": "team-a", "api_keys": ["key-a"]}, {"name": "team-b", "api_keys": ["key-b"]}]
COMPLETION = {"model": "demo", "prompt": "hi", "max_tokens": 2}
OVERLAP = 5  # seconds: the drill's checks within the window take well under it, even on a loaded host


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def appliance(stubs, tmp_path) -> Iterator[tuple[LiveGateway, Path]]:
    """A gateway started from a configuration file, serving over a real socket."""
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({**BASE, "tenants": TENANTS, "gateway": {"secret_overlap_seconds": OVERLAP}}))
    stager = StagingFleet(fleet([s.url for s in stubs]))
    app = create_app(load_settings(config), fleet=stager, registry=CollectorRegistry())
    with LiveGateway(app) as gateway:
        yield gateway, config


def reload(gateway: LiveGateway, token: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/admin/reload", headers=bearer(token), timeout=30)


def status(gateway: LiveGateway, token: str) -> int:
    return httpx.get(f"{gateway.url}/admin/status", headers=bearer(token), timeout=30).status_code


def stream(gateway: LiveGateway, key: str, max_tokens: int = 3) -> tuple[int, bytes]:
    """One streamed completion: its status and every byte the client got."""
    with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=bearer(key), timeout=60,
                      json={**COMPLETION, "max_tokens": max_tokens, "stream": True}) as response:
        return response.status_code, b"".join(response.iter_bytes())


def whole(gateway: LiveGateway, key: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", headers=bearer(key), json=COMPLETION, timeout=60)


def test_rotation_drill_old_token_and_key_work_within_the_overlap_then_not_and_no_request_is_lost(appliance):
    """The drill: a new admin token and a new key for team-a by reload, while team-a's clients keep sending with
    the old key; the old token and key are accepted within the window, refused after it, and every request sent
    meanwhile was answered in full."""
    gateway, config = appliance
    stop = threading.Event()
    results: list[tuple[int, bytes]] = []

    def client() -> None:
        while not stop.is_set():
            results.append(stream(gateway, "key-a"))
            response = whole(gateway, "key-a")
            results.append((response.status_code, response.content))

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client) for _ in range(4)]
        assert wait_until(lambda: len(results) >= 8)
        edit(config, admin_token="t0ken-2", tenants=[{"name": "team-a", "api_keys": ["key-a2"]}, TENANTS[1]])
        reloading = time.monotonic()  # the window starts after this, within the reload
        answer = reload(gateway, "t0ken")
        assert answer.status_code == 200, answer.text
        assert answer.json()["changed"] == ["gateway.admin_token", "tenants"]
        assert status(gateway, "t0ken") == 200 and status(gateway, "t0ken-2") == 200  # both, within the window
        assert whole(gateway, "key-a").status_code == 200 and whole(gateway, "key-a2").status_code == 200
        during = len(results)
        assert wait_until(lambda: len(results) >= during + 8)  # the old key's clients still served after it
        stop.set()
        for done in clients:
            done.result()
    assert time.monotonic() - reloading < OVERLAP, "the drill outran its overlap window: make OVERLAP longer"
    assert results and all(code == 200 for code, _ in results), [r for r in results if r[0] != 200][:3]
    streams = [body for _, body in results if body.startswith(b"data: ")]
    assert streams and all(body.endswith(b"data: [DONE]\n\n") for body in streams)  # none cut short
    assert wait_until(lambda: status(gateway, "t0ken") == 401, timeout=OVERLAP + 10)  # the window is over
    assert time.monotonic() - reloading >= OVERLAP
    assert status(gateway, "t0ken-2") == 200
    assert whole(gateway, "key-a").status_code == 401 and whole(gateway, "key-a2").status_code == 200
    # the old token can no longer reload either, and a later reload is not refused
    assert reload(gateway, "t0ken").status_code == 401
    assert reload(gateway, "t0ken-2").json()["changed"] == []


@pytest.mark.parametrize("token", ["alerts_token", "metrics_token"])
def test_the_narrower_tokens_rotate_too(stubs, tmp_path, token):
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({**BASE, token: "old", "gateway": {"secret_overlap_seconds": 0}}))
    app = create_app(load_settings(config), fleet=StagingFleet(fleet([s.url for s in stubs])),
                     registry=CollectorRegistry())
    with LiveGateway(app) as gateway:
        def call(credential: str) -> int:
            if token == "alerts_token":  # Alertmanager's webhook
                return httpx.post(f"{gateway.url}/admin/alerts", headers=bearer(credential),
                                  json={"version": "4", "status": "firing", "alerts": []}).status_code
            return httpx.get(f"{gateway.url}/metrics", headers=bearer(credential)).status_code

        assert call("old") == 200
        edit(config, **{token: "new"})
        answer = reload(gateway, "t0ken")
        assert answer.status_code == 200 and answer.json()["changed"] == [f"gateway.{token}"]
        assert call("new") == 200 and call("old") == 401  # no overlap configured: refused at once


def test_a_removed_tenant_is_revoked_its_queued_request_401_and_its_streams_end_with_an_error_event(appliance,
                                                                                                   stubs):
    gateway, config = appliance
    for engine in stubs:
        engine.tokens, engine.token_delay = 400, 0.02  # streams of ~8 s
    ctx = context_of(gateway.app)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, gateway, "key-b", 400) for _ in range(2)]
        assert wait_until(lambda: ctx.gateway.router.in_flight() == 2)
        for replica in ctx.gateway.router.replicas():  # one request per replica: the next one queues
            ctx.gateway.admission.limits._get(replica.name).value = 1
        queued = pool.submit(whole, gateway, "key-b")
        assert wait_until(lambda: ctx.gateway.admission.queue_length == 1)
        edit(config, tenants=[TENANTS[0]])
        answer = reload(gateway, "t0ken")
        assert answer.status_code == 200 and answer.json()["changed"] == ["tenants"]
        for engine in stubs:  # short answers from here on
            engine.tokens = 3
        refused = queued.result(timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        for cut in streams:
            code, body = cut.result(timeout=10)
            assert code == 200 and b"data: [DONE]" not in body
            last = json.loads(body.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
            assert last["error"]["code"] == "invalid_api_key" and "revoked" in last["error"]["message"]
    assert wait_until(lambda: ctx.gateway.router.in_flight() == 0)
    assert all(ctx.gateway.router.health_of(r.name).consecutive_failures == 0 for r in ctx.gateway.router.replicas())
    # the engines stopped generating for them: each notices its client gone on its own loop, a moment later
    assert wait_until(lambda: sum(engine.aborted for engine in stubs) == 2)
    assert whole(gateway, "key-b").status_code == 401 and whole(gateway, "key-a").status_code == 200


def test_a_removed_tenants_stream_still_waiting_for_its_engine_is_answered_401(appliance, stubs):
    """Cut between the request sent and the engine's answer: no byte of the stream has gone out, so the client
    gets a plain 401 instead of the stream."""
    gateway, config = appliance
    for engine in stubs:  # the next request holds its engine (and the answer's headers) for a while
        engine.freeze_at, engine.freeze_seconds = len(engine.received) + 1, 1.5
    ctx = context_of(gateway.app)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(stream, gateway, "key-b")
        assert wait_until(lambda: ctx.gateway.router.in_flight() == 1)
        edit(config, tenants=[TENANTS[0]])
        assert reload(gateway, "t0ken").status_code == 200
        code, body = waiting.result(timeout=10)
    assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert wait_until(lambda: ctx.gateway.router.in_flight() == 0)


def test_a_tenant_removed_and_added_back_keeps_its_spent_quota(appliance):
    gateway, config = appliance
    edit(config, tenants=[{**TENANTS[0], "requests_per_minute": 2}, TENANTS[1]])
    assert reload(gateway, "t0ken").status_code == 200
    assert [whole(gateway, "key-a").status_code for _ in range(3)] == [200, 200, 429]
    edit(config, tenants=[TENANTS[1]])
    assert reload(gateway, "t0ken").status_code == 200
    edit(config, tenants=[{**TENANTS[0], "requests_per_minute": 2}, TENANTS[1]])
    assert reload(gateway, "t0ken").status_code == 200
    refused = whole(gateway, "key-a")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_the_docs_close_when_a_reload_adds_keys(stubs, tmp_path):
    """An appliance started open serves /docs and /openapi.json (nothing to hide: anyone may call /v1); a reload
    that adds keys must close them, or they would describe the admin API to anyone."""
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump(BASE))
    app = create_app(load_settings(config), fleet=StagingFleet(fleet([s.url for s in stubs])),
                     registry=CollectorRegistry())
    with LiveGateway(app) as gateway:
        assert httpx.get(f"{gateway.url}/openapi.json").status_code == 200
        assert httpx.get(f"{gateway.url}/docs").status_code == 200
        assert httpx.get(f"{gateway.url}/metrics").status_code == 200  # open, like everything else
        edit(config, tenants=TENANTS)
        assert reload(gateway, "t0ken").status_code == 200
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            assert httpx.get(f"{gateway.url}{path}").status_code == 404, path
        assert httpx.get(f"{gateway.url}/metrics").status_code == 401  # tenants' usage: closed now too
        assert httpx.get(f"{gateway.url}/metrics", headers=bearer("t0ken")).status_code == 200


def test_a_yaml_error_in_a_reload_never_echoes_the_file(appliance):
    gateway, config = appliance
    config.write_text(config.read_text() + 'admin_token: "new-s3cret-token\nreplicas: [\n')
    answer = reload(gateway, "t0ken")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_config"
    message = answer.json()["error"]["message"]
    assert "s3cret" not in message and "line " in message and "column " in message

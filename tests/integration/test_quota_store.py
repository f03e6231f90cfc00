"""One quota across two gateways on a real vLLM engine, through a real redis-server: the appliance's own gateway
(a one-replica ``serve``) and a second gateway (an app in this process, routing to the same engine with the same
engine key) share the tenants' buckets; a tenant's requests quota holds across both, and with the store killed the
appliance keeps serving (failure open) and says so, then recovers when it is back, without a restart."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.redis_server import RedisServer
from tests.integration.harness import ApplianceProcess, serving

pytestmark = pytest.mark.engine

ENGINE_KEY = "quota-store-engine-key"
PREFIX = "it:quota"
TENANTS = [{"name": "team-q", "api_keys": ["key-q"], "requests_per_minute": 4},
           {"name": "team-t", "api_keys": ["key-t"], "tokens_per_minute": 100_000}]
BODY = {"model": "demo", "prompt": "The quota is shared by every gateway.", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def appliance(demo_model_int8, tmp_path_factory, store) -> Iterator[ApplianceProcess]:
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("quota-store"), replicas=1,
                           env={"APPLIANCE_TENANTS": json.dumps(TENANTS),
                                "APPLIANCE_GATEWAY__ENGINE_KEY": ENGINE_KEY,
                                "APPLIANCE_QUOTA_STORE__KIND": "redis",
                                "APPLIANCE_QUOTA_STORE__URL": store.url,
                                "APPLIANCE_QUOTA_STORE__KEY_PREFIX": PREFIX,
                                "APPLIANCE_QUOTA_STORE__PROBE_SECONDS": "0.2"})
    with serving(app) as running:
        yield running


@pytest.fixture(scope="module")
def second(appliance, store) -> Iterator[TestClient]:
    """Another gateway in front of the same engine, pointing at the same store."""
    engine = FakeReplica("replica-0", f"http://127.0.0.1:{appliance.engine_port(0)}")
    settings = Settings(served_model_name="demo", tenants=TENANTS, gateway={"engine_key": ENGINE_KEY},
                        engine={"max_model_len": 1024},
                        quota_store={"kind": "redis", "url": store.url, "key_prefix": PREFIX})
    with TestClient(create_app(settings, replicas=lambda: [engine]), raise_server_exceptions=False) as client:
        yield client


def post(target, key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if isinstance(target, TestClient):
        return target.post("/v1/completions", json=BODY, headers=headers)
    return httpx.post(f"{target.url}/v1/completions", json=BODY, headers=headers, timeout=120)


def test_a_requests_quota_holds_across_both_gateways(appliance, second):
    codes = [post(appliance if i % 2 == 0 else second, "key-q").status_code for i in range(8)]
    assert codes.count(200) == 4, codes  # each gateway alone would have granted 4
    assert codes[:2] == [200, 200]  # both served the tenant
    refused = post(appliance, "key-q")
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_an_unreachable_store_fails_open_and_recovers(appliance, store):
    assert post(appliance, "key-t").status_code == 200
    store.kill()
    try:
        answered = post(appliance, "key-t")
        assert answered.status_code == 200  # failure open: served without its quota checked
        health = httpx.get(f"{appliance.url}/health/serving", timeout=10).json()
        assert health["quota_store"]["kind"] == "redis" and health["quota_store"]["reachable"] is False
    finally:
        store.start()
    time.sleep(0.3)
    assert post(appliance, "key-t").status_code == 200
    assert httpx.get(f"{appliance.url}/health/serving", timeout=10).json()["quota_store"]["reachable"] is True
    log = (appliance.state_dir / "appliance.log").read_text()
    assert log.count("unreachable (") == 1 and log.count("reachable again") == 1

"""Each tenant's own prefix cache: the cache salt the gateway sets (from the tenant, never the client), what a
tenant can learn from ``cached_tokens`` about another's prompts (nothing), groups that share a cache on purpose, and
the router's prefix index keyed on the same salt. Against the fake engine with its prefix cache model (whole blocks,
the salt in the first block's hash, as vLLM 0.32); real engines: tests/integration/test_tenants.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.gateway.routing.prefix_index import block_hashes
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.schemas import CACHE_SALT_FORBIDDEN
from appliance.gateway.tenants.directory import Tenant, TenantDirectory
from appliance.gateway.tenants.isolation import CacheIsolation, cache_scope, salt_for
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import FakeEngine
from tests.gateway.upstream.support import exchange

TENANTS = [{"name": "team-a", "api_keys": ["key-a"]}, {"name": "team-b", "api_keys": ["key-b"]},
           {"name": "svc-1", "api_keys": ["key-1"], "cache_group": "product"},
           {"name": "svc-2", "api_keys": ["key-2"], "cache_group": "product"}]
PROMPT = "A long system prompt that one tenant keeps to itself and nobody else may probe for. " * 6


@pytest.fixture
def engine():
    fake = FakeEngine(prefix_caching=True, block_size=16).start()
    yield fake
    fake.stop()


def gateway(engine: FakeEngine, tenants: list[dict] | None = TENANTS) -> TestClient:
    replicas = [FakeReplica("replica-0", engine.url)]
    settings = Settings(served_model_name="demo", tenants=tenants or [], collectors={"enabled": False},
                        gateway={"engine_key": "engine-secret"})
    return TestClient(create_app(settings, replicas=lambda: replicas, registry=CollectorRegistry()),
                      raise_server_exceptions=False)


def cached(client: TestClient, key: str | None, **extra) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    answer = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_cannot_see_another_tenants_cached_prompt(engine):
    """The probe that salting closes: A's prompt is cached for A; B sending the same prompt finds nothing cached,
    whatever cache_salt it sends itself; A still finds its own."""
    with gateway(engine) as client:
        assert cached(client, "key-a") == 0
        assert cached(client, "key-a") > 0
        assert cached(client, "key-b") == 0
        salt_of_a = engine.received[0].body["cache_salt"]
        assert cached(client, "key-b", cache_salt=salt_of_a) == 0  # A's salt itself, sent by B, is folded in
        assert cached(client, "key-b", cache_salt="shared") == 0
        assert cached(client, "key-a") > 0
        sent = [r.body["cache_salt"] for r in engine.received]
        assert sent[0] == sent[1] == sent[-1] != sent[2]  # one salt per tenant, the gateway's


def test_a_client_salt_partitions_its_own_tenants_cache_only(engine):
    with gateway(engine) as client:
        assert cached(client, "key-a", cache_salt="user-1") == 0
        assert cached(client, "key-a", cache_salt="user-1") > 0
        assert cached(client, "key-a", cache_salt="user-2") == 0
        assert cached(client, "key-a") == 0  # the tenant's own cache is another partition
        assert cached(client, "key-b", cache_salt="user-1") == 0


def test_tenants_of_one_cache_group_share_their_cache(engine):
    with gateway(engine) as client:
        assert cached(client, "key-1") == 0
        assert cached(client, "key-2") > 0
        assert cached(client, "key-a") == 0


def test_without_any_key_requests_keep_the_shared_cache_and_their_own_salt(engine):
    with gateway(engine, tenants=None) as client:
        assert cached(client, None) == 0
        assert cached(client, None) > 0
        assert "cache_salt" not in engine.received[-1].body
        cached(client, None, cache_salt="mine")
        assert engine.received[-1].body["cache_salt"] == "mine"  # forwarded as before


@pytest.mark.parametrize("salt", ["", "a@b", "a/b", "x" * 129, 7])
def test_a_salt_vllm_would_refuse_is_refused(engine, salt):
    with gateway(engine) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt},
                             headers={"authorization": "Bearer key-a"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt"
        assert not engine.received


def test_salts_are_per_scope_keyed_and_inside_vllms_limits():
    salts = {salt_for(b"k", "tenant:a"), salt_for(b"k", "tenant:b"), salt_for(b"k", "group:a"),
             salt_for(b"k", "tenant:a", "x"), salt_for(None, "tenant:a"), salt_for(b"other", "tenant:a")}
    assert len(salts) == 6
    assert salt_for(b"k", "tenant:a") == salt_for(b"k", "tenant:a")  # every gateway with the key agrees
    assert salt_for(b"k", "tenant:a", "b") != salt_for(b"k", "tenant:ab")  # parts are framed, not concatenated
    for salt in salts:
        assert 0 < len(salt) <= 128 and not set(salt) & CACHE_SALT_FORBIDDEN
    assert cache_scope(Tenant("a")) == "tenant:a" and cache_scope(Tenant("a", cache_group="g")) == "group:g"


def test_the_router_sees_the_salted_prompt():
    """Prefix affinity keys on the salt: the same prompt under two tenants' salts shares no block, so a replica
    holding A's blocks does not attract B's identical prompt."""
    isolation = CacheIsolation(TenantDirectory([]), "k")
    isolation.directory.update([], ["flat-key"])  # a key is set: requests have a tenant
    a, b = exchange({"prompt": PROMPT}, tenant="team-a"), exchange({"prompt": PROMPT}, tenant="team-b")
    for ex in (a, b):
        ex.routing = RoutingRequest(PROMPT)
        assert isolation.start(ex) is None
    assert json.loads(a.body)["cache_salt"] == a.routing.salt != b.routing.salt
    hashes_a, hashes_b = a.routing.hashes(64), b.routing.hashes(64)
    assert hashes_a and not set(hashes_a) & set(hashes_b)
    assert block_hashes(PROMPT, 64) == RoutingRequest(PROMPT).hashes(64)  # unsalted: as before

"""The tenant's priority inside the engine: what the gateway writes as vLLM's ``priority`` (the tenant's priority,
then its fair-share standing), only for engines that said they schedule by it, never what a client sent; a
continuation's too; and where the operator sees which engines do. Against the fake engine, which reports a policy
as the appliance's engine guard does (real vLLM: tests/integration/test_tenants.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.priority import BACKGROUND, EnginePriority, engine_priority
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import Failure, FakeEngine
from tests.gateway.live import LiveGateway, wait_until
from tests.gateway.test_fair_share import make
from tests.gateway.upstream.support import begin, block, chain, exchange

TENANTS = [{"name": "interactive", "api_keys": ["key-i"], "priority": 9},
           {"name": "batch", "api_keys": ["key-b"]}]
SCRAPE = {"authorization": "Bearer scrape"}


def test_a_higher_tenant_priority_goes_first_and_over_its_share_goes_behind_its_peers():
    high, low = Tenant("i", priority=9), Tenant("b", priority=0)
    assert engine_priority(high, False) == 0 < engine_priority(high, True) == 1  # vLLM: lower first
    assert engine_priority(high, True) < engine_priority(low, False) == 18 < engine_priority(low, True) == 19


def test_over_share_is_a_tenant_ahead_of_the_least_served_active_peer_of_its_priority():
    async def scenario() -> None:
        admission = make(limit=4)
        a, b, other = Tenant("a"), Tenant("b"), Tenant("c", priority=5)
        first = await admission.acquire(tenant=a)
        assert not admission.over_share(a)  # alone: nobody's share to be over
        second = await admission.acquire(tenant=b)
        await admission.acquire(tenant=other)
        assert not admission.over_share(a) and not admission.over_share(b)  # one dispatch each: level
        admission.charge(a, 500)  # a's answers were long (both still hold their lease: both active)
        assert admission.over_share(a) and not admission.over_share(b)
        assert not admission.over_share(other)  # a peer at another priority is no measure
        second.release(Outcome.SUCCESS)
        assert not admission.over_share(a)  # b has nothing in flight: a is alone at its priority again
        first.release(Outcome.SUCCESS)
        off = make(limit=4, fair_share=False)
        await off.acquire(tenant=a)
        await off.acquire(tenant=b)
        off.charge(a, 500)
        assert not off.over_share(a)  # no fair share, no standing

    asyncio.run(scenario())


def hook(policy: str | None) -> EnginePriority:
    return EnginePriority(make(limit=4), lambda _replica: policy)


@pytest.mark.parametrize(("policy", "client", "sent"), [
    ("priority", None, 0), ("priority", -100, 0),  # the gateway's value, whatever the client sent
    ("fcfs", 5, 0), (None, 5, 0),  # an engine that does not schedule by it gets vLLM's default
    ("fcfs", None, None), (None, None, None),  # ...and nothing at all when the client sent nothing
])
def test_the_priority_is_the_gateways_never_the_clients(policy, client, sent):
    body = {"prompt": "hi", **({"priority": client} if client is not None else {})}
    ex = exchange(body)
    ex.tenant = Tenant("team-a", priority=9)
    chain(ex, hook(policy).start(ex))
    begin(ex)
    assert json.loads(ex.body).get("priority") == sent
    assert ex.parsed().get("priority") == sent


def test_each_attempt_gets_the_priority_of_the_replica_that_took_it():
    policies = {"replica-0": "priority", "replica-1": "fcfs"}
    ex = exchange({"prompt": "hi"})
    ex.tenant = Tenant("team-a", priority=4)
    hooks = chain(ex, EnginePriority(make(limit=4), policies.get).start(ex))
    begin(ex, "replica-0")
    assert json.loads(ex.body)["priority"] == 10
    begin(ex, "replica-1", "retry")
    assert json.loads(ex.body)["priority"] == 0
    assert hooks is ex.hooks


@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_is_in_prefill_until_its_first_event_and_a_whole_answer_never_counts(stream):
    async def scenario() -> None:
        admission = make(limit=4, prefills=1)
        ex = exchange({"prompt": "hi", "stream": stream})
        chain(ex, EnginePriority(admission, lambda _replica: "fcfs").start(ex))
        ex.begin(await admission.acquire(tenant=ex.tenant), 0.0, "first")
        assert admission.tenant_prefilling("team-a") == (1 if stream else 0)
        ex.hooks.relayed(block(b""))  # a read with no whole event yet
        assert admission.tenant_prefilling("team-a") == (1 if stream else 0)
        ex.hooks.relayed(block(b'data: {"choices": []}\n\n'))
        assert admission.tenant_prefilling("team-a") == 0 and admission.tenant_in_flight("team-a") == 1
        ex.settle(Outcome.SUCCESS)
        assert admission.tenant_in_flight("team-a") == 0

    asyncio.run(scenario())


def test_through_the_gateway_a_stream_leaves_prefill_at_its_first_event_and_the_count_returns_to_zero():
    engine = FakeEngine(first_token_delay=0.5, token_delay=0.3).start()
    try:
        live, _ = app([engine], admission={"over_share_prefills": 1})
        with live:
            admission = context_of(live.app).gateway.admission
            body = {"model": "demo", "prompt": "hello", "max_tokens": 3, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30,
                              headers={"authorization": "Bearer key-i"}) as response:
                assert wait_until(lambda: admission.tenant_in_flight("interactive") == 1, timeout=10)
                assert admission.tenant_prefilling("interactive") == 1  # the engine has not answered yet
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert admission.tenant_prefilling("interactive") == 0  # its first event: out of prefill
                assert admission.tenant_in_flight("interactive") == 1  # still streaming
                list(lines)
            assert wait_until(lambda: admission.tenant_in_flight("interactive") == 0, timeout=10)
            assert admission.tenant_prefilling("interactive") == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("tenant_priority", [0, 9])
def test_batch_work_goes_behind_every_interactive_request(tenant_priority):
    admission = make(limit=4)
    ex = exchange({"prompt": "hi"})
    ex.tenant, ex.background = Tenant("team-a", priority=tenant_priority), True
    chain(ex, EnginePriority(admission, lambda _replica: "priority").start(ex))
    begin(ex)
    lowest = max(engine_priority(Tenant("t", priority=p), over) for p in range(10) for over in (False, True))
    assert json.loads(ex.body)["priority"] == BACKGROUND > lowest == 19


def app(engines: list[FakeEngine], **settings) -> tuple[LiveGateway, list[FakeReplica]]:
    replicas = [FakeReplica(f"replica-{i}", e.url) for i, e in enumerate(engines)]
    config = Settings(served_model_name="demo", tenants=TENANTS, collectors={"enabled": False},
                      gateway={"metrics_token": "scrape"},
                      routing={"metrics_poll_seconds": 0.05, **settings.pop("routing", {})}, **settings)
    return LiveGateway(create_app(config, replicas=lambda: replicas, registry=CollectorRegistry())), replicas


def polled(live: LiveGateway, count: int) -> bool:
    loads = context_of(live.app).gateway.router.loads()
    return wait_until(lambda: len(loads) >= count, timeout=10)


def post(live: LiveGateway, key: str, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, **body},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_priority_reaches_an_engine_that_schedules_by_it_and_the_operator_sees_which_do():
    engines = [FakeEngine(scheduling_policy="priority").start(), FakeEngine().start()]
    try:
        live, _ = app(engines[:1])
        with live:
            assert polled(live, 1)
            assert post(live, "key-i", priority=7).status_code == 200
            assert post(live, "key-b").status_code == 200
            assert [r.body["priority"] for r in engines[0].received] == [0, 18]
            metrics = httpx.get(live.url + "/metrics", headers=SCRAPE, timeout=10).text
            assert 'appliance_replica_scheduling_policy{policy="priority",replica="replica-0"} 1.0' in metrics
        live, _ = app(engines[1:])  # an engine that does not say (not run by the appliance): none written
        with live:
            assert polled(live, 1)
            assert post(live, "key-i", priority=7).status_code == 200
            assert post(live, "key-b").status_code == 200
            assert [r.body.get("priority") for r in engines[1].received] == [0, None]
            metrics = httpx.get(live.url + "/metrics", headers=SCRAPE, timeout=10).text
            assert 'appliance_replica_scheduling_policy{policy="unknown",replica="replica-0"} 1.0' in metrics
            status = context_of(live.app).fleet_status.fleet(False)
            assert status["replicas"][0]["scheduling_policy"] is None
    finally:
        for engine in engines:
            engine.stop()


def test_a_continuation_carries_the_priority_for_its_own_replica():
    failures = [Failure(after=3)]
    engines = [FakeEngine(failures=failures, scheduling_policy="priority").start() for _ in range(2)]
    try:
        live, _ = app(engines, routing={"migration_limit": 1})
        with live:
            assert polled(live, 2)
            with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                              json={"prompt": "The import system", "max_tokens": 8, "stream": True},
                              headers={"authorization": "Bearer key-b"}) as response:
                payload = response.read()
        assert payload.endswith(b"data: [DONE]\n\n")
        legs = [r.body for e in engines for r in e.received]
        assert len(legs) == 2 and all(leg["priority"] in (18, 19) for leg in legs), legs
        assert any(isinstance(leg["prompt"], list) for leg in legs)  # the continuation
    finally:
        for engine in engines:
            engine.stop()


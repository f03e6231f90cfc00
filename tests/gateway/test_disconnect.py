"""A client that hangs up stops its work: the engine's request is aborted, a queued request is never sent, and
both count as 499, not as successes. Against a real uvicorn, so that the client really disconnects."""

import json

import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.live import LiveGateway, wait_until

BODY = json.dumps({"prompt": "hi", "max_tokens": 5}).encode()


def counted(registry: CollectorRegistry, code: str) -> float:
    return registry.get_sample_value("appliance_requests_total", {"route": "completions", "code": code}) or 0.0


@pytest.fixture
def gateway(stubs):
    def build(replicas: int = 2, **overrides) -> tuple[LiveGateway, CollectorRegistry]:
        registry = CollectorRegistry()
        fleet = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs[:replicas])]
        app = create_app(Settings(served_model_name="demo", **overrides), replicas=lambda: fleet,
                         registry=registry)
        return LiveGateway(app), registry

    return build


def test_client_leaving_while_the_engine_generates_aborts_it(gateway, stubs):
    for stub in stubs:
        stub.first_token_delay = 20.0  # far longer than the test waits: only an abort ends it in time
    live, registry = gateway()
    with live:
        live.post_and_hang_up("/v1/completions", BODY, after_seconds=0.3)
        assert wait_until(lambda: sum(s.aborted for s in stubs) == 1, timeout=10)
        assert wait_until(lambda: counted(registry, "499") == 1)
        assert sum(s.answered for s in stubs) == 0
        assert counted(registry, "200") == 0
        assert context_of(live.app).gateway.router.in_flight() == 0


def test_request_abandoned_in_the_queue_is_never_dispatched(gateway, stubs):
    stubs[0].first_token_delay = 1.5
    live, registry = gateway(replicas=1, admission={"max_limit": 1, "queue_timeout_seconds": 30})
    with live:
        import threading

        holder = threading.Thread(target=live.post_and_hang_up, args=("/v1/completions", BODY, 4.0))
        holder.start()  # takes the only slot and keeps its client for the whole answer
        assert wait_until(lambda: len(stubs[0].received) == 1)
        live.post_and_hang_up("/v1/completions", BODY, after_seconds=0.3)  # queued behind it, then gone
        assert wait_until(lambda: counted(registry, "499") == 1)
        assert context_of(live.app).gateway.admission.queue_length == 0
        holder.join()
        assert wait_until(lambda: counted(registry, "200") == 1)
        assert len(stubs[0].received) == 1  # the abandoned request never reached the engine
        assert context_of(live.app).gateway.router.in_flight() == 0

"""The prompt travels from the parsed request to the router (fake engines: the gateway's own logic only)."""

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from appliance.app import create_app
from appliance.context import context_of
from appliance.settings import Settings


def samples(client) -> dict[tuple, float]:
    page = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page) for s in family.samples}


def test_a_follow_up_turn_matches_the_prefix_its_conversation_left(client):
    system = {"role": "system", "content": "You are a terse assistant for conversation 42. " * 10}
    first = [system, {"role": "user", "content": "hello"}]
    follow_up = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and then?"}]
    for messages in (first, follow_up):
        assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "unrelated text " * 20, "max_tokens": 4}).status_code == 200
    values = samples(client)
    assert values[("appliance_routing_prefix_match_ratio_count", ())] == 3
    assert values[("appliance_routing_prefix_match_ratio_bucket", (("le", "0.0"),))] == 2  # first turn, unrelated
    assert values[("appliance_routing_prefix_match_ratio_bucket", (("le", "0.8"),))] == 2  # the follow-up: > 0.8
    assert values[("appliance_routing_duration_seconds_count", ())] == 3


def test_the_request_span_carries_the_routing_decision(replicas, stubs):
    for stub in stubs:  # engines that have not sized their KV cache yet: the cache-room scorer has no opinion
        stub.num_gpu_blocks = None
    exporter = InMemorySpanExporter()
    app = create_app(Settings(), replicas=lambda: replicas, span_exporter=exporter)
    with TestClient(app) as client:
        for _ in range(2):
            client.post("/v1/completions", json={"prompt": "the same long prompt " * 10, "max_tokens": 2})
        context_of(app).gateway.tracer_provider.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name == "gateway completions"]
    assert [s.attributes["appliance.routing.decided_by"] for s in roots] == ["index", "prefix"]
    assert roots[1].attributes["appliance.routing.score"] > roots[0].attributes["appliance.routing.score"]

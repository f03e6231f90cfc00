"""Spans per request and hop, joined to the caller's trace."""

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from appliance.app import create_app
from appliance.settings import Settings


def test_spans_per_hop_in_the_callers_trace(replicas):
    exporter = InMemorySpanExporter()
    app = create_app(Settings(), replicas=lambda: replicas, span_exporter=exporter)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True},
                           headers={"traceparent": traceparent}) as response:
            list(response.iter_lines())
        app.state.tracer_provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"gateway completions", "gateway.queue_wait", "gateway.upstream", "gateway.stream"} <= set(spans)
    root = spans["gateway completions"]
    assert format(root.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert all(s.parent.span_id == root.context.span_id for n, s in spans.items() if n != root.name)
    assert [e.name for e in spans["gateway.upstream"].events] == ["first_token"]


def test_without_exporter_no_span_is_made_but_context_still_reaches_the_engine(client, stubs):
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # not sampled
    client.post("/v1/completions", json={"prompt": "hi"}, headers={"traceparent": traceparent})
    headers = [h for stub in stubs for h in stub.headers][0]
    assert headers["traceparent"] == traceparent

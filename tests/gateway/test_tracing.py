"""Spans per request and hop, joined to the caller's trace."""

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from appliance.app import create_app
from appliance.context import context_of
from appliance.settings import Settings


def test_spans_per_hop_in_the_callers_trace(replicas):
    exporter = InMemorySpanExporter()
    app = create_app(Settings(), replicas=lambda: replicas, span_exporter=exporter)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True},
                           headers={"traceparent": traceparent}) as response:
            list(response.iter_lines())
        context_of(app).gateway.tracer_provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"gateway completions", "gateway.queue_wait", "gateway.upstream", "gateway.stream"} <= set(spans)
    root = spans["gateway completions"]
    assert format(root.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert all(s.parent.span_id == root.context.span_id for n, s in spans.items() if n != root.name)
    assert [e.name for e in spans["gateway.upstream"].events] == ["first_token"]


def test_without_exporter_no_span_is_made_but_context_still_reaches_the_engine(client, stubs):
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # not sampled
    client.post("/v1/completions", json={"prompt": "hi"}, headers={"traceparent": traceparent})
    headers = [r.headers for stub in stubs for r in stub.received][0]
    assert headers["traceparent"] == traceparent


def _traceparent(trace_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-00f067aa0ba902b7-{'01' if sampled else '00'}"


def _exported_trace_ids(ratio: float, trace_ids: list[int], sampled: bool, replicas, stubs) -> tuple[set, list]:
    """Send one request per trace id with the caller's sampled flag as given; the trace ids of the exported
    gateway roots, and the traceparents the engines received."""
    exporter = InMemorySpanExporter()
    app = create_app(Settings(trace_sample_ratio=ratio), replicas=lambda: replicas, span_exporter=exporter)
    for stub in stubs:
        stub.received.clear()
    with TestClient(app) as client:
        for trace_id in trace_ids:
            response = client.post("/v1/completions", json={"prompt": "hi"},
                                   headers={"traceparent": _traceparent(trace_id, sampled)})
            assert response.status_code == 200
        context_of(app).gateway.tracer_provider.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name == "gateway completions"]
    for root in roots:  # a sampled request continues the caller's trace: its span is the parent
        assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7 and root.parent.is_remote
    sent = [r.headers["traceparent"] for stub in stubs for r in stub.received]
    return {root.context.trace_id for root in roots}, sent


def test_the_gateway_decides_sampling_not_the_callers_flag(replicas, stubs):
    """Issue 21: a client's sampled traceparent must not force export past trace_sample_ratio. For every trace
    id the decision is the same whether the caller's flag says sampled or not, and it is the ratio's rule on
    the trace id (TraceIdRatioBased: its low 64 bits below ratio x 2^64), so the exported share follows the
    ratio and not the callers. Every request keeps the caller's trace id on its way to the engine, which gets
    the gateway's decision in the flags."""
    import random

    ratio = 0.25
    rng = random.Random(21)
    trace_ids = [rng.getrandbits(128) | 1 for _ in range(24)]
    expected = {t for t in trace_ids if t & (2**64 - 1) < round(ratio * 2**64)}
    assert 0 < len(expected) < len(trace_ids), "the sample holds both decisions"
    flagged, sent_flagged = _exported_trace_ids(ratio, trace_ids, True, replicas, stubs)
    unflagged, sent_unflagged = _exported_trace_ids(ratio, trace_ids, False, replicas, stubs)
    assert flagged == unflagged == expected
    for sent in (sent_flagged, sent_unflagged):
        assert sorted(int(tp.split("-")[1], 16) for tp in sent) == sorted(trace_ids)
        decided = {int(tp.split("-")[1], 16): tp.endswith("-01") for tp in sent}
        assert {t for t, sampled in decided.items() if sampled} == expected


def test_a_zero_ratio_exports_nothing_whatever_the_caller_asks(replicas, stubs):
    """With an exporter but ratio 0 (and likewise without an exporter) a caller's sampled flag makes nothing
    exported; the engine gets the caller's trace id with the gateway's decision, not sampled."""
    trace_ids = [0x4BF92F3577B34DA6A3CE929D0E0E4736, 1]
    exported, sent = _exported_trace_ids(0.0, trace_ids, True, replicas, stubs)
    assert exported == set()
    assert sorted(int(tp.split("-")[1], 16) for tp in sent) == sorted(trace_ids)
    assert all(tp.endswith("-00") for tp in sent)

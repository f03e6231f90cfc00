"""Observation as a hook, without a transport: TTFT from the first relayed event, one gap per block, the answer's
usage as the client's stream states it, and the spans of an attempt."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from appliance.gateway.observation.hook import Observation
from appliance.gateway.observation.metrics import RequestMetrics
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.hook import Block, End
from tests.gateway.upstream.support import DONE, begin, chain, chunk, exchange, usage_event


def observed(tracing: bool = False):
    registry = CollectorRegistry()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Observation(RequestMetrics(registry, slo_ttft_seconds=1.0), provider.get_tracer("t"),
                       tracing=tracing), registry, exporter


def test_a_stream_is_observed_once_per_block_and_counted_once() -> None:
    observation, registry, _ = observed()
    ex = exchange({"prompt": "hi", "stream": True})
    hooks = chain(ex, observation.start(ex))
    begin(ex)
    hooks.sending(ex.attempt, {})
    now = time.monotonic()
    for i, raw in enumerate([chunk("a") + chunk("b"), chunk("c", finish="length"), usage_event(3, 3) + DONE]):
        hooks.relayed(Block(raw, raw, now + i * 0.01, raw.count(b"data: ")))
    hooks.finished(End(200, Outcome.SUCCESS, True, now + 0.05))
    sample = registry.get_sample_value
    assert sample("appliance_requests_total", {"route": "completions", "code": "200"}) == 1
    assert sample("appliance_request_ttft_seconds_count", {"route": "completions"}) == 1
    assert sample("appliance_request_itl_seconds_count", {"route": "completions"}) == 2  # three blocks, two gaps
    assert sample("appliance_tokens_total", {"kind": "completion"}) == 3
    assert ex.request.scope["appliance.counted"] is True


def test_the_trace_context_goes_to_the_engine_and_the_spans_end() -> None:
    observation, _, exporter = observed(tracing=True)
    ex = exchange({"prompt": "hi"})
    hooks = chain(ex, observation.start(ex))
    hooks.queued(0.01)
    attempt = begin(ex)
    headers: dict[str, str] = {}
    hooks.sending(attempt, headers)
    assert headers["traceparent"].startswith("00-")
    hooks.relayed(Block(b"{}", b"{}", time.monotonic()))
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["gateway completions", "gateway.queue_wait", "gateway.upstream"]

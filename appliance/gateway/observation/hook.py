"""Observation: the request's metrics and spans, as a hook around its life.

Metrics: every answer counted once by route and status, TTFT as the client sees it (arrival at the gateway to the
first relayed byte), inter-token gaps, time per output token, end-to-end latency, queue wait, and the tokens of
the engines' usage reports as the client's answer states them. Spans: ``gateway.request`` with children for the
queue wait, each attempt's upstream call until its first byte, and the stream; the trace context goes to the
engine with each attempt (``sending``), so vLLM's own spans join the caller's trace.

Per event it keeps three numbers (first, last, events) and observes one gap per relayed block: the events of one
read go to the client in one write, so one gap is what the client sees.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from appliance.gateway.observation.metrics import COUNTED, RequestMetrics
from appliance.gateway.observation.tracing import RequestTrace
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.usage import USAGE, body_usage, events_usage
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Attempt, Block, End, RequestHook


class Observation:
    """The hook: built once with the gateway's request metrics and tracer."""

    name = "observation"

    def __init__(self, metrics: RequestMetrics, tracer: trace.Tracer, *, tracing: bool) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.tracing = tracing  # the gateway records traces (an exporter and a ratio above 0)

    def start(self, exchange: Exchange) -> ObservedRequest:
        exchange.trace = RequestTrace(self.tracer, exchange.route, exchange.request.headers, recording=self.tracing)
        return ObservedRequest(self.metrics, exchange)


class ObservedRequest(RequestHook):
    """One request's observations."""

    __slots__ = ("metrics", "exchange", "itl", "first", "last", "events", "usage", "upstream_span", "stream_span")

    def __init__(self, metrics: RequestMetrics, exchange: Exchange) -> None:
        self.metrics = metrics
        self.exchange = exchange
        self.itl = metrics.itl.labels(exchange.route) if exchange.stream else None  # looked up once
        self.first: float | None = None
        self.last: float | None = None
        self.events = 0
        self.usage: dict[str, Any] | None = None  # the answer's final usage, as the client's answer states it
        self.upstream_span: trace.Span | None = None
        self.stream_span: trace.Span | None = None

    # -- decisions ------------------------------------------------------------------------------------------------

    def queued(self, seconds: float) -> None:
        self.metrics.queue_wait.observe(seconds)
        self.exchange.trace.elapsed("gateway.queue_wait", seconds)

    def admitted(self, attempt: Attempt) -> None:
        root = self.exchange.trace.root
        root.set_attribute("appliance.replica", attempt.replica)
        if attempt.decision is not None:
            root.set_attribute("appliance.routing.score", attempt.decision.score)
            root.set_attribute("appliance.routing.decided_by", attempt.decision.decided_by)

    def sending(self, attempt: Attempt, headers: dict[str, str]) -> None:
        trace_ = self.exchange.trace
        self.upstream_span = trace_.child("gateway.upstream", trace.SpanKind.CLIENT,
                                          **{"appliance.replica": attempt.replica})
        trace_.propagate(self.upstream_span, headers)
        if self.exchange.stream and self.stream_span is None:
            self.stream_span = trace_.child("gateway.stream")

    def attempt_ended(self, attempt: Attempt) -> None:
        self._end_upstream_span()

    def finished(self, end: End) -> None:
        exchange, metrics = self.exchange, self.metrics
        exchange.request.scope[COUNTED] = True  # the error handlers must not count it again
        metrics.requests.labels(exchange.route, str(end.status)).inc()
        if end.status < 400:
            metrics.e2e.labels(exchange.route).observe(end.at - exchange.arrived)
        if end.outcome is Outcome.SUCCESS:
            metrics.observe_usage(self.usage)
            if exchange.stream and self.first is not None:
                self._observe_stream(self.first - exchange.arrived)
        self._end_upstream_span()
        exchange.trace.finish(end.status)

    def _observe_stream(self, ttft: float) -> None:
        route = self.exchange.route
        self.metrics.ttft.labels(route).observe(ttft)
        # Tokens from the engine's usage report, else one per content event (vLLM streams one token per event;
        # the final "[DONE]" is not one).
        tokens = (self.usage or {}).get("completion_tokens") or max(0, self.events - 1)
        if tokens > 1 and self.last is not None and self.first is not None:
            self.metrics.tpot.labels(route).observe((self.last - self.first) / (tokens - 1))

    def _end_upstream_span(self) -> None:
        if self.upstream_span is not None:
            self.upstream_span.end()
            self.upstream_span = None

    # -- relay ----------------------------------------------------------------------------------------------------

    def relayed(self, block: Block) -> None:
        if self.upstream_span is not None:  # the attempt's first byte
            self.upstream_span.add_event("first_token")
            self._end_upstream_span()
        if not self.exchange.stream:
            if block.usage is None:
                block.usage = body_usage(block.out)
            self.usage = block.usage
            return
        if block.events:
            if self.first is None:
                self.first = block.at
            elif self.last is not None and self.itl is not None:
                self.itl.observe(block.at - self.last)
            self.last = block.at
            self.events += block.events
        if block.usage is not None:
            self.usage = block.usage
        elif USAGE in block.out:
            self.usage = events_usage(block.out) or self.usage


"""OpenTelemetry tracing for the gateway: one span per request with children per hop, context sent to vLLM.

The tracer provider lives on the app (not the process-global one), so tests and several apps in one process do
not share state. Without an OTLP endpoint nothing is recorded or exported; the caller's trace id still goes to
the engine, so vLLM's own spans (if it exports any) can join the caller's trace.

The gateway decides sampling, never the client: the root sampler is ``TraceIdRatioBased`` alone, not
``ParentBased``, so a caller's sampled ``traceparent`` cannot force span export past ``trace_sample_ratio`` (any
client could otherwise make every one of its requests exported: a cost, and a flood of the trace store). The
span still continues the caller's trace (same trace id, the caller's span as parent), so a sampled request
correlates with the caller's own spans; and the decision is a function of the trace id, so every hop that
samples by the same ratio keeps or drops the same traces. What goes to the engine carries the gateway's
decision in its flags.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from appliance.gateway.settings import GatewaySettings

PROPAGATOR = TraceContextTextMapPropagator()


def build_tracer_provider(settings: GatewaySettings, exporter: SpanExporter | None = None) -> TracerProvider:
    ratio = settings.trace_sample_ratio if (settings.otlp_traces_endpoint or exporter) else 0.0
    provider = TracerProvider(resource=Resource.create({"service.name": "appliance-gateway"}),
                              sampler=TraceIdRatioBased(ratio))
    if exporter is None and settings.otlp_traces_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def extract_context(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from its ``traceparent``/``tracestate`` headers, if any."""
    return PROPAGATOR.extract(carrier=dict(headers))


def is_sampled(traceparent: str | None) -> bool:
    """The W3C trace-flags' sampled bit of an incoming ``traceparent``: the caller asks for a sampling decision
    (the gateway's sampler makes it; the flag itself decides nothing)."""
    return traceparent is not None and traceparent.endswith("-01")


class RequestTrace:
    """The spans of one gateway request: ``gateway.request`` with children for queue wait, upstream until the
    first token, and the stream. Contexts are passed explicitly, so nothing leaks across requests.

    Spans are made when the gateway traces (an exporter and a ratio above 0) or the caller's traceparent asks
    for sampling; the sampler then decides by trace id (ratio 0 without an exporter), and a span it drops is a
    cheap non-recording span that still carries the caller's trace id, with the gateway's unsampled decision, to
    the engine. Otherwise no span is created at all, which keeps the request path cheap, and the caller's trace
    context goes to the engine unchanged (it already says "not sampled")."""

    def __init__(self, tracer: trace.Tracer, route: str, headers: Mapping[str, str], *, recording: bool) -> None:
        self._tracer = tracer
        self._incoming = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}
        self.recording = recording or is_sampled(self._incoming.get("traceparent"))
        self.root: trace.Span = trace.INVALID_SPAN
        if not self.recording:
            self._open: list[trace.Span] = []
            return
        self.root = tracer.start_span(f"gateway {route}", context=extract_context(headers),
                                      kind=trace.SpanKind.SERVER, attributes={"appliance.route": route})
        self._ctx = trace.set_span_in_context(self.root)
        self._open = []

    def child(self, name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
              **attributes: AttributeValue) -> trace.Span:
        if not self.recording:
            return trace.INVALID_SPAN
        span = self._tracer.start_span(name, context=self._ctx, kind=kind, attributes=attributes)
        self._open.append(span)
        return span

    def elapsed(self, name: str, seconds: float) -> None:
        """A child span for something measured when it ended (a queue wait): it began ``seconds`` ago."""
        if self.recording:
            now = time.time_ns()
            self._tracer.start_span(name, context=self._ctx, start_time=now - int(seconds * 1e9)).end(now)

    def propagate(self, span: trace.Span, headers: dict[str, str]) -> dict[str, str]:
        """Headers for the engine carrying ``span`` as the parent of vLLM's own spans."""
        if not self.recording:
            headers.update(self._incoming)
            return headers
        PROPAGATOR.inject(carrier=headers, context=trace.set_span_in_context(span))
        return headers

    def finish(self, status_code: int) -> None:
        if not self.recording:
            return
        for span in self._open:
            # The SDK's tracer makes every recording span: a ReadableSpan, which knows whether it ended.
            if span.is_recording() and isinstance(span, ReadableSpan) and span.end_time is None:
                span.end()
        self.root.set_attribute("http.response.status_code", status_code)
        if status_code >= 500:
            self.root.set_status(trace.StatusCode.ERROR)
        self.root.end()


UNTRACED = RequestTrace(trace.NoOpTracer(), "", {}, recording=False)
"""The trace of a request nobody traces (no observation hook): spans are no-ops, nothing is propagated."""

"""``create_app()``: the gateway as a FastAPI application; all state lives on ``app.state``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from appliance.collectors import register_collectors
from appliance.engine.external import ExternalFleet
from appliance.engine.supervisor import Supervisor
from appliance.gateway.admission import Admission, AIMDLimit, ConcurrencyLimits
from appliance.gateway.engine_load import EngineLoadPoller
from appliance.gateway.errors import install_error_handlers
from appliance.gateway.limits import RequestIntake
from appliance.gateway.metrics import FleetCollector, RequestMetrics
from appliance.gateway.proxy import Upstream
from appliance.gateway.router import Routable, Router
from appliance.gateway.routes import admin, health, maintenance, metrics, openai
from appliance.gateway.tracing import build_tracer_provider
from appliance.maintenance.service import build_maintenance
from appliance.maintenance.traffic import counter_total
from appliance.settings import Settings


def create_app(
    settings: Settings,
    *,
    supervisor: Supervisor | ExternalFleet | None = None,
    replicas: Callable[[], Sequence[Routable]] | None = None,
    registry: CollectorRegistry | None = None,
    span_exporter: SpanExporter | None = None,
) -> FastAPI:
    """Build the gateway. With a supervisor it owns the engines' life; ``replicas`` alone serves a fixed set
    (tests with stub upstreams, or engines run by someone else)."""
    if replicas is None:
        if supervisor is None:
            raise ValueError("create_app needs a supervisor or a replicas provider")
        replicas = lambda: supervisor.replicas  # noqa: E731

    registry = registry if registry is not None else CollectorRegistry()
    limits = ConcurrencyLimits(_limit_factory(settings))
    router = Router(replicas, settings.routing, limit_for=limits.limit_of)
    admission = Admission(router, limits, max_queue=settings.admission.max_queue if settings.admission.enabled
                          else 0, queue_timeout_seconds=settings.admission.queue_timeout_seconds)
    request_metrics = RequestMetrics(registry, slo_ttft_seconds=settings.slo_ttft_p95_seconds)
    registry.register(FleetCollector(router, admission, replicas))
    register_collectors(registry, replicas=replicas, router_load=lambda: router.load, settings=settings.collectors,
                        model_dir=settings.model, state_dir=settings.state_dir)
    tracer_provider = build_tracer_provider(settings, span_exporter)
    upstream = Upstream(admission, request_metrics, tracer_provider.get_tracer("appliance.gateway"),
                        timeout_seconds=settings.request_timeout_seconds,
                        tracing=_records_traces(settings, span_exporter))
    poller = EngineLoadPoller(router, settings.routing.metrics_poll_seconds, on_poll=admission.dispatch)
    maintenance_service = build_maintenance(settings, registry=registry, replicas=replicas, router=router,
                                     admission=admission, requests_total=counter_total(request_metrics.requests))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await upstream.open()
        if supervisor is not None:
            await supervisor.start()
        poller.start()
        maintenance_service.start()
        try:
            yield
        finally:
            await maintenance_service.stop()
            await poller.stop()
            if supervisor is not None:
                await supervisor.stop()
            await upstream.close()
            tracer_provider.shutdown()

    app = FastAPI(title="appliance gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.supervisor = supervisor
    app.state.replicas = replicas
    app.state.router = router
    app.state.admission = admission
    app.state.upstream = upstream
    app.state.registry = registry
    app.state.metrics = request_metrics
    app.state.tracer_provider = tracer_provider
    app.state.maintenance = maintenance_service
    app.state.draining = False
    app.state.background = set()  # admin tasks in flight, kept referenced until done
    app.state.started_at = time.time()
    install_error_handlers(app, on_error=request_metrics.count_unproxied)
    app.add_middleware(RequestIntake, max_bytes=settings.max_request_bytes, on_reject=request_metrics.count_unproxied)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(admin.router)
    app.include_router(maintenance.router)
    return app


def _records_traces(settings: Settings, exporter: SpanExporter | None) -> bool:
    return bool(settings.otlp_traces_endpoint or exporter) and settings.trace_sample_ratio > 0


def _limit_factory(settings: Settings) -> Callable[[], AIMDLimit] | None:
    admission = settings.admission
    if not admission.enabled:
        return None
    ceiling = admission.max_limit or settings.engine.max_num_seqs
    initial = admission.initial_limit or ceiling
    target = settings.slo_ttft_p95_seconds * admission.target_ttft_fraction
    return lambda: AIMDLimit(initial, admission.min_limit, ceiling, target, admission.decrease_factor)

"""The data path assembled: router, admission, the upstream proxy, the engine-load poller, request metrics, the
event-loop lag probe and the tenants (their directory, quotas and accounting; ``update_tenants`` applies a reloaded
configuration at once).

It knows replicas only through ``appliance.engine.contract.Replica`` and knows nothing of maintenance; the
composition root (``appliance.app``) builds it and hands the pieces maintenance needs as plain callables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from appliance.engine.contract import Replica
from appliance.engine.load import EngineLoadPoller
from appliance.gateway.admission import Admission, AIMDLimit, ConcurrencyLimits
from appliance.gateway.event_loop import EventLoopLag
from appliance.gateway.fleet_metrics import FleetCollector
from appliance.gateway.metrics import CLIENT_ROUTES, COUNTED, RequestMetrics
from appliance.gateway.proxy import Upstream
from appliance.gateway.router import Router
from appliance.gateway.settings import GatewaySettings
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import TenantDirectory
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.settings import TenantSettings
from appliance.gateway.tracing import build_tracer_provider
from appliance.settings import Settings


@dataclass
class Gateway:
    router: Router
    admission: Admission
    upstream: Upstream
    poller: EngineLoadPoller
    metrics: RequestMetrics
    tracer_provider: TracerProvider
    tenants: TenantDirectory
    accounting: TenantAccounting
    quotas: Quotas
    event_loop: EventLoopLag

    def update_tenants(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str]) -> None:
        """A new tenant configuration, applied at once (``appliance reload``): keys, priorities, weights and quota
        rates; every bucket's level is kept."""
        self.tenants.update(tenants, flat_keys)
        configured = self.tenants.tenants()
        self.quotas.update(configured)
        self.accounting.configure(tenant.name for tenant in configured)

    def count_unproxied(self, path: str, scope: MutableMapping[str, Any], status: int) -> None:
        """An answer the proxy never saw (validation, auth, drain...): the fleet's count, and the tenant's when
        its key was already identified."""
        first = path in CLIENT_ROUTES and not scope.get(COUNTED)
        self.metrics.count_unproxied(path, scope, status)
        tenant = (scope.get("state") or {}).get("tenant")
        if first and tenant is not None:
            self.accounting.answered(tenant.name, status)


def build_gateway(settings: Settings, replicas: Callable[[], Sequence[Replica]], registry: CollectorRegistry,
                  span_exporter: SpanExporter | None = None) -> Gateway:
    limits = ConcurrencyLimits(_limit_factory(settings))
    router = Router(replicas, settings.routing, limit_for=limits.limit_of, registry=registry)
    admission = Admission(router, limits, max_queue=settings.admission.max_queue if settings.admission.enabled
                          else 0, queue_timeout_seconds=settings.admission.queue_timeout_seconds,
                          drift_seconds=settings.admission.slot_drift_seconds,
                          fair_share=settings.admission.fair_share,
                          share_window_seconds=settings.admission.share_window_seconds)
    slo = settings.gateway.slo_ttft_p95_seconds
    request_metrics = RequestMetrics(registry, slo_ttft_seconds=slo)
    tenants = TenantDirectory(settings.tenants, settings.gateway.api_keys)
    quotas = Quotas(tenants.tenants())
    accounting = TenantAccounting(registry, slo_ttft_seconds=slo, ratios=quotas.ratios)
    accounting.configure(tenant.name for tenant in tenants.tenants())
    tracer_provider = build_tracer_provider(settings.gateway, span_exporter)
    upstream = Upstream(admission, request_metrics, tracer_provider.get_tracer("appliance.gateway"),
                        timeout_seconds=settings.gateway.request_timeout_seconds,
                        idle_timeout_seconds=settings.gateway.upstream_idle_timeout_seconds,
                        connect_timeout_seconds=settings.gateway.upstream_connect_timeout_seconds,
                        tracing=_records_traces(settings.gateway, span_exporter), accounting=accounting, quotas=quotas,
                        migration_limit=settings.routing.migration_limit,
                        max_model_len=settings.engine.max_model_len)
    registry.register(FleetCollector(router, admission, lambda: [tenant.name for tenant in tenants.tenants()],
                                     upstream.open_requests))
    poller = EngineLoadPoller(router.poll_targets, router.observe_reading, settings.routing.metrics_poll_seconds,
                              on_poll=admission.on_poll)
    event_loop = EventLoopLag(registry, settings.gateway.event_loop_probe_seconds)
    return Gateway(router, admission, upstream, poller, request_metrics, tracer_provider, tenants, accounting, quotas,
                   event_loop)


def _records_traces(settings: GatewaySettings, exporter: SpanExporter | None) -> bool:
    return bool(settings.otlp_traces_endpoint or exporter) and settings.trace_sample_ratio > 0


def _limit_factory(settings: Settings) -> Callable[[], AIMDLimit] | None:
    admission = settings.admission
    if not admission.enabled:
        return None
    ceiling = admission.max_limit or settings.engine.max_num_seqs
    initial = admission.initial_limit or ceiling
    target = settings.gateway.slo_ttft_p95_seconds * admission.target_ttft_fraction
    return lambda: AIMDLimit(initial, admission.min_limit, ceiling, target, admission.decrease_factor)

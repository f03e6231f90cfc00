"""The gateway built from the settings: the one place that reads the gateway, routing, admission, tenants and
engine sections together, and the one place that declares the request path's hooks and their order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from appliance.composition.prefix_cache import PreciseRouting, build_precise_routing
from appliance.engine.contract import Replica
from appliance.engine.guard import engine_authorization
from appliance.engine.load import EngineLoad, EngineLoadPoller, Reading
from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.breaker.circuit import Breaker, BreakerCollector
from appliance.gateway.breaker.hook import ShapeBreaker
from appliance.gateway.core import Gateway
from appliance.gateway.decisions import AdmissionState, ChargeLedger, QuotaStore, RecordSink, RoutingState
from appliance.gateway.migration.hook import Migration
from appliance.gateway.observation.event_loop import EventLoopLag
from appliance.gateway.observation.fleet_metrics import FleetCollector
from appliance.gateway.observation.hook import Observation
from appliance.gateway.observation.metrics import RequestMetrics
from appliance.gateway.observation.recording import Recording
from appliance.gateway.observation.records import RequestRecords
from appliance.gateway.observation.tracing import build_tracer_provider
from appliance.gateway.routing.router import Router
from appliance.gateway.routing.scorers import PrefixScorer
from appliance.gateway.settings import GatewaySettings
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import TenantDirectory
from appliance.gateway.tenants.isolation import CacheIsolation
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.priority import EnginePriority, reported_policy
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.quota_store import SharedQuotas, connect
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.tenants.revocation import Revocation
from appliance.gateway.upstream.exchange import Hook
from appliance.gateway.upstream.transport import Upstream
from appliance.settings import Settings


def build_gateway(settings: Settings, replicas: Callable[[], Sequence[Replica]], registry: CollectorRegistry,
                  span_exporter: SpanExporter | None = None) -> Gateway:
    limits = ConcurrencyLimits(_limit_factory(settings))
    precise = build_precise_routing(settings, replicas)  # None: approximate prefix routing
    router = Router(replicas, settings.routing, limit_for=limits.limit_of, registry=registry,
                    affinity_scorer=precise.affinity_scorer if precise is not None else PrefixScorer)
    precise = _in_use(precise, router, registry)
    admission = Admission(router, limits, max_queue=settings.admission.max_queue if settings.admission.enabled
                          else 0, queue_timeout_seconds=settings.admission.queue_timeout_seconds,
                          drift_seconds=settings.admission.slot_drift_seconds,
                          fair_share=settings.admission.fair_share,
                          share_window_seconds=settings.admission.share_window_seconds,
                          over_share_prefills=settings.admission.over_share_prefills)
    slo = settings.gateway.slo_ttft_p95_seconds
    request_metrics = RequestMetrics(registry, slo_ttft_seconds=slo)
    tenants = TenantDirectory(settings.tenants, settings.gateway.api_keys)
    quotas = Quotas(tenants.tenants())
    shared = _quota_store(settings, registry)
    ratios = quotas.ratios if shared is None else lambda: shared.ratios(tenants.tenants())
    accounting = TenantAccounting(registry, slo_ttft_seconds=slo, ratios=ratios)
    accounting.configure(tenant.name for tenant in tenants.tenants())
    reconciliation = Reconciliation(accounting.estimated, hold_seconds=settings.gateway.unseen_hold_seconds,
                                    open_legs=router.in_flight, other_gateways=shared is not None)
    registry.register(reconciliation)
    tracer_provider = build_tracer_provider(settings.gateway, span_exporter)
    records = RequestRecords(settings.gateway.request_records)
    migration = Migration(request_metrics, limit=settings.routing.migration_limit,
                          max_model_len=settings.engine.max_model_len)
    revocation = Revocation()
    breaker = shape_breaker(settings, router, registry)
    router.server_errors_judged = breaker.breaker is not None
    upstream = request_path(settings, admission, RequestPath(
        request_metrics, tracer_provider, tenants, accounting, quotas, migration, records, breaker, revocation,
        policy_of=reported_policy(router.loads), reconciliation=reconciliation, shared=shared,
        precise_hook=precise.hook if precise is not None else None), span_exporter)  # the hooks, in their order
    registry.register(FleetCollector(router, admission, lambda: [tenant.name for tenant in tenants.tenants()],
                                     upstream.open_requests))
    poller = EngineLoadPoller(router.poll_targets, _readings(router, reconciliation),
                              settings.routing.metrics_poll_seconds,
                              on_poll=_after_poll(admission, router, reconciliation))
    event_loop = EventLoopLag(registry, settings.gateway.event_loop_probe_seconds)
    return Gateway(router, admission, upstream, poller, request_metrics, tracer_provider, tenants, accounting, quotas,
                   event_loop, records=records, reconciliation=reconciliation, revocation=revocation,
                   kv_events=precise.hub if precise is not None else None, quota_store=shared)


@dataclass
class RequestPath:
    """What the request path's hooks are built from: the parts a request reports to, and the decision state it
    asks (in one process the parts themselves; in a worker, the decider's over its socket)."""

    metrics: RequestMetrics
    tracer_provider: TracerProvider
    tenants: TenantDirectory
    accounting: TenantAccounting
    quotas: Quotas
    migration: Migration
    records: RecordSink
    breaker: ShapeBreaker
    revocation: Revocation
    policy_of: Callable[[str], str | None]  # replica -> the scheduling policy its engine reported
    reconciliation: ChargeLedger
    shared: QuotaStore | None = None
    precise_hook: Hook | None = None


def request_path(settings: Settings, admission: AdmissionState, parts: RequestPath,
                 span_exporter: SpanExporter | None = None) -> Upstream:
    """The transport with the request path's hooks, in their one order.

    Observation first, so it sees every other hook's doing and the client's bytes last; migration next to the
    record, nearest the engine, so the others see the continued stream as the client gets it; the record last on
    the request's side, so it sees every decision made before it. Revocation (streams only) is nearest the engine:
    when a reload removes a tenant, its break must be resolved before migration's. Cache isolation salts the
    tenant's prompt before routing reads it and before migration keeps the body it continues; engine priority
    writes each attempt's priority before it goes out (a continuation's too). The shape breaker is next nearest
    the engine: it judges an engine's error event, and a stream silent past the idle timeout, before migration
    would continue it elsewhere."""
    hooks: list[Hook] = [
        Observation(parts.metrics, parts.tracer_provider.get_tracer("appliance.gateway"),
                    tracing=_records_traces(settings.gateway, span_exporter)),
        CacheIsolation(parts.tenants, settings.gateway.engine_key),
        *([parts.precise_hook] if parts.precise_hook is not None else []),  # tokenizes once its salt is set
        EnginePriority(admission, parts.policy_of),
        Metering(parts.accounting, parts.quotas, admission, max_model_len=settings.engine.max_model_len,
                 reconciliation=parts.reconciliation, shared=parts.shared),
        parts.migration,
        Recording(parts.records),
        parts.breaker,
        parts.revocation]
    upstream = Upstream(admission, hooks,
                        timeout_seconds=settings.gateway.request_timeout_seconds,
                        idle_timeout_seconds=settings.gateway.upstream_idle_timeout_seconds,
                        connect_timeout_seconds=settings.gateway.upstream_connect_timeout_seconds,
                        engine_headers=engine_authorization(settings.gateway.engine_key))
    parts.migration.placement = upstream
    parts.breaker.probe = upstream
    return upstream


def _quota_store(settings: Settings, registry: CollectorRegistry) -> SharedQuotas | None:
    """The quota store shared with the other gateways (quota_store.kind redis), or None: this process's buckets.
    Nothing is connected here: the client's pool connects at the first request, so a gateway starts (and says
    so) while its store is down."""
    section = settings.quota_store
    return SharedQuotas(connect(section), section, registry) if section.kind == "redis" else None


def _readings(router: Router, reconciliation: Reconciliation) -> Reading:
    """Each engine reading goes to the router (routing, probes) and to the tenants' reconciliation (counters)."""
    def on_reading(name: str, load: EngineLoad | None) -> None:
        router.observe_reading(name, load)
        reconciliation.observe(name, load)
    return on_reading


def _after_poll(admission: Admission, router: Router, reconciliation: Reconciliation) -> Callable[[], None]:
    """After each poll: admission's audit and dispatch, and the reconciliation forgets replicas that left."""
    def on_poll() -> None:
        admission.on_poll()
        reconciliation.retain({replica.name for replica in router.replicas()})
    return on_poll


def _in_use(precise: PreciseRouting | None, router: Router, registry: CollectorRegistry) -> PreciseRouting | None:
    """Precise prefix routing as the router uses it (its metrics registered), or None where the policy has no
    prefix scorer (round robin, prefix weight 0): then nothing is subscribed or tokenized."""
    if precise is None:
        return None
    if precise.scorer is None or router.policy.prefix is not precise.scorer:
        if precise.hub.tokenizer is not None:
            precise.hub.tokenizer.close()
        return None
    precise.register(registry)
    return precise


def shape_breaker(settings: Settings, routing: RoutingState, registry: CollectorRegistry) -> ShapeBreaker:
    """The shape breaker (appliance.gateway.breaker) and its metrics. With it on, the router leaves the engines'
    error answers to its verdict (``Router.server_errors_judged``, set by the caller that owns the router)."""
    section = settings.breaker
    breaker = Breaker(section) if section.enabled else None
    hook = ShapeBreaker(breaker, routing, long_prefill=section.long_prefill_health,
                        health_timeout_seconds=settings.engine.health_timeout_seconds,
                        idle_timeout_seconds=settings.gateway.upstream_idle_timeout_seconds)
    if breaker is not None:
        registry.register(BreakerCollector(breaker, hook.counted))
    return hook


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

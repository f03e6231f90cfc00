"""A worker process built from the settings its decider sent (``appliance.gateway.workers``): the request path
(the same hooks, in the same order, as ``composition.gateway``) against the decider's state, the OpenAI routes,
and a pass-through of every other route to the decider.

The worker keeps what is per request and per event: the tenants' directory (to know whose a key is), the
accounting and request metrics it reports (summed by the decider into one /metrics), and a shape breaker of its
own (``breaker.*``: each worker judges the shapes it sees). What must be one for the whole gateway (slots, the
queue, fair share, routing, quotas, the reconciliation, the request records) is the decider's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from appliance.collectors.host import GatewayCpu
from appliance.composition.batch import upload_limits
from appliance.composition.gateway import RequestPath, request_path, shape_breaker
from appliance.composition.hot_reload import hot_reload
from appliance.context import LiveState, WorkerContext
from appliance.gateway.intake.limits import BodyBudget, RequestIntake
from appliance.gateway.migration.hook import Migration
from appliance.gateway.observation.event_loop import EventLoopLag
from appliance.gateway.observation.metrics import CLIENT_ROUTES, COUNTED, RequestMetrics
from appliance.gateway.observation.tracing import build_tracer_provider
from appliance.gateway.routes import openai
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.hook import PromptTokensHook
from appliance.gateway.routing.kv_events.metrics import TokenizerCollector
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import TenantDirectory
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.quota_store import SharedQuotas, connect
from appliance.gateway.tenants.revocation import Revocation
from appliance.gateway.tenants.settings import TenantSettings
from appliance.gateway.upstream.transport import Upstream
from appliance.gateway.workers import metrics as worker_metrics
from appliance.gateway.workers.messages import Metrics
from appliance.gateway.workers.passthrough import PassThrough
from appliance.gateway.workers.remote import (
    DeciderClient,
    RemoteAdmission,
    RemoteLedger,
    RemoteQuotas,
    RemoteRecords,
)
from appliance.http.credentials import Keyring
from appliance.http.errors import install_error_handlers
from appliance.settings import Settings

log = logging.getLogger(__name__)

OPEN_REPORT_SECONDS = 0.1  # how often a changed count of open requests is told to the decider (the drain's wait)


@dataclass
class WorkerGateway:
    """A worker's request path and what it reports to."""

    upstream: Upstream
    tenants: TenantDirectory
    accounting: TenantAccounting
    metrics: RequestMetrics
    revocation: Revocation
    event_loop: EventLoopLag
    tracer_provider: TracerProvider
    quota_store: SharedQuotas | None = None
    tokenizer: PromptTokenizer | None = None  # precise prefix routing's, closed with the worker

    def update_tenants(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str], *,
                       overlap_seconds: float = 0.0) -> list[str]:
        """A reloaded tenant configuration: this worker's directory and accounting, and the streams of removed
        tenants ended (their queued requests are the decider's to refuse)."""
        before = {tenant.name for tenant in self.tenants.tenants()}
        self.tenants.update(tenants, flat_keys, overlap_seconds=overlap_seconds)
        configured = self.tenants.tenants()
        self.accounting.configure(tenant.name for tenant in configured)
        removed = sorted(before - {tenant.name for tenant in configured})
        if removed:
            self.revocation.revoke(removed)
        return removed

    def count_unproxied(self, path: str, scope: MutableMapping[str, Any], status: int) -> None:
        first = path in CLIENT_ROUTES and not scope.get(COUNTED)
        self.metrics.count_unproxied(path, scope, status)
        tenant = (scope.get("state") or {}).get("tenant")
        if first and tenant is not None:
            self.accounting.answered(tenant.name, status)


def build_worker_gateway(settings: Settings, client: DeciderClient, registry: CollectorRegistry) -> WorkerGateway:
    slo = settings.gateway.slo_ttft_p95_seconds
    metrics = RequestMetrics(registry, slo_ttft_seconds=slo)
    tenants = TenantDirectory(settings.tenants, settings.gateway.api_keys)
    accounting = TenantAccounting(registry, slo_ttft_seconds=slo, ratios=lambda: [])  # the decider's buckets
    accounting.configure(tenant.name for tenant in tenants.tenants())
    admission = RemoteAdmission(client.link, client.routing, settings.admission.queue_timeout_seconds)
    shared = (SharedQuotas(connect(settings.quota_store), settings.quota_store, registry)
              if settings.quota_store.kind == "redis" else None)
    store = shared or RemoteQuotas(client.link, settings.quota_store.retry_after_seconds, registry)
    revocation = Revocation()
    migration = Migration(metrics, limit=settings.routing.migration_limit,
                          max_model_len=settings.engine.max_model_len)
    tracer_provider = build_tracer_provider(settings.gateway, None)
    tokens = prompt_tokens(settings, client, registry)
    upstream = request_path(settings, admission, RequestPath(
        metrics, tracer_provider, tenants, accounting, Quotas(()), migration,
        RemoteRecords(client.link, settings.gateway.request_records > 0),
        shape_breaker(settings, client.routing, registry), revocation, policy_of=client.routing.policy_of,
        reconciliation=RemoteLedger(client.link), shared=store, precise_hook=tokens))
    event_loop = EventLoopLag(registry, settings.gateway.event_loop_probe_seconds)
    registry.register(GatewayCpu(settings.collectors.rate_min_window_seconds))
    return WorkerGateway(upstream, tenants, accounting, metrics, revocation, event_loop, tracer_provider,
                         quota_store=shared, tokenizer=tokens.tokenizer if tokens is not None else None)


def prompt_tokens(settings: Settings, client: DeciderClient, registry: CollectorRegistry) -> PromptTokensHook | None:
    """With precise prefix routing: this worker tokenizes its requests' prompts (in its own threads) while the
    decider's event indexes are current, and the token ids go with each ``Acquire``; None otherwise, or when the
    tokenizer cannot be loaded (the decider then routes on the approximate scorer, and said so at its start)."""
    section = settings.routing.prefix_cache
    path = section.tokenizer or settings.model
    if section.mode == "approximate" or path is None:
        return None
    try:
        tokenizer = PromptTokenizer(Path(path), section.tokenizer_threads)
    except FileNotFoundError as exc:
        log.warning("precise prefix routing needs the model's tokenizer (%s): this worker sends no tokens", exc)
        return None
    hook = PromptTokensHook(tokenizer, client.routing, BlockHasher(section.hash_seed),
                            section.max_pending_tokenizations)
    registry.register(TokenizerCollector(hook))
    return hook


def create_worker_app(settings: Settings, client: DeciderClient, decider_http: Path) -> FastAPI:
    """The worker's app: the OpenAI routes on the request path above; every other route passed to the decider's
    own server at ``decider_http`` (a Unix socket)."""
    registry = CollectorRegistry()
    gateway = build_worker_gateway(settings, client, registry)
    passthrough = PassThrough(decider_http)
    keyring = Keyring(settings.credentials)
    live = LiveState(settings, keyring=keyring)
    client.on_reload = hot_reload(gateway, keyring, live)

    def drain() -> None:
        live.draining = True  # new requests get 503 from here on; what is open is told at once
        client.report_open(gateway.upstream.open_requests())

    client.on_drain = drain
    cutting: set[asyncio.Task[None]] = set()

    def cut() -> None:
        task = asyncio.get_running_loop().create_task(_cut(gateway.upstream))
        cutting.add(task)
        task.add_done_callback(cutting.discard)

    client.on_cut = cut

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.upstream.open()
        await passthrough.open()
        gateway.event_loop.start()
        if gateway.quota_store is not None:
            gateway.quota_store.start()
        reports = asyncio.get_running_loop().create_task(_report(client, gateway.upstream, registry))
        gc.freeze()  # as the decider does (appliance.app): full collections skip what lives as long as the worker
        try:
            yield
        finally:
            gc.unfreeze()
            reports.cancel()
            await gateway.event_loop.stop()
            await gateway.upstream.close()
            await passthrough.close()
            if gateway.quota_store is not None:
                await gateway.quota_store.close(settings.quota_store.drain_seconds)
            if gateway.tokenizer is not None:
                gateway.tokenizer.close()
            gateway.tracer_provider.shutdown()

    app = FastAPI(title="appliance gateway worker", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.context = WorkerContext(live=live, gateway=gateway, started_at=time.time())
    install_error_handlers(app, on_error=gateway.count_unproxied)
    app.add_middleware(RequestIntake, credentials=keyring.current, max_bytes=settings.gateway.max_request_bytes,
                       body_timeout=settings.intake.body_timeout_seconds,
                       budget=BodyBudget(settings.intake.body_budget_bytes), on_reject=gateway.metrics.count_unproxied,
                       limits=upload_limits(settings))
    app.include_router(openai.router)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def decider_route(request: Request) -> Response:
        return await passthrough.forward(request)

    return app


async def _cut(upstream: Upstream) -> None:
    cut = await upstream.cut_streams()
    if cut:
        log.warning("drain timeout: cut %d stream(s) with a shutting_down error event", cut)


async def _report(client: DeciderClient, upstream: Upstream, registry: CollectorRegistry) -> None:
    """Tell the decider this worker's open requests when they change, and its metrics every PUSH_SECONDS."""
    told, pushed = -1, 0.0
    while True:
        count = upstream.open_requests()
        if count != told:
            client.report_open(count)
            told = count
        now = time.monotonic()
        if now - pushed >= worker_metrics.PUSH_SECONDS:
            client.link.send(Metrics(worker_metrics.snapshot(registry)))
            pushed = now
        await asyncio.sleep(OPEN_REPORT_SECONDS)

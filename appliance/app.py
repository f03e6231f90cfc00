"""The composition root: ``create_app()`` builds every part of a running appliance and wires them together.

    fleet (engine replicas) -> gateway (router, admission, proxy, engine-load poller)
                            -> batch (OpenAI's Batch API: its lines through the gateway, on idle capacity)
                            -> collectors (read the replicas and the gateway's engine readings)
                            -> maintenance (reads the data path through DataPathView; acts on replicas)
    FastAPI app: the gateway's routes, maintenance's routes, /admin/status; errors mapped to HTTP here

Only this module knows all the parts; each part knows replicas only through ``appliance.engine.contract``. The
parts are kept in one frozen ``AppContext`` (appliance/context.py), stored once as ``app.state.context`` and read
through ``app_context``/``context_of``; nothing lives in module globals, so tests build as many apps as they like.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from appliance import status, version
from appliance.collectors import register_collectors
from appliance.composition.batch import build_batch, upload_limits
from appliance.composition.gateway import build_gateway
from appliance.composition.hot_reload import hot_reload
from appliance.composition.maintenance import build_maintenance
from appliance.context import AppContext, LiveState
from appliance.engine.contract import Fleet, Reconfigurable, Replica
from appliance.gateway import routes as gateway_routes
from appliance.gateway.core import Gateway
from appliance.gateway.intake.limits import BodyBudget, RequestIntake
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.http.auth import api_docs_urls
from appliance.http.credentials import Keyring
from appliance.http.errors import APIError, install_error_handlers
from appliance.maintenance import routes as maintenance_routes
from appliance.maintenance.errors import MaintenanceError, ReplicaNotFound
from appliance.maintenance.reload import InvalidConfig
from appliance.maintenance.service import DataPathView
from appliance.maintenance.traffic import counter_total
from appliance.settings import Settings


def create_app(
    settings: Settings,
    *,
    fleet: Fleet | None = None,
    replicas: Callable[[], Sequence[Replica]] | None = None,
    registry: CollectorRegistry | None = None,
    span_exporter: SpanExporter | None = None,
) -> FastAPI:
    """Build the appliance. With a ``fleet`` it owns the engines' life (starts them with the app, stops them
    after the drain); ``replicas`` alone serves a fixed set (tests, or engines run by someone else)."""
    if replicas is None:
        if fleet is None:
            raise ValueError("create_app needs a fleet or a replicas provider")
        replicas = lambda: fleet.replicas  # noqa: E731

    registry = registry if registry is not None else CollectorRegistry()
    gateway = build_gateway(settings, replicas, registry, span_exporter)
    register_collectors(registry, replicas=replicas, router_load=gateway.router.loads, settings=settings.collectors,
                        model_dir=settings.model, state_dir=settings.state_dir)
    router = gateway.router
    maintenance = build_maintenance(settings, registry=registry, replicas=replicas, data_path=DataPathView(
        in_flight=router.in_flight, loads=router.loads, queue_length=lambda: gateway.admission.queue_length,
        requests_total=requests_total(gateway, registry), relayed_at=router.relayed_at,
        is_ejected=router.ejector.is_ejected),
        stage=fleet.stage if isinstance(fleet, Reconfigurable) else None,
        unstage=fleet.unstage if isinstance(fleet, Reconfigurable) else None)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.upstream.open()
        if fleet is not None:
            await fleet.start()
        gateway.poller.start()
        if gateway.kv_events is not None:
            gateway.kv_events.start()
        gateway.event_loop.start()
        if gateway.quota_store is not None:
            gateway.quota_store.start()
        maintenance.start()
        if batch is not None:
            batch.start()
        # What is alive now (modules, the app, the settings: ~100k objects) lives as long as the app: frozen, the
        # collector's full passes skip it. Each full pass over it held the event loop ~30 ms, now and then, in the
        # middle of relaying streams and answering first tokens. Thawed at shutdown.
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            if batch is not None:  # first: no batch line is in flight when the engines stop
                await batch.stop()
            await maintenance.stop()
            await gateway.event_loop.stop()
            await gateway.poller.stop()
            if gateway.kv_events is not None:
                await gateway.kv_events.stop()
            if fleet is not None:
                await fleet.stop()
            await gateway.upstream.close()
            if gateway.quota_store is not None:  # after the last request: its settle is in flight
                await gateway.quota_store.close(settings.quota_store.drain_seconds)
            gateway.tracer_provider.shutdown()

    app = FastAPI(title="appliance gateway", version=version(), lifespan=lifespan,
                  **api_docs_urls(settings.all_api_keys))
    keyring = Keyring(settings.credentials)
    live = LiveState(settings, keyring=keyring)
    batch = build_batch(settings, gateway, registry, draining=lambda: live.draining)

    maintenance.reloader.hot = hot_reload(gateway, keyring, live)
    body_budget = BodyBudget(settings.intake.body_budget_bytes)
    app.state.context = AppContext(
        live=live, gateway=gateway, fleet=fleet, replicas=replicas, registry=registry, maintenance=maintenance,
        fleet_status=status.FleetStatus(settings, gateway, maintenance), body_budget=body_budget,
        started_at=time.time(), batch=batch.service if batch is not None else None)
    install_error_handlers(app, on_error=gateway.count_unproxied,
                           translate={MaintenanceError: maintenance_api_error})
    app.add_middleware(RequestIntake, credentials=keyring.current,
                       max_bytes=settings.gateway.max_request_bytes,
                       body_timeout=settings.intake.body_timeout_seconds, budget=body_budget,
                       on_reject=gateway.metrics.count_unproxied, limits=upload_limits(settings))
    for route in (*data_routes(settings.role), maintenance_routes.router, maintenance_routes.lease_router,
                  status.router):
        app.include_router(route)
    return app


def requests_total(gateway: Gateway, registry: CollectorRegistry) -> Callable[[], float]:
    """Every request the gateway answered, for maintenance's low-traffic windows: with workers
    (``gateway.workers``), theirs too, or the decider alone would read an idle gateway under full load."""
    own = counter_total(gateway.metrics.requests)
    if not isinstance(registry, MergedRegistry):
        return own
    return lambda: own() + registry.others_total("appliance_requests_total")


def data_routes(role: str) -> tuple[APIRouter, ...]:
    """The gateway's routes; a node pod's own gateway serves no /v1: clients reach its engines through the gateway
    pods, past their keys and quotas, and a node holds no API key to check them with (docs/security.md)."""
    if role == "node":
        return tuple(route for route in gateway_routes.ROUTERS if route not in gateway_routes.CLIENT_ROUTERS)
    return gateway_routes.ROUTERS


def maintenance_api_error(exc: Exception) -> APIError:
    """Maintenance refusals as HTTP: the one place their status codes are decided (404 no such replica, 400 a
    reloaded configuration that does not validate, 409 busy, not ours to restart, below min_ready, cannot roll)."""
    assert isinstance(exc, MaintenanceError)
    if isinstance(exc, ReplicaNotFound):
        return APIError(404, exc.message, param="name", code=exc.code)
    if isinstance(exc, InvalidConfig):
        return APIError(400, exc.message, code=exc.code)
    return APIError(409, exc.message, code=exc.code)

"""The running appliance's parts, as one typed object: what ``create_app()`` builds, and what routes, auth, the
intake and ``appliance serve`` read.

``create_app()`` (appliance/app.py) stores one ``AppContext`` as ``app.state.context``, once; everything else reaches
it through ``app_context`` (a route's FastAPI dependency: ``ctx: Context``) or ``context_of`` (code that holds the
app). A misspelt part is then a type error, not an ``AttributeError`` at request time.

The context is frozen: its parts are built once and never replaced. What does change while the app runs is named
apart, in ``LiveState``: the settings (``appliance reload`` replaces the hot keys) and the drain flag (set by
``appliance serve`` on SIGTERM). There are no aliases: the router is ``ctx.gateway.router``, nothing else.

The context sits at the bottom of the layers, below the parts it holds, so it names them by what their readers
use: the Protocols below (``GatewayParts``, ``MaintenanceParts``, ``LiveSettings``, ``StatusView`` ...), never their
classes. It imports nothing of the appliance, not even for the type checker, so every package, the gateway's
lowest modules included, may use it, and no import points up from it. The parts satisfy the Protocols by their
shape; mypy checks that where ``create_app`` builds the context. Code that reads a new part through the context
adds what it reads to the Protocol here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol, Self

from fastapi import Depends, Request
from fastapi.responses import Response
from starlette.applications import Starlette

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


# -- the replicas ---------------------------------------------------------------------------------------------------


class ReplicaView(Protocol):
    """A replica as it is read through the context (``appliance.engine.contract.Replica`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def routable(self) -> bool: ...


class FleetLife(Protocol):
    """Replicas whose life the app owns (``appliance.engine.contract.Fleet``): started with it, stopped after it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# -- the live settings ----------------------------------------------------------------------------------------------


class EngineFacts(Protocol):
    """What the routes read of the engine section (``appliance.engine.settings.EngineSettings``)."""

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def advertise_host(self) -> str | None: ...


class MonitoringFacts(Protocol):
    """What the routes read of the monitoring section (``appliance.monitoring.settings.MonitoringSettings``)."""

    @property
    def assets_dir(self) -> Path | None: ...


class LiveSettings(Protocol):
    """What is read of the running settings through the context (``appliance.settings.Settings`` is them)."""

    @property
    def served_model_name(self) -> str | None: ...

    @property
    def role(self) -> str: ...

    @property
    def engine(self) -> EngineFacts: ...

    @property
    def monitoring(self) -> MonitoringFacts: ...

    @property
    def credentials(self) -> Any:
        """The ``appliance.http.credentials.Credentials`` the auth checks take. Not named: appliance.http reads this
        context, so naming its type here would make a circle."""
        ...

    def replaced(self, values: Mapping[str, Any]) -> Self:
        """A copy with each key (top-level or ``section.key``) set to its value: how a hot reload makes the next
        live settings."""
        ...


# -- the data path --------------------------------------------------------------------------------------------------


class HealthView(Protocol):
    """The router's bookkeeping of one replica's health (``appliance.gateway.ejection.ReplicaHealth``)."""

    @property
    def ejected(self) -> bool: ...


class LoadView(Protocol):
    """An engine's own load reading (``appliance.engine.load.EngineLoad``)."""

    @property
    def read_at(self) -> float: ...

    @property
    def running(self) -> float | None: ...

    @property
    def waiting(self) -> float | None: ...


class RoutingFacts(Protocol):
    """What is read of the routing section the router runs on."""

    @property
    def metrics_stale_seconds(self) -> float: ...


class RouterView(Protocol):
    """The router (``appliance.gateway.router.Router``) as the health routes and the drain read it."""

    @property
    def routing(self) -> RoutingFacts: ...

    def eligible(self) -> Sequence[ReplicaView]:
        """The replicas a request could be sent to now."""
        ...

    def health_of(self, name: str) -> HealthView: ...

    def panic(self) -> bool: ...

    def in_flight(self, name: str | None = None) -> int:
        """Requests holding a slot at ``name``, or at every replica."""
        ...

    def loads(self) -> Mapping[str, LoadView]: ...


class SlotAuditView(Protocol):
    """Admission's check of its slots against what the engines report (``appliance.gateway.slots.SlotAudit``)."""

    def wedged(self) -> bool: ...

    def drifted(self, name: str) -> bool: ...


class AdmissionView(Protocol):
    """Admission control (``appliance.gateway.admission.Admission``): its queue and its slot audit."""

    @property
    def audit(self) -> SlotAuditView: ...

    @property
    def queue_length(self) -> int: ...


class UpstreamView(Protocol):
    """The forwarding side of the gateway: the OpenAI routes' one call, and what the drain waits for and cuts."""

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool, arrived: float,
                      prompt: str | None = None) -> Response: ...

    def open_requests(self) -> int: ...

    async def cut_streams(self) -> int: ...


class TenantLookup(Protocol):
    """The tenant directory: whose a bearer key is (the tenant, kept on the request; None: not a key)."""

    def identify(self, key: str | None) -> object | None: ...


class RecordsView(Protocol):
    """The last requests' records (``appliance.gateway.records.RequestRecords``), JSON-ready."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def recent(self, limit: int = 50, tenant: str | None = None, replica: str | None = None,
               min_seconds: float | None = None, status: str | None = None) -> list[dict[str, Any]]: ...

    def get(self, id: str) -> dict[str, Any] | None: ...


class GatewayParts(Protocol):
    """The data path (``appliance.gateway.core.Gateway``) as it is read through the context."""

    @property
    def router(self) -> RouterView: ...

    @property
    def admission(self) -> AdmissionView: ...

    @property
    def upstream(self) -> UpstreamView: ...

    @property
    def tenants(self) -> TenantLookup: ...

    @property
    def records(self) -> RecordsView: ...

    def quota_store_state(self) -> dict[str, Any]: ...


# -- maintenance ----------------------------------------------------------------------------------------------------


class ControllerView(Protocol):
    """The one way in for maintenance actions (``appliance.maintenance.controller.MaintenanceController``)."""

    def drain(self, name: str, trigger: str) -> ReplicaView: ...

    def undrain(self, name: str, trigger: str) -> ReplicaView: ...

    def start_restart(self, name: str, trigger: str, reason: str = "") -> object:
        """Start one replica's restart in the background (the task is not awaited by the routes)."""
        ...

    def start_rolling_restart(self, trigger: str, reason: str = "") -> object: ...

    def replicas(self) -> Sequence[ReplicaView]: ...


class ReloadOutcome(Protocol):
    """What ``appliance reload`` answers (``appliance.maintenance.reload.ReloadResult``)."""

    @property
    def rolling_restart(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


class ReloaderView(Protocol):
    def reload(self) -> ReloadOutcome: ...


class HandledAlerts(Protocol):
    """What the webhook did with one payload (``appliance.maintenance.webhook.Handled``)."""

    @property
    def ignored(self) -> int: ...

    @property
    def decisions(self) -> Sequence[object]: ...


class AlertHandler(Protocol):
    def handle(self, payload: Any) -> HandledAlerts:
        """``payload``: an ``appliance.maintenance.webhook.AlertmanagerPayload``, which maintenance's own route
        parses; the context only carries it."""
        ...


class ProgressView(Protocol):
    def is_hung(self, name: str) -> bool: ...


class MaintenanceParts(Protocol):
    """Maintenance (``appliance.maintenance.service.Maintenance``) as it is read through the context."""

    @property
    def controller(self) -> ControllerView: ...

    @property
    def reloader(self) -> ReloaderView: ...

    @property
    def alerts(self) -> AlertHandler: ...

    @property
    def progress(self) -> ProgressView: ...

    @property
    def leases(self) -> object | None:
        """Role gateway: maintenance's own ``LeaseBoard``, which its routes use as that class; None elsewhere."""
        ...


# -- the Batch API -------------------------------------------------------------------------------------------------


class BatchAPI(Protocol):
    """OpenAI's Files and Batches APIs (``appliance.batch.service.BatchService``): what the routes in
    ``appliance/gateway/routes/batches.py`` call. Per tenant (a tenant's name); ``tenant`` None on the batch calls is
    every tenant's, and ``operator`` names each batch's tenant (the admin routes). Answers are JSON-ready OpenAI
    objects; refusals are ``APIError``s."""

    async def upload(self, tenant: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]: ...

    async def files(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = 100,
                    order: str = "desc") -> dict[str, Any]: ...

    async def file(self, tenant: str, file_id: str) -> dict[str, Any]: ...

    async def content(self, tenant: str, file_id: str) -> bytes: ...

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]: ...

    async def create(self, tenant: str, *, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None) -> dict[str, Any]: ...

    async def batch(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]: ...

    async def batches(self, tenant: str | None, *, after: str | None = None, limit: int = 20,
                      status: str | None = None, operator: bool = False) -> dict[str, Any]: ...

    async def cancel(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]: ...


# -- above the gateway and maintenance ------------------------------------------------------------------------------


class StatusView(Protocol):
    """The operator's view of the fleet (``appliance.status.FleetStatus``, which sits above the gateway and
    maintenance and so cannot be imported here): what the admin routes answer with."""

    def fleet(self, draining: bool) -> dict[str, Any]:
        """/admin/status: the whole fleet."""
        ...

    def replica(self, replica: Any) -> dict[str, Any]:
        """One replica's row, as the drain, undrain and restart routes answer: ``replica`` is the
        ``appliance.engine.contract.Replica`` the maintenance controller answered with, passed on as it is."""
        ...


class BodyBudgetView(Protocol):
    """The global budget of request-body bytes being received (``appliance.gateway.limits.BodyBudget``)."""

    @property
    def in_flight(self) -> int: ...


class KeyringView(Protocol):
    """The live credentials with the secrets a reload replaced, inside their overlap window
    (``appliance.http.credentials.Keyring``)."""

    def current(self) -> Any:
        """The ``appliance.http.credentials.Credentials`` to check a request against now."""
        ...


@dataclass(eq=False)
class LiveState:
    """The values that change while the app runs, so that whoever reads them knows they may have."""

    settings: LiveSettings  # replaced whole by a hot reload (the keys in appliance.maintenance.reload.HOT_KEYS)
    draining: bool = False  # set once, by appliance serve's first SIGTERM/SIGINT: not ready, new requests get 503
    keyring: KeyringView | None = None  # rotated by a hot reload; None: the settings' own credentials
    # Told each hot reload's settings once applied here (the gateway's workers apply them too).
    reloaded: list[Callable[[LiveSettings], None]] = field(default_factory=list)

    def replace(self, settings: LiveSettings) -> None:
        """A hot reload's settings, now the live ones; whoever listens is told."""
        self.settings = settings
        for listener in self.reloaded:
            listener(settings)

    @property
    def credentials(self) -> Any:
        """What the auth checks take: the keyring's (replaced secrets still in their window), else the settings'."""
        return self.keyring.current() if self.keyring is not None else self.settings.credentials


@dataclass(frozen=True, eq=False)
class AppContext:
    """Every part of one running appliance. ``fleet`` is None when ``create_app`` was given replicas only (it then
    owns no engines' life); ``replicas`` is always the current set the gateway routes to."""

    live: LiveState
    gateway: GatewayParts
    fleet: FleetLife | None
    replicas: Callable[[], Sequence[ReplicaView]]
    registry: CollectorRegistry
    maintenance: MaintenanceParts
    fleet_status: StatusView
    body_budget: BodyBudgetView
    started_at: float  # time.time() when the app was built: /v1/models' ``created``
    batch: BatchAPI | None = None  # /v1/files and /v1/batches; None: off (batch.enabled) or a node pod


class ClientPathParts(Protocol):
    """What the OpenAI routes and their key check use of the gateway: the forwarding side and the tenants."""

    @property
    def upstream(self) -> UpstreamView: ...

    @property
    def tenants(self) -> TenantLookup: ...


@dataclass(frozen=True, eq=False)
class WorkerContext:
    """A worker process's part of the appliance (``appliance.gateway.workers``): the clients' requests only; every
    other route is the decider's."""

    live: LiveState
    gateway: ClientPathParts
    started_at: float


ClientContext = AppContext | WorkerContext
"""Whoever serves the OpenAI routes: the whole appliance, or one of its workers."""


def context_of(app: Starlette) -> AppContext:
    """The context ``create_app`` stored on ``app``: for code that holds the app (serve, the intake, tests)."""
    context = getattr(app.state, "context", None)
    if not isinstance(context, AppContext):
        raise RuntimeError("this app has no AppContext: build it with appliance.app.create_app()")
    return context


def app_context(request: Request) -> AppContext:
    """The context of the app serving ``request``: the routes' dependency (``Context``)."""
    return context_of(request.app)


async def _app_context(request: Request) -> AppContext:
    """``app_context`` as the routes' dependency. A coroutine on purpose: FastAPI runs a plain function dependency
    in its thread pool, a thread hop per request that, with the event loop busy relaying streams, waited on the GIL
    and cost the first token more than anything else on the gateway's path."""
    return app_context(request)


Context = Annotated[AppContext, Depends(_app_context)]
"""A route's parameter ``ctx: Context`` is the running appliance's context."""


def client_context(request: Request) -> ClientContext:
    """The context of the app serving a client's request: the appliance's, or a worker's."""
    context = getattr(request.app.state, "context", None)
    if not isinstance(context, AppContext | WorkerContext):
        raise RuntimeError("this app has no context: build it with appliance.app.create_app() or a worker's")
    return context


async def _client_context(request: Request) -> ClientContext:
    return client_context(request)  # a coroutine, as ``_app_context``: no thread hop per request


ClientCtx = Annotated[ClientContext, Depends(_client_context)]
"""The OpenAI routes' parameter: the context of whoever serves them (``ClientContext``)."""

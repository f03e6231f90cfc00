"""The running appliance's parts, as one typed object: what ``create_app()`` builds, and what routes, auth, the
intake and ``appliance serve`` read.

``create_app()`` (appliance/app.py) stores one ``AppContext`` as ``app.state.context``, once; everything else reaches
it through ``app_context`` (a route's FastAPI dependency: ``ctx: Context``) or ``context_of`` (code that holds the
app). A misspelt part is then a type error, not an ``AttributeError`` at request time.

The context is frozen: its parts are built once and never replaced. What does change while the app runs is named
apart, in ``LiveState``: the settings (``appliance reload`` replaces the hot keys) and the drain flag (set by
``appliance serve`` on SIGTERM). There are no aliases: the router is ``ctx.gateway.router``, nothing else.

The context sits at the bottom of the layers, below the parts it holds, so it names them by what their readers
use: the Protocols of ``appliance.context_parts`` (``GatewayParts``, ``MaintenanceParts``, ``LiveSettings``,
``StatusView`` ...), never their classes. It imports nothing else of the appliance, not even for the type checker,
so every package, the gateway's lowest modules included, may use it, and no import points up from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request
from starlette.applications import Starlette

from appliance.context_parts import (
    BatchAPI,
    BodyBudgetView,
    ClientPathParts,
    FleetLife,
    GatewayParts,
    KeyringView,
    LiveSettings,
    MaintenanceParts,
    ReplicaView,
    StatusView,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


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

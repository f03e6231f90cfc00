"""The running appliance's parts, as one typed object: what ``create_app()`` builds, and what routes, auth, the
intake and ``appliance serve`` read.

``create_app()`` (appliance/app.py) stores one ``AppContext`` as ``app.state.context``, once; everything else reaches
it through ``app_context`` (a route's FastAPI dependency: ``ctx: Context``) or ``context_of`` (code that holds the
app). A misspelt part is then a type error, not an ``AttributeError`` at request time.

The context is frozen: its parts are built once and never replaced. What does change while the app runs is named
apart, in ``LiveState``: the settings (``appliance reload`` replaces the hot keys) and the drain flag (set by
``appliance serve`` on SIGTERM). There are no aliases: the router is ``ctx.gateway.router``, nothing else.

At run time this module imports nothing of the appliance (its types are for the type checker only), so every
package, the gateway's lowest modules included, may use it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import Depends, Request
from starlette.applications import Starlette

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from appliance.engine.contract import Fleet, Replica
    from appliance.gateway.core import Gateway
    from appliance.gateway.limits import BodyBudget
    from appliance.maintenance.service import Maintenance
    from appliance.settings import Settings


class StatusView(Protocol):
    """The operator's view of the fleet (``appliance.status.FleetStatus``, which sits above the gateway and
    maintenance and so cannot be imported here): what the admin routes answer with."""

    def fleet(self, draining: bool) -> dict[str, Any]:
        """/admin/status: the whole fleet."""
        ...

    def replica(self, replica: Replica) -> dict[str, Any]:
        """One replica's row, as the drain, undrain and restart routes answer."""
        ...


@dataclass(eq=False)
class LiveState:
    """The two values that change while the app runs, so that whoever reads them knows they may have."""

    settings: Settings  # replaced whole by a hot reload (the keys in appliance.maintenance.reload.HOT_KEYS)
    draining: bool = False  # set once, by appliance serve's first SIGTERM/SIGINT: not ready, new requests get 503


@dataclass(frozen=True, eq=False)
class AppContext:
    """Every part of one running appliance. ``fleet`` is None when ``create_app`` was given replicas only (it then
    owns no engines' life); ``replicas`` is always the current set the gateway routes to."""

    live: LiveState
    gateway: Gateway
    fleet: Fleet | None
    replicas: Callable[[], Sequence[Replica]]
    registry: CollectorRegistry
    maintenance: Maintenance
    fleet_status: StatusView
    body_budget: BodyBudget
    started_at: float  # time.time() when the app was built: /v1/models' ``created``


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
    and cost the first token more than anything else on the gateway's path (issue 25)."""
    return app_context(request)


Context = Annotated[AppContext, Depends(_app_context)]
"""A route's parameter ``ctx: Context`` is the running appliance's context."""

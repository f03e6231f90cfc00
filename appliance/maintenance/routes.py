"""Maintenance's HTTP surface: drain, undrain and restart one replica, the rolling restart, the Alertmanager
webhook, and (role gateway) the restart lease node pods ask for before each restart. Admin token required, like
every /admin route; the webhook also takes the alerts token, which opens nothing else (Alertmanager sends it with
``http_config.authorization``; appliance/http/auth.py, guards.py), and the lease is also served at
``/maintenance/lease`` for the lease token, which opens nothing else either (a node pod's one credential). Actions
go through the maintenance controller, so each is logged, counted and annotated the same way whoever asks; refusals are
``MaintenanceError``s, mapped to HTTP by ``appliance.app``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.context import AppContext, Context
from appliance.engine.discovery import replica_name
from appliance.http import json_body
from appliance.http.errors import APIError
from appliance.http.guards import require_admin, require_lease
from appliance.maintenance.coordination import LeaseBoard, NotCoordinator
from appliance.maintenance.webhook import AlertmanagerPayload

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])
# The restart lease again, outside /admin: node pods take it with the lease token, which opens nothing else.
lease_router = APIRouter(prefix="/maintenance", dependencies=[Depends(require_lease)], tags=["maintenance"])


@router.post("/replicas/{name}/drain")
async def drain(name: str, ctx: Context) -> dict[str, Any]:
    replica = ctx.maintenance.controller.drain(name, "admin")
    return ctx.fleet_status.replica(replica)


@router.post("/replicas/{name}/undrain")
async def undrain(name: str, ctx: Context) -> dict[str, Any]:
    replica = ctx.maintenance.controller.undrain(name, "admin")
    return ctx.fleet_status.replica(replica)


@router.post("/replicas/{name}/restart", status_code=202)
async def restart(name: str, ctx: Context) -> JSONResponse:
    """Drain the replica, let in-flight requests finish (up to drain_timeout_seconds), restart it, wait until it is
    ready, warm it, return it to routing. Requests that find no routable replica meanwhile wait in the queue."""
    ctx.maintenance.controller.start_restart(name, "admin", "requested through the admin API")
    return JSONResponse({"replica": name, "action": "restart", "accepted": True}, status_code=202)


@router.post("/rolling-restart", status_code=202)
async def rolling_restart(ctx: Context) -> JSONResponse:
    """Restart every replica, one at a time, in the background; 409 while a restart is already running."""
    controller = ctx.maintenance.controller
    controller.start_rolling_restart("admin", "requested through the admin API")
    return JSONResponse({"action": "rolling_restart", "accepted": True,
                         "replicas": [r.name for r in controller.replicas()]}, status_code=202)


@router.post("/reload")
async def reload(ctx: Context) -> JSONResponse:
    """Re-read the configuration given at start; roll the replicas onto new engine settings one at a time (202),
    or, when nothing is to roll, say what changed (tenants and keys, applied at once) or that nothing did (200).
    409 for changes that cannot roll (the keys are listed), 400 if it is invalid."""
    result = ctx.maintenance.reloader.reload()
    return JSONResponse({"action": "reload", **result.as_dict()}, status_code=202 if result.rolling_restart else 200)


class LeaseRequest(BaseModel):
    """A node pod's request for the restart lease (see appliance/maintenance/coordination.py)."""

    model_config = ConfigDict(extra="forbid")

    holder: str = Field(..., min_length=1, max_length=200)
    address: str | None = Field(None, min_length=1, max_length=100)  # None: the address the request comes from
    ports: list[int] = Field(..., min_length=1, max_length=64)
    ttl_seconds: float = Field(..., gt=0, le=86400)


def _leases(ctx: AppContext) -> LeaseBoard:
    board = ctx.maintenance.leases
    if not isinstance(board, LeaseBoard):  # None: not a gateway (the context does not name maintenance's classes)
        raise NotCoordinator("restart leases are granted by gateways (role gateway): point "
                             "maintenance.coordinator_url at one")
    return board


@lease_router.post("/lease")
@router.post("/maintenance/lease")
async def acquire_lease(request: Request, ctx: Context) -> dict[str, Any]:
    """Grant or renew the restart lease: 409 ``restart_lease_held`` (another node restarts now),
    ``min_ready_replicas`` (the fleet would drop below the minimum), ``engines_not_in_view``."""
    board = _leases(ctx)
    try:
        body = LeaseRequest.model_validate(json_body.loads(await request.body()))
    except ValueError as exc:
        raise APIError(400, f"not a lease request: {_first_error(exc)}", code="invalid_lease_request") from None
    address = body.address or (request.client.host if request.client else None)
    if not address:
        raise APIError(400, "no address given and none seen", param="address", code="invalid_lease_request")
    engines = frozenset(replica_name(address, port) for port in body.ports)
    lease = board.acquire(body.holder, engines, body.ttl_seconds)
    return {"granted": True, "holder": lease.holder, "engines": sorted(lease.engines),
            "ttl_seconds": min(body.ttl_seconds, board.max_ttl_seconds)}


@lease_router.delete("/lease")
@router.delete("/maintenance/lease")
async def release_lease(holder: str, ctx: Context) -> dict[str, Any]:
    return {"released": _leases(ctx).release(holder)}


@lease_router.get("/lease")
@router.get("/maintenance/lease")
async def lease_status(ctx: Context) -> dict[str, Any]:
    return _leases(ctx).status()


@router.post("/alerts")
async def alerts(request: Request, ctx: Context) -> dict[str, Any]:
    """Alertmanager's webhook (payload version 4): whitelisted alerts trigger their runbook's action when the
    appliance's own view agrees. ``ignored``: alerts over ``maintenance.alert_max_per_payload``, only counted."""
    raw = await request.body()
    try:
        payload = AlertmanagerPayload.model_validate(json_body.loads(raw))
    except ValueError as exc:  # json_body.InvalidJSON and ValidationError are ValueErrors
        raise APIError(400, f"not an Alertmanager webhook payload: {_first_error(exc)}",
                       code="invalid_alert_payload") from None
    handled = ctx.maintenance.alerts.handle(payload)
    return {"received": len(payload.alerts), "ignored": handled.ignored,
            "decisions": [d.__dict__ for d in handled.decisions]}


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ())) or 'body'}: {first.get('msg')}"
    return str(exc)

"""Maintenance's HTTP surface: drain, undrain and restart one replica, the rolling restart, and the Alertmanager
webhook. Admin token required, like every /admin route (Alertmanager sends it with
``http_config.authorization``). Actions go through the maintenance controller, so each is logged, counted and
annotated the same way whoever asks; refusals are ``MaintenanceError``s, mapped to HTTP by ``appliance.app``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from appliance.http import json_body
from appliance.http.auth import require_admin
from appliance.http.errors import APIError
from appliance.maintenance.webhook import AlertmanagerPayload

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@router.post("/replicas/{name}/drain")
async def drain(name: str, request: Request) -> dict:
    replica = request.app.state.maintenance.controller.drain(name, "admin")
    return request.app.state.fleet_status.replica(replica)


@router.post("/replicas/{name}/undrain")
async def undrain(name: str, request: Request) -> dict:
    replica = request.app.state.maintenance.controller.undrain(name, "admin")
    return request.app.state.fleet_status.replica(replica)


@router.post("/replicas/{name}/restart", status_code=202)
async def restart(name: str, request: Request) -> JSONResponse:
    """Drain the replica, let in-flight requests finish (up to drain_timeout_seconds), restart it, wait until it is
    ready, warm it, return it to routing. Requests that find no routable replica meanwhile wait in the queue."""
    request.app.state.maintenance.controller.start_restart(name, "admin", "requested through the admin API")
    return JSONResponse({"replica": name, "action": "restart", "accepted": True}, status_code=202)


@router.post("/rolling-restart", status_code=202)
async def rolling_restart(request: Request) -> JSONResponse:
    """Restart every replica, one at a time, in the background; 409 while a restart is already running."""
    controller = request.app.state.maintenance.controller
    controller.start_rolling_restart("admin", "requested through the admin API")
    return JSONResponse({"action": "rolling_restart", "accepted": True,
                         "replicas": [r.name for r in controller.replicas()]}, status_code=202)


@router.post("/reload")
async def reload(request: Request) -> JSONResponse:
    """Re-read the configuration given at start; roll the replicas onto new engine settings one at a time (202),
    or say nothing changed (200). 409 for changes that cannot roll (the keys are listed), 400 if it is invalid."""
    result = request.app.state.maintenance.reloader.reload()
    return JSONResponse({"action": "reload", **result.as_dict()}, status_code=202 if result.rolling_restart else 200)


@router.post("/alerts")
async def alerts(request: Request) -> dict:
    """Alertmanager's webhook (payload version 4): whitelisted alerts trigger their runbook's action when the
    appliance's own view agrees. ``ignored``: alerts over ``maintenance.alert_max_per_payload``, only counted."""
    raw = await request.body()
    try:
        payload = AlertmanagerPayload.model_validate(json_body.loads(raw))
    except ValueError as exc:  # json_body.InvalidJSON and ValidationError are ValueErrors
        raise APIError(400, f"not an Alertmanager webhook payload: {_first_error(exc)}",
                       code="invalid_alert_payload") from None
    handled = request.app.state.maintenance.alerts.handle(payload)
    return {"received": len(payload.alerts), "ignored": handled.ignored,
            "decisions": [d.__dict__ for d in handled.decisions]}


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ())) or 'body'}: {first.get('msg')}"
    return str(exc)

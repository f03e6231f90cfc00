"""Maintenance API: the rolling restart on demand and the Alertmanager webhook. Admin token required, like
every /admin route (Alertmanager sends it with ``http_config.authorization``)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from appliance.gateway.auth import require_admin
from appliance.gateway.errors import APIError
from appliance.maintenance.webhook import AlertmanagerPayload

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@router.post("/rolling-restart", status_code=202)
async def rolling_restart(request: Request) -> JSONResponse:
    """Restart every replica, one at a time, in the background; 409 while a restart is already running."""
    maintenance = request.app.state.maintenance
    maintenance.controller.start_rolling_restart("admin", "requested through the admin API")
    return JSONResponse({"action": "rolling_restart", "accepted": True, "replicas": [
        r.name for r in request.app.state.replicas()]}, status_code=202)


@router.post("/alerts")
async def alerts(request: Request) -> dict:
    """Alertmanager's webhook (payload version 4): whitelisted alerts trigger their runbook's action."""
    raw = await request.body()
    try:
        payload = AlertmanagerPayload.model_validate(json.loads(raw))
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError and ValidationError are ValueErrors
        raise APIError(400, f"not an Alertmanager webhook payload: {_first_error(exc)}",
                       code="invalid_alert_payload") from None
    decisions = request.app.state.maintenance.alerts.handle(payload)
    return {"received": len(payload.alerts), "decisions": [d.__dict__ for d in decisions]}


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ())) or 'body'}: {first.get('msg')}"
    return str(exc)

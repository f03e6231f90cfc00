"""Admin API for operators and runbooks: fleet status, drain / undrain / restart one replica.

Actions go through the maintenance controller, so each is logged, counted and annotated the same way whoever
asks (see appliance/maintenance/controller.py); the rolling restart and the alert webhook are in maintenance.py.

Protected by the admin token (``admin_token``); disabled (403) when none is configured.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from appliance.gateway.auth import require_admin

log = logging.getLogger(__name__)
router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@router.get("/status")
async def status(request: Request) -> dict:
    state = request.app.state
    replicas = [_replica_status(request, r) for r in state.replicas()]
    return {
        "model": state.settings.served_model_name,
        "draining": state.draining,
        "ready_replicas": sum(1 for r in state.replicas() if r.routable),
        "queue_length": state.admission.queue_length,
        "in_flight": sum(r.status.outstanding for r in state.replicas()),
        "replicas": replicas,
        "maintenance": state.maintenance.status(),
    }


@router.post("/replicas/{name}/drain")
async def drain(name: str, request: Request) -> dict:
    replica = request.app.state.maintenance.controller.drain(name, "admin")
    return _replica_status(request, replica)


@router.post("/replicas/{name}/undrain")
async def undrain(name: str, request: Request) -> dict:
    replica = request.app.state.maintenance.controller.undrain(name, "admin")
    return _replica_status(request, replica)


@router.post("/replicas/{name}/restart", status_code=202)
async def restart(name: str, request: Request) -> JSONResponse:
    """Drain the replica, let in-flight requests finish (up to drain_timeout_seconds), restart it, wait until it is
    ready, warm it, return it to routing. Requests that find no routable replica meanwhile wait in the queue."""
    request.app.state.maintenance.controller.start_restart(name, "admin", "requested through the admin API")
    return JSONResponse({"replica": name, "action": "restart", "accepted": True}, status_code=202)


def _replica_status(request: Request, replica) -> dict:
    state = request.app.state
    status = replica.status
    health = state.router.health_of(replica.name)
    load = state.router.load.get(replica.name)
    placement = getattr(getattr(replica, "spec", None), "placement", None)
    return {
        "name": replica.name,
        "url": replica.url,
        "state": getattr(getattr(status, "state", None), "value", "ready" if replica.routable else "unknown"),
        "placement": placement.describe() if placement else None,
        "pid": getattr(status, "pid", None),
        "outstanding": status.outstanding,
        "concurrency_limit": state.admission.limit_of(replica.name),
        "ejected": health.ejected,
        "ejection_reason": health.reason or None,
        "kv_cache_usage": load.kv_cache_usage if load else None,
        "engine_waiting": load.waiting if load else None,
        "engine_running": load.running if load else None,
        "restarts": getattr(status, "restarts", None),
        "crashes": getattr(status, "crashes", None),
        "model_load_seconds": getattr(status, "load_seconds", None),
        "last_start_time": getattr(status, "last_start_time", None),
        "starts": getattr(status, "starts", None),
        "planned_restart": getattr(status, "planned_restart", False),
        "hung": state.maintenance.progress.is_hung(replica.name),
        "last_maintenance_restart": state.maintenance.controller.last_restart.get(replica.name),
    }

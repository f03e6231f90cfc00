"""Admin API for operators and runbooks: fleet status, drain / undrain / restart one replica.

Protected by the admin token (``admin_token``); disabled (403) when none is configured.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from appliance.gateway.auth import require_admin
from appliance.gateway.errors import APIError

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
    }


@router.post("/replicas/{name}/drain")
async def drain(name: str, request: Request) -> dict:
    replica = _replica(request, name)
    replica.drain()
    log.info("admin: drained %s", name)
    return _replica_status(request, replica)


@router.post("/replicas/{name}/undrain")
async def undrain(name: str, request: Request) -> dict:
    replica = _replica(request, name)
    replica.undrain()
    log.info("admin: undrained %s", name)
    return _replica_status(request, replica)


@router.post("/replicas/{name}/restart", status_code=202)
async def restart(name: str, request: Request) -> JSONResponse:
    """Drain the replica, let in-flight requests finish (up to drain_timeout_seconds), restart it."""
    replica = _replica(request, name)
    if not hasattr(replica, "restart"):
        raise APIError(409, f"{name} is not supervised by this appliance", code="not_supervised")
    task = asyncio.create_task(_drain_and_restart(request, replica))
    request.app.state.background.add(task)
    task.add_done_callback(request.app.state.background.discard)
    return JSONResponse({"replica": name, "action": "restart", "accepted": True}, status_code=202)


async def _drain_and_restart(request: Request, replica) -> None:
    replica.drain()
    deadline = time.monotonic() + request.app.state.settings.drain_timeout_seconds
    while replica.status.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    log.info("admin: restarting %s (%d requests still in flight)", replica.name, replica.status.outstanding)
    await replica.restart()


def _replica(request: Request, name: str):
    for replica in request.app.state.replicas():
        if replica.name == name:
            return replica
    raise APIError(404, f"no replica named '{name}'", param="name", code="replica_not_found")


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
    }

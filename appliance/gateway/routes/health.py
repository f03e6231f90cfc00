"""Liveness (the process answers) and readiness (a replica can serve and we are not draining)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Ready when the router has a replica to send a request to (routable, and not ejected unless panic routing
    ignores ejection), the gateway is not draining, and admission is not wedged (every such replica full only by
    a count its engine has contradicted for admission.slot_drift_seconds: nothing could be admitted while the
    engines idle): the capacity requests can actually use."""
    state = request.app.state
    router = state.router
    audit = state.admission.audit
    ready_count = sum(1 for r in state.replicas() if r.routable)
    routable = len(router.eligible())
    wedged = audit.wedged()
    is_ready = routable > 0 and not state.draining and not wedged
    body = {"status": "ready" if is_ready else "not_ready", "ready_replicas": ready_count,
            "routable_replicas": routable,
            "ejected_replicas": sum(1 for r in state.replicas() if router.health_of(r.name).ejected),
            "panic": router.panic(), "draining": state.draining,
            "slot_drift": sorted(r.name for r in state.replicas() if audit.drifted(r.name)), "wedged": wedged}
    return JSONResponse(body, status_code=200 if is_ready else 503)

"""Liveness (the process answers), readiness (a replica can serve and we are not draining) and the gateway's own
readiness (/health/serving: not draining, engines aside)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/serving")
async def serving(request: Request) -> JSONResponse:
    """The gateway's own readiness: 200 while it takes requests (not draining), whether or not an engine is ready,
    because with none it answers them 503 + Retry-After itself. Gateway pods on Kubernetes probe this, so that
    with every engine down their Service keeps its endpoints and clients get that 503 instead of a refused
    connection; /health/ready (engines included) stays the readiness of a single host and of node pods."""
    state = request.app.state
    body = {"status": "draining" if state.draining else "serving", "draining": state.draining,
            "routable_replicas": len(state.router.eligible())}
    return JSONResponse(body, status_code=503 if state.draining else 200)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Ready when the router has a replica to send a request to (routable, and not ejected unless panic routing
    ignores ejection), the gateway is not draining, and admission is not wedged (every such replica full only by
    a count its engine has contradicted for admission.slot_drift_seconds: nothing could be admitted while the
    engines idle): the capacity requests can actually use. On a node pod (role node) a hung replica is no such
    capacity either: gateway pods route to the node while it is ready."""
    state = request.app.state
    router = state.router
    audit = state.admission.audit
    ready_count = sum(1 for r in state.replicas() if r.routable)
    eligible = router.eligible()
    hung: list[str] = []
    if state.settings.role == "node":
        # Gateway pods route to this node's engines as long as it is ready: a hung engine (requests running, no
        # token generated; appliance/maintenance/progress.py) must take the node out of the headless Service.
        hung = [r.name for r in eligible if state.maintenance.progress.is_hung(r.name)]
        eligible = [r for r in eligible if r.name not in hung]
    routable = len(eligible)
    wedged = audit.wedged()
    is_ready = routable > 0 and not state.draining and not wedged
    body = {"status": "ready" if is_ready else "not_ready", "ready_replicas": ready_count,
            "routable_replicas": routable,
            "ejected_replicas": sum(1 for r in state.replicas() if router.health_of(r.name).ejected),
            "panic": router.panic(), "draining": state.draining,
            "slot_drift": sorted(r.name for r in state.replicas() if audit.drifted(r.name)), "wedged": wedged}
    if state.settings.role == "node":
        body["hung_replicas"] = hung
    return JSONResponse(body, status_code=200 if is_ready else 503)

"""Liveness (the process answers), readiness (a replica can serve and we are not draining) and the gateway's own
readiness (/health/serving: not draining, engines aside)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from appliance.context import Context
from appliance.gateway.upstream.labels import client_label

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/serving")
async def serving(ctx: Context) -> JSONResponse:
    """The gateway's own readiness: 200 while it takes requests (not draining), whether or not an engine is ready,
    because with none it answers them 503 + Retry-After itself. Gateway pods on Kubernetes probe this, so that
    with every engine down their Service keeps its endpoints and clients get that 503 instead of a refused
    connection; /health/ready (engines included) stays the readiness of a single host and of node pods.
    ``quota_store``: where the tenants' quotas live and whether a shared store answers; the gateway serves either
    way (an unreachable store fails requests open or closed, as quota_store.failure says)."""
    draining = ctx.live.draining
    body = {"status": "draining" if draining else "serving", "draining": draining,
            "routable_replicas": len(ctx.gateway.router.eligible()), "quota_store": ctx.gateway.quota_store_state()}
    return JSONResponse(body, status_code=503 if draining else 200)


@router.get("/ready")
async def ready(ctx: Context) -> JSONResponse:
    """Ready when the router has a replica to send a request to (routable, and not ejected unless panic routing
    ignores ejection), the gateway is not draining, and admission is not wedged (every such replica full only by
    a count its engine has contradicted for admission.slot_drift_seconds: nothing could be admitted while the
    engines idle): the capacity requests can actually use. On a node pod (role node) a hung replica is no such
    capacity either: gateway pods route to the node while it is ready. Open to anyone, like every /health route:
    replicas are named by their client labels, never by an address."""
    router = ctx.gateway.router
    audit = ctx.gateway.admission.audit
    replicas = ctx.replicas()
    draining = ctx.live.draining
    ready_count = sum(1 for r in replicas if r.routable)
    eligible = router.eligible()
    hung: list[str] = []
    node = ctx.live.settings.role == "node"
    if node:
        # Gateway pods route to this node's engines as long as it is ready: a hung engine (requests running, no
        # token generated; appliance/maintenance/progress.py) must take the node out of the headless Service.
        hung = [r.name for r in eligible if ctx.maintenance.progress.is_hung(r.name)]
        eligible = [r for r in eligible if r.name not in hung]
    routable = len(eligible)
    wedged = audit.wedged()
    is_ready = routable > 0 and not draining and not wedged
    body: dict[str, Any] = {
        "status": "ready" if is_ready else "not_ready", "ready_replicas": ready_count, "routable_replicas": routable,
        "ejected_replicas": sum(1 for r in replicas if router.health_of(r.name).ejected),
        "panic": router.panic(), "draining": draining,
        "slot_drift": sorted(client_label(r.name) for r in replicas if audit.drifted(r.name)), "wedged": wedged}
    if node:
        body["hung_replicas"] = [client_label(name) for name in hung]
    return JSONResponse(body, status_code=200 if is_ready else 503)

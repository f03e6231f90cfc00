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
    state = request.app.state
    ready_count = sum(1 for r in state.replicas() if r.routable)
    is_ready = ready_count > 0 and not state.draining
    body = {"status": "ready" if is_ready else "not_ready", "ready_replicas": ready_count,
            "draining": state.draining}
    return JSONResponse(body, status_code=200 if is_ready else 503)

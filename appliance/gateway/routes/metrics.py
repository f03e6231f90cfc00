"""Prometheus exposition of the gateway's registry, and HTTP service discovery of the engines' /metrics."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from appliance.context import Context
from appliance.http.guards import require_api_key_or_admin, require_metrics

router = APIRouter(tags=["observability"])


@router.get("/metrics", dependencies=[Depends(require_metrics)])
async def metrics(ctx: Context) -> Response:
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/sd/targets", dependencies=[Depends(require_api_key_or_admin)])
async def sd_targets(ctx: Context) -> list[dict[str, Any]]:
    """Prometheus HTTP SD: one target group per replica, so Prometheus scrapes vLLM's own metrics directly.
    Closed to all but the metrics and admin tokens when a metrics token is set; otherwise like /v1 when API keys
    are set (an API key or the admin token)."""
    settings = ctx.live.settings
    groups: list[dict[str, Any]] = []
    for replica in ctx.replicas():
        url = urlsplit(replica.url)
        address = f"{settings.engine.advertise_host}:{url.port}" if settings.engine.advertise_host else url.netloc
        groups.append({"targets": [address], "labels": {"replica": replica.name,
                                                        "model": settings.served_model_name}})
    return groups

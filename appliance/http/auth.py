"""Bearer-token checks, one credential per role, so each part of a deployment holds only what it needs:

- API keys (optional): /v1, and /sd/targets while no metrics token is set;
- the admin token (operator): every /admin route, and anything a narrower credential opens;
- the alerts token (optional): /admin/alerts only, Alertmanager's webhook, which then never holds the admin token;
- the metrics token (optional, read-only): when set, /metrics and /sd/targets need it (Prometheus' credential).

One policy, two callers. ``RequestIntake`` (appliance/gateway/limits.py) applies it to the request's headers before
anything reads the body, so a stranger's body is never buffered (issue 20); the routes' FastAPI dependencies apply
the same functions again as defence in depth (a route mounted outside those prefixes still needs its dependency)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import Request

from appliance.context import app_context
from appliance.http.errors import APIError

Check = Callable[[Any, str | None], APIError | None]
ALERTS_PATH = "/admin/alerts"  # Alertmanager's webhook (appliance/maintenance/routes.py)


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, accepted: list[str]) -> bool:
    # Compare against every key in constant time, so timing does not reveal a near miss.
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in accepted)


def api_key_error(settings: Any, authorization: str | None) -> APIError | None:
    """/v1: open without API keys; otherwise one of them (the flat api_keys or a tenant's)."""
    keys = settings.all_api_keys
    if not keys:
        return None
    token = _bearer(authorization)
    if token is None or not _matches(token, keys):
        return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def admin_error(settings: Any, authorization: str | None) -> APIError | None:
    """/admin: off (403) without an admin token; otherwise that token."""
    if not settings.admin_token:
        return APIError(403, "admin API disabled: set admin_token (APPLIANCE_ADMIN_TOKEN)", code="admin_disabled")
    token = _bearer(authorization)
    if token is None or not _matches(token, [settings.admin_token]):
        return APIError(401, "invalid or missing admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def alerts_error(settings: Any, authorization: str | None) -> APIError | None:
    """/admin/alerts (Alertmanager's webhook): the alerts token or the admin token; off (403) without either."""
    accepted = [token for token in (getattr(settings, "alerts_token", None), settings.admin_token) if token]
    if not accepted:
        return APIError(403, "alert webhook disabled: set alerts_token (APPLIANCE_ALERTS_TOKEN) or admin_token",
                        code="admin_disabled")
    token = _bearer(authorization)
    if token is None or not _matches(token, accepted):
        return APIError(401, "invalid or missing alerts or admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def metrics_error(settings: Any, authorization: str | None) -> APIError | None:
    """/metrics: open unless a metrics token is set; then that token or the admin token."""
    metrics_token = getattr(settings, "metrics_token", None)
    if not metrics_token:
        return None
    return _metrics_or_admin(settings, metrics_token, authorization)


def _metrics_or_admin(settings: Any, metrics_token: str, authorization: str | None) -> APIError | None:
    token = _bearer(authorization)
    accepted = [metrics_token, *([settings.admin_token] if settings.admin_token else [])]
    if token is None or not _matches(token, accepted):
        return APIError(401, "invalid or missing metrics or admin token (Authorization: Bearer <token>)",
                        code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})
    return None


def api_key_or_admin_error(settings: Any, authorization: str | None) -> APIError | None:
    """/sd/targets (it lists the engines' addresses), only the deployment's own tools need it. With a metrics
    token: that token or the admin token, which is what Prometheus sends (http_sd_configs.authorization).
    Without one: open when no API keys are set, like /v1; otherwise an API key or the admin token."""
    metrics_token = getattr(settings, "metrics_token", None)
    if metrics_token:
        return _metrics_or_admin(settings, metrics_token, authorization)
    if not settings.all_api_keys:
        return None
    token = _bearer(authorization)
    accepted = [*settings.all_api_keys, *([settings.admin_token] if settings.admin_token else [])]
    if token is None or not _matches(token, accepted):
        return APIError(401, "invalid or missing API key or admin token (Authorization: Bearer <token>)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


def check_for_path(path: str) -> Check | None:
    """The check a path needs, by the prefix its routes are mounted at; None: open (/health, the docs, which
    api_docs_urls turns off when API keys are set). ``path`` is the one Starlette routes on."""
    if path == "/v1" or path.startswith("/v1/"):
        return api_key_error
    if path.rstrip("/") == ALERTS_PATH:
        return alerts_error
    if path == "/admin" or path.startswith("/admin/"):
        return admin_error
    if path == "/sd/targets":
        return api_key_or_admin_error
    if path == "/metrics":
        return metrics_error
    return None


def refusal(settings: Any, path: str, authorization: str | None) -> APIError | None:
    """Why a request for ``path`` with this Authorization header is refused, or None."""
    check = check_for_path(path)
    return check(settings, authorization) if check is not None else None


def _raise(error: APIError | None) -> None:
    if error is not None:
        raise error


async def require_api_key(request: Request) -> None:
    """/v1's dependency: a valid key, and whose it is (``request.state.tenant``, for accounting, quotas and fair
    share; ``appliance.gateway.tenants``)."""
    authorization = request.headers.get("authorization")
    ctx = app_context(request)
    _raise(api_key_error(ctx.live.settings, authorization))
    tenant = ctx.gateway.tenants.identify(_bearer(authorization))
    if tenant is None:  # accepted by the settings, unknown to the directory: a reload between the two reads
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = tenant


async def require_admin(request: Request) -> None:
    """Every /admin route's dependency: the admin token, except on /admin/alerts, which also takes the alerts
    token (the routes share one router; the path decides, as in ``check_for_path``)."""
    check = alerts_error if getattr(request.scope.get("route"), "path", None) == ALERTS_PATH else admin_error
    _raise(check(app_context(request).live.settings, request.headers.get("authorization")))


async def require_metrics(request: Request) -> None:
    _raise(metrics_error(app_context(request).live.settings, request.headers.get("authorization")))


async def require_api_key_or_admin(request: Request) -> None:
    _raise(api_key_or_admin_error(app_context(request).live.settings, request.headers.get("authorization")))


def api_docs_urls(api_keys: list[str]) -> dict[str, Any]:
    """FastAPI's /docs, /redoc and /openapi.json: served only when the API is open anyway (no API keys); with keys
    set they would describe the admin API to anyone, so they are off."""
    if api_keys:
        return {"docs_url": None, "redoc_url": None, "openapi_url": None}
    return {}

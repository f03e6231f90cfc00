"""The routes' FastAPI dependencies for the bearer-token policy of appliance/http/auth.py: the same checks the
intake applies before any body is read, applied again per route as defence in depth, against the live credentials
of the app serving the request."""

from __future__ import annotations

from fastapi import Request

from appliance.context import app_context, client_context
from appliance.http.auth import (
    ALERTS_PATH,
    admin_error,
    alerts_error,
    api_key_error,
    api_key_or_admin_error,
    authorization_of,
    bearer,
    lease_error,
    metrics_error,
)
from appliance.http.errors import APIError


def _raise(error: APIError | None) -> None:
    if error is not None:
        raise error


def _authorization(request: Request) -> str | None:
    """The request's one Authorization header, as the intake reads it (more than one: 401, as there)."""
    return authorization_of(request.headers.getlist("authorization"))


async def require_api_key(request: Request) -> None:
    """/v1's dependency: a valid key, and whose it is (``request.state.tenant``, for accounting, quotas and fair
    share; ``appliance.gateway.tenants``)."""
    authorization = _authorization(request)
    ctx = client_context(request)
    _raise(api_key_error(ctx.live.credentials, authorization))
    tenant = ctx.gateway.tenants.identify(bearer(authorization))
    if tenant is None:  # accepted by the settings, unknown to the directory: a reload between the two reads
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = tenant


async def require_admin(request: Request) -> None:
    """Every /admin route's dependency: the admin token, except on /admin/alerts, which also takes the alerts
    token (the routes share one router; the path decides, as in ``check_for_path``)."""
    check = alerts_error if getattr(request.scope.get("route"), "path", None) == ALERTS_PATH else admin_error
    _raise(check(app_context(request).live.credentials, _authorization(request)))


async def require_lease(request: Request) -> None:
    """The restart lease routes' dependency (the intake checked the same before reading the body)."""
    _raise(lease_error(app_context(request).live.credentials, _authorization(request)))


async def require_metrics(request: Request) -> None:
    _raise(metrics_error(app_context(request).live.credentials, _authorization(request)))


async def require_api_key_or_admin(request: Request) -> None:
    _raise(api_key_or_admin_error(app_context(request).live.credentials, _authorization(request)))



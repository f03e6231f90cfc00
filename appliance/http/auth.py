"""Bearer-token checks, one credential per role, so each part of a deployment holds only what it needs:

- API keys (optional): /v1, and /sd/targets while no metrics token is set;
- the admin token (operator): every /admin route, and anything a narrower credential opens;
- the alerts token (optional): /admin/alerts only, Alertmanager's webhook, which then never holds the admin token;
- the metrics token (optional, read-only): when set, /metrics and /sd/targets need it (Prometheus' credential).

One policy, two callers. ``RequestIntake`` (appliance/gateway/intake/limits.py) applies it to the request's
headers before anything reads the body, so a stranger's body is never buffered; the routes' FastAPI dependencies
(appliance/http/guards.py) apply the same functions again as defence in depth (a route mounted outside those
prefixes still needs its dependency). The checks read one value, the live ``Credentials``, and nothing of the app."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from appliance.http.credentials import Credentials
from appliance.http.errors import APIError

Check = Callable[[Credentials, str | None], APIError | None]
ALERTS_PATH = "/admin/alerts"  # Alertmanager's webhook (appliance/maintenance/routes.py)


def bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, accepted: list[str]) -> bool:
    # Compare against every key in constant time, so timing does not reveal a near miss.
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in accepted)


def api_key_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/v1: open without API keys; otherwise one of them (the gateway's api_keys or a tenant's)."""
    keys = list(credentials.api_keys)
    if not keys:
        return None
    token = bearer(authorization)
    if token is None or not _matches(token, keys):
        return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def admin_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/admin: off (403) without an admin token; otherwise that token."""
    if not credentials.admin_token:
        return APIError(403, "admin API disabled: set gateway.admin_token (APPLIANCE_ADMIN_TOKEN)",
                        code="admin_disabled")
    token = bearer(authorization)
    if token is None or not _matches(token, [credentials.admin_token]):
        return APIError(401, "invalid or missing admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def alerts_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/admin/alerts (Alertmanager's webhook): the alerts token or the admin token; off (403) without either."""
    accepted = [token for token in (credentials.alerts_token, credentials.admin_token) if token]
    if not accepted:
        return APIError(403, "alert webhook disabled: set gateway.alerts_token (APPLIANCE_ALERTS_TOKEN) or "
                        "gateway.admin_token",
                        code="admin_disabled")
    token = bearer(authorization)
    if token is None or not _matches(token, accepted):
        return APIError(401, "invalid or missing alerts or admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def metrics_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/metrics: open unless a metrics token is set; then that token or the admin token."""
    if not credentials.metrics_token:
        return None
    return _metrics_or_admin(credentials, credentials.metrics_token, authorization)


def _metrics_or_admin(credentials: Credentials, metrics_token: str, authorization: str | None) -> APIError | None:
    token = bearer(authorization)
    accepted = [metrics_token, *([credentials.admin_token] if credentials.admin_token else [])]
    if token is None or not _matches(token, accepted):
        return APIError(401, "invalid or missing metrics or admin token (Authorization: Bearer <token>)",
                        code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})
    return None


def api_key_or_admin_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/sd/targets (it lists the engines' addresses), only the deployment's own tools need it. With a metrics
    token: that token or the admin token, which is what Prometheus sends (http_sd_configs.authorization).
    Without one: open when no API keys are set, like /v1; otherwise an API key or the admin token."""
    if credentials.metrics_token:
        return _metrics_or_admin(credentials, credentials.metrics_token, authorization)
    if not credentials.api_keys:
        return None
    token = bearer(authorization)
    accepted = [*credentials.api_keys, *([credentials.admin_token] if credentials.admin_token else [])]
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


def refusal(credentials: Credentials, path: str, authorization: str | None) -> APIError | None:
    """Why a request for ``path`` with this Authorization header is refused, or None."""
    check = check_for_path(path)
    return check(credentials, authorization) if check is not None else None


def api_docs_urls(api_keys: list[str]) -> dict[str, Any]:
    """FastAPI's /docs, /redoc and /openapi.json: served only when the API is open anyway (no API keys); with keys
    set they would describe the admin API to anyone, so they are off."""
    if api_keys:
        return {"docs_url": None, "redoc_url": None, "openapi_url": None}
    return {}

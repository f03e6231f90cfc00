"""Bearer-token checks, one credential per role, so each part of a deployment holds only what it needs:

- API keys (optional): /v1, and /sd/targets while no metrics token is set;
- the admin token (operator): every /admin route, and anything a narrower credential opens;
- the alerts token (optional): /admin/alerts only, Alertmanager's webhook, which then never holds the admin token;
- the metrics token (optional, read-only): when set, /metrics and /sd/targets need it (Prometheus' credential);
  /metrics needs it (or the admin token) as soon as any API key is set, metrics token or not;
- the lease token (optional): /maintenance/lease only, a node pod's restart lease (the admin token opens it too).

A request with more than one Authorization header is refused everywhere (401), before any check reads one. Every
comparison is of SHA-256 digests in constant time, against every accepted value (``_matches``). A value a reload
replaced stays accepted within its overlap window (``appliance.http.credentials.Keyring``).

One policy, two callers. ``RequestIntake`` (appliance/gateway/intake/limits.py) applies it to the request's
headers before anything reads the body, so a stranger's body is never buffered; the routes' FastAPI dependencies
(appliance/http/guards.py) apply the same functions again as defence in depth (a route mounted outside those
prefixes still needs its dependency). The checks read one value, the live ``Credentials``, and nothing of the app."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from appliance.http.credentials import ADMIN, ALERTS, API_KEYS, LEASE, METRICS, Credentials, digest
from appliance.http.errors import APIError

Check = Callable[[Credentials, str | None], APIError | None]
ALERTS_PATH = "/admin/alerts"  # Alertmanager's webhook (appliance/maintenance/routes.py)
LEASE_PATH = "/maintenance/lease"  # a node pod's restart lease (appliance/maintenance/routes.py)
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})  # FastAPI's, as create_app mounts


def bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, accepted: Iterable[bytes]) -> bool:
    """Whether ``token`` is one of the ``accepted`` digests. Digests, not the values: equal lengths, so the
    comparison's time reveals neither a near miss nor a secret's length; and every one is compared, with no early
    exit, so neither does which of them matched."""
    presented = digest(token)
    found = False
    for candidate in accepted:
        found |= hmac.compare_digest(presented, candidate)
    return found


def accepts(credentials: Credentials, authorization: str | None, *roles: str) -> bool:
    """Whether the bearer token is one of the values these roles accept (a replaced one within its window)."""
    token = bearer(authorization)
    return token is not None and _matches(token, [d for role in roles for d in credentials.accepted(role)])


def duplicate_authorization_error() -> APIError:
    """More than one Authorization header: which one a check reads would decide, and parts of a stack disagree
    (the first or the last), so none is read and the request is refused, the same way on every path."""
    return APIError(401, "more than one Authorization header; send one", code="invalid_authorization",
                    headers={"WWW-Authenticate": "Bearer"})


def revoked_error() -> APIError:
    """A request whose tenant a reload removed: its key no longer opens /v1, so it ends (queued or streaming)."""
    return APIError(401, "the API key was revoked: its tenant was removed from the configuration",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def api_key_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/v1: open without API keys; otherwise one of them (the gateway's api_keys or a tenant's, or one a reload
    replaced, within its overlap window)."""
    if not credentials.api_keys:
        return None
    if not accepts(credentials, authorization, API_KEYS):
        return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def admin_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/admin: off (403) without an admin token; otherwise that token (or the one a reload replaced, within its
    overlap window)."""
    if not credentials.enabled(ADMIN):
        return APIError(403, "admin API disabled: set gateway.admin_token (APPLIANCE_ADMIN_TOKEN)",
                        code="admin_disabled")
    if not accepts(credentials, authorization, ADMIN):
        return APIError(401, "invalid or missing admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def alerts_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/admin/alerts (Alertmanager's webhook): the alerts token or the admin token; off (403) without either."""
    if not credentials.enabled(ALERTS) and not credentials.enabled(ADMIN):
        return APIError(403, "alert webhook disabled: set gateway.alerts_token (APPLIANCE_ALERTS_TOKEN) or "
                        "gateway.admin_token",
                        code="admin_disabled")
    if not accepts(credentials, authorization, ALERTS, ADMIN):
        return APIError(401, "invalid or missing alerts or admin token", code="invalid_admin_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def metrics_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/metrics: the metrics token or the admin token once either a metrics token or any API key is set (the page
    names the tenants and shows their usage and quota levels: no business of any one client); open only on an
    appliance that is open anyway (no API key, no metrics token)."""
    if credentials.enabled(METRICS):
        return _metrics_or_admin(credentials, authorization)
    if not credentials.api_keys:
        return None
    if not credentials.enabled(ADMIN):
        return APIError(403, "/metrics is closed while API keys are set: set gateway.metrics_token (Prometheus' "
                        "credential) or gateway.admin_token", code="metrics_disabled")
    return _metrics_or_admin(credentials, authorization)


def _metrics_or_admin(credentials: Credentials, authorization: str | None) -> APIError | None:
    if not accepts(credentials, authorization, METRICS, ADMIN):
        return APIError(401, "invalid or missing metrics or admin token (Authorization: Bearer <token>)",
                        code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})
    return None


def api_key_or_admin_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/sd/targets (it lists the engines' addresses), only the deployment's own tools need it. With a metrics
    token: that token or the admin token, which is what Prometheus sends (http_sd_configs.authorization).
    Without one: open when no API keys are set, like /v1; otherwise an API key or the admin token."""
    if credentials.enabled(METRICS):
        return _metrics_or_admin(credentials, authorization)
    if not credentials.api_keys:
        return None
    if not accepts(credentials, authorization, API_KEYS, ADMIN):
        return APIError(401, "invalid or missing API key or admin token (Authorization: Bearer <token>)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


def lease_error(credentials: Credentials, authorization: str | None) -> APIError | None:
    """/maintenance/lease (a node pod's restart lease): the lease token or the admin token; off (403) without either.
    The one credential a node pod needs from a gateway, so that it holds no admin token (docs/security.md)."""
    if not credentials.enabled(LEASE) and not credentials.enabled(ADMIN):
        return APIError(403, "restart leases disabled: set gateway.lease_token or gateway.admin_token",
                        code="admin_disabled")
    if not accepts(credentials, authorization, LEASE, ADMIN):  # digests, constant time, every value compared
        return APIError(401, "invalid or missing lease or admin token", code="invalid_lease_token",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def docs_error(credentials: Credentials, _authorization: str | None) -> APIError | None:
    """/docs, /redoc, /openapi.json: served only while the API is open (no API key). ``api_docs_urls`` leaves
    them unmounted on an appliance that starts with keys; this closes them on one that started open when a
    reload adds keys (they would describe the admin API to anyone)."""
    if credentials.api_keys:
        return APIError(404, "Not Found", code="not_found")
    return None


def check_for_path(path: str) -> Check | None:
    """The check a path needs, by the prefix its routes are mounted at; None: open (/health, /runbooks). The docs
    are open only while the API is (``docs_error``). ``path`` is the one Starlette routes on."""
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
    if path.rstrip("/") == LEASE_PATH:
        return lease_error
    if path in DOCS_PATHS:
        return docs_error
    return None


def authorization_of(values: Sequence[str]) -> str | None:
    """The request's one Authorization header (None: it has none); more than one is refused (APIError)."""
    if len(values) > 1:
        raise duplicate_authorization_error()
    return values[0] if values else None


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

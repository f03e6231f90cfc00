"""Bearer-token checks: API keys for /v1 (optional), the admin token for /admin (required to enable it)."""

from __future__ import annotations

import hmac

from fastapi import Request

from appliance.http.errors import APIError


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, accepted: list[str]) -> bool:
    # Compare against every key in constant time, so timing does not reveal a near miss.
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in accepted)


async def require_api_key(request: Request) -> None:
    keys = request.app.state.settings.api_keys
    if not keys:
        return
    token = _bearer(request)
    if token is None or not _matches(token, keys):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


async def require_admin(request: Request) -> None:
    admin_token = request.app.state.settings.admin_token
    if not admin_token:
        raise APIError(403, "admin API disabled: set admin_token (APPLIANCE_ADMIN_TOKEN)", code="admin_disabled")
    token = _bearer(request)
    if token is None or not _matches(token, [admin_token]):
        raise APIError(401, "invalid or missing admin token", code="invalid_admin_token",
                       headers={"WWW-Authenticate": "Bearer"})

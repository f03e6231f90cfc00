"""The bearer credentials the appliance accepts, by role: the one value the auth checks read
(``appliance.http.auth``), built from the live settings (``Settings.credentials``), so a reload that changes the
keys is seen by the next request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Credentials:
    api_keys: tuple[str, ...] = ()  # /v1: the gateway's keys and every tenant's; empty: the API is open
    admin_token: str | None = None  # /admin, and whatever a narrower credential opens
    alerts_token: str | None = None  # /admin/alerts only (Alertmanager's webhook)
    metrics_token: str | None = None  # when set, /metrics and /sd/targets need it (or the admin token)

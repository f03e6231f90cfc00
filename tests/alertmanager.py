"""What a real Alertmanager holds of one alert, for the tests that send it one (the appliance's and compose's)."""

from __future__ import annotations

from typing import Any

import httpx


def alert_status(alertmanager: str, alertname: str, replica: str) -> dict[str, Any] | None:
    """The alert's status in Alertmanager (state, inhibitedBy, silencedBy) while it holds it unresolved; else None."""
    alerts = httpx.get(f"{alertmanager}/api/v2/alerts", params={"filter": f'alertname="{alertname}"'},
                       timeout=5).json()
    return next((a["status"] for a in alerts if a["labels"].get("replica") == replica), None)


def delivered(status: dict[str, Any]) -> bool:
    """Active, or held by an inhibit rule: alerts/alertmanager.yml holds a warning while a critical alert fires (on
    a loaded test host the TTFT budget-burn page can), so that the alert arrived is all a test may ask."""
    return status["state"] == "active" or (status["state"] == "suppressed" and bool(status["inhibitedBy"]))

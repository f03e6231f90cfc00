"""The dashboards by uid, and all of them at once as plain data (for the files here and for other outputs,
such as Kubernetes ConfigMaps, built from the same code)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards import capacity, hardware, maintenance, overview, tenants
from appliance.monitoring.dashboards.board import resolve

Builder = Callable[[MonitoringConfig | None], dict[str, Any]]

# Stable uids: links, bookmarks, runbooks and `appliance snapshot --dashboard` rely on them.
DASHBOARDS: dict[str, Builder] = {overview.UID: overview.build, capacity.UID: capacity.build,
                                  hardware.UID: hardware.build, maintenance.UID: maintenance.build,
                                  tenants.UID: tenants.build}


def build_dashboards(config: MonitoringConfig | None = None) -> dict[str, dict[str, Any]]:
    """uid -> dashboard (Grafana's JSON model as a dict) for every dashboard, from one config."""
    config = resolve(config)
    return {uid: build(config) for uid, build in DASHBOARDS.items()}

"""Settings of the monitoring stack around the gateway; nested in the appliance's settings as ``monitoring``.

`appliance up` runs Prometheus and Alertmanager as child processes when their binaries exist (Debian's
``prometheus`` and ``prometheus-alertmanager`` packages); compose runs the same configuration in containers.
Both render their files with :mod:`appliance.monitoring.bundle` from the templates in ``alerts/``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class MonitoringSettings(BaseModel):
    """Where Prometheus and Alertmanager run, and how often Prometheus looks."""

    model_config = ConfigDict(extra="forbid")

    local: bool = Field(
        True, description="`appliance up`: also run Prometheus and Alertmanager locally when their binaries exist."
    )
    prometheus_binary: str = Field("prometheus", description="Prometheus executable (name on PATH or path).")
    alertmanager_binary: str = Field(
        "prometheus-alertmanager", description="Alertmanager executable; `alertmanager` is tried when absent."
    )
    prometheus_port: int = Field(9090, ge=1, le=65535, description="Local Prometheus port (127.0.0.1).")
    alertmanager_port: int = Field(9093, ge=1, le=65535, description="Local Alertmanager port (127.0.0.1).")
    scrape_interval_seconds: int = Field(
        15, ge=1, le=300, description="Prometheus scrape and rule evaluation interval."
    )
    retention: str = Field("15d", pattern=r"^\d+[smhdwy]$", description="Local Prometheus TSDB retention (e.g. 15d).")
    public_url: str | None = Field(
        None, pattern=r"^https?://[^/\s]+(/\S*)?$",
        description="The gateway's URL as on-call's browser reaches it: alerts' runbook links become "
                    "PUBLIC_URL/runbooks/ALERT (the gateway serves docs/runbooks/). Default: appliance_url in "
                    "alerts/config.yaml (http://localhost:8000).")
    assets_dir: Path | None = Field(
        None, description="Folder holding alerts/ and dashboards/; default the source tree the package runs from."
    )

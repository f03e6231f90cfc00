"""Settings of scheduled maintenance, alert-driven actions and Grafana annotations; nested as ``maintenance``.

Automatic restarts are off by default (``enabled``): an appliance restarts engines on its own only when the
operator asked for it. The admin API, the alert webhook (subject to its whitelist) and hung-replica detection
work either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator

AlertAction = Literal["restart", "rolling_restart"]

DEFAULT_ALERT_ACTIONS: dict[str, AlertAction] = {
    "ApplianceFragmentationRising": "rolling_restart",
    "ApplianceReplicaHung": "restart",
}


class MaintenanceSettings(BaseModel):
    """When and how the appliance restarts its engines by itself, and what it does with Alertmanager's alerts."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False, description="Automatic rolling restarts: in the window, and when fragmentation/memory growth asks."
    )
    window_cron: str = Field("0 3 * * *", description="Crontab expression of each maintenance window's start.")
    window_duration_seconds: float = Field(3600, gt=0, description="How long each maintenance window lasts.")
    timezone: str = Field("UTC", description="IANA time zone the window's cron expression is read in.")
    check_interval_seconds: float = Field(
        15, gt=0, description="How often the maintenance job samples traffic, progress and memory and decides."
    )
    traffic_lookback_seconds: float = Field(
        300, gt=0, description="Traffic counts as low only if it stayed low over this look-back."
    )
    max_request_rate: float = Field(
        0.5, ge=0, description="Low traffic: at most this many requests per second over the look-back."
    )
    max_queue: int = Field(
        0, ge=0, description="Low traffic: the gateway queue never exceeded this over the look-back."
    )
    fragmentation_threshold: float | None = Field(
        0.5, gt=0, le=1, description="A replica whose allocator fragmentation ratio exceeds this wants a restart; "
        "unset: ignored."
    )
    memory_growth_threshold: float | None = Field(
        0.5, gt=0, description="A replica whose resident memory grew by more than this ratio over "
        "memory_growth_lookback_seconds wants a restart; unset: ignored."
    )
    memory_growth_lookback_seconds: float = Field(
        3600, gt=0, description="Look-back of the memory-growth signal (growth over its lowest reading in it)."
    )
    memory_restart_min_interval_seconds: float = Field(
        21600, ge=0, description="Restarts wanted by fragmentation or memory growth run at most once per this "
        "interval (a replica that is fragmented right after a start must not restart in a loop)."
    )
    min_ready_replicas: int = Field(
        1, ge=0, description="No drain or restart (admin, schedule, alert) leaves fewer replicas routable (capped at "
        "replicas-1)."
    )
    min_ready_wait_seconds: float = Field(
        60, ge=0, description="How long a rolling restart waits for enough routable replicas before it skips."
    )
    restart_ready_timeout_seconds: float = Field(
        300, gt=0, description="A restarted replica not ready and warmed within this aborts the rolling restart."
    )
    warmup_prompt: str = Field("Hello", min_length=1, description="Prompt of the warm-up request a restarted "
                               "replica answers before it takes traffic.")
    warmup_max_tokens: int = Field(4, ge=1, description="max_tokens of the warm-up request.")
    hung_after_seconds: float = Field(
        60, gt=0, description="A replica with running requests but no generated token for this long is hung."
    )
    alert_actions: dict[str, AlertAction] = Field(
        default_factory=lambda: dict(DEFAULT_ALERT_ACTIONS),
        description="Whitelist: alertname -> action (restart | rolling_restart); other alerts are only recorded.",
    )
    alert_dry_run: bool = Field(False, description="Alert webhook: record and annotate what it would do, do nothing.")
    alert_action_min_interval_seconds: float = Field(
        600, ge=0, description="Alert webhook: the same action on the same target at most once per this interval."
    )
    alert_restarts_per_hour: int = Field(
        3, ge=0, description="Alert webhook: at most this many alert-driven restarts (one replica, or a rolling "
        "restart) in any hour, all alerts and replicas together; 0: alerts never restart anything."
    )
    alert_confirm_fragmentation_ratio: float = Field(
        0.3, gt=0, le=1, description="Alert webhook: an alert's rolling restart acts only while the appliance's own "
        "reading shows a replica's fragmentation above this (or over fragmentation_threshold/memory growth)."
    )
    alert_max_per_payload: int = Field(
        100, ge=1, description="Alert webhook: alerts looked at per notification (whitelisted first); the rest are "
        "only counted (action=ignored)."
    )
    coordinator_url: str | None = Field(
        None, description="Role node: base URL of the gateway that grants restart leases (one node restarts at a "
        "time, only while the gateway's view keeps min_ready_replicas routable elsewhere); required on role node "
        "with enabled."
    )
    coordinator_address: str | None = Field(
        None, description="Role node: this node's address as the coordinating gateway's discovery sees it (the "
        "pod IP); unset: engine.host unless it is a wildcard, else the address the gateway sees the request from."
    )
    coordinator_lease_seconds: float = Field(
        60, gt=0, description="A restart lease expires this long after its last renewal (a node that dies "
        "holding it frees it); the holder renews it every third of this."
    )
    coordinator_timeout_seconds: float = Field(
        5, gt=0, description="Time limit of one request to the coordinator; a failed request is a refusal."
    )
    grafana_url: str | None = Field(
        None, description="Grafana base URL for annotations of maintenance actions; unset: no annotations."
    )
    grafana_token: str | None = Field(None, description="Grafana service-account token for annotations.")
    grafana_token_file: Path | None = Field(None, description="File holding the Grafana token (wins over "
                                            "grafana_token); for secrets mounted as files.")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {value!r}") from exc
        return value

    @field_validator("window_cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        from appliance.maintenance.window import cron_trigger

        cron_trigger(value, "UTC")  # raises ValueError with the reason
        return value

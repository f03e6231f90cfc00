"""Maintenance metrics: actions taken (and not taken), alerts received, hung replicas, the next window.

Counters are incremented where the action happens; the hung flags and the next window are state, read from the
live objects at scrape time like the gateway's fleet metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

ACTIONS = ("drain", "undrain", "restart", "rolling_restart")
TRIGGERS = ("admin", "schedule", "alert")
RESULTS = ("ok", "failed", "aborted", "dry_run", "rate_limited", "skipped", "not_confirmed", "refused")
ALERT_DECISIONS = ("none", "duplicate", "ignored")  # besides the whitelisted actions
OTHER_ALERT = "other"  # every alert name off the whitelist: anyone who reaches Alertmanager can invent names
HEARTBEAT_ALERT = "Watchdog"  # always firing: its arrival, by name, proves the alerting pipeline end to end


class MaintenanceMetrics:
    """Every label takes values from a known set: the alert name is the whitelist's or ``other``, so forged or
    unusual alerts cannot grow the series count (2,000 invented names once made 4,000 series)."""

    def __init__(self, registry: CollectorRegistry, known_alerts: Collection[str] = ()) -> None:
        self.known_alerts = frozenset(known_alerts) | {HEARTBEAT_ALERT}
        self.actions = Counter(
            "appliance_maintenance_actions", "Maintenance actions by action, what triggered them and their result "
            "(ok, failed, aborted, dry_run, rate_limited, skipped, not_confirmed, refused); the alert webhook "
            "records the alerts of one payload once per action, target and result.", ["action", "trigger", "result"],
            registry=registry)
        self.alerts = Counter(
            "appliance_alert_webhook_alerts", "Alerts received on the Alertmanager webhook, by alert name "
            "(whitelisted names and Watchdog; every other one is 'other') and status, and what the webhook "
            "decided (the whitelisted action, none, duplicate, or ignored: over the per-payload bound).",
            ["alertname", "status", "action"], registry=registry)

    def action(self, action: str, trigger: str, result: str) -> None:
        self.actions.labels(action, trigger, result).inc()

    def alert(self, alertname: str, status: str, action: str, count: int = 1) -> None:
        """``status`` is firing|resolved and ``action`` the whitelist's or one of ALERT_DECISIONS (validated
        upstream)."""
        self.alerts.labels(self.alert_label(alertname), status, action).inc(count)

    def alert_label(self, alertname: str) -> str:
        return alertname if alertname in self.known_alerts else OTHER_ALERT


class MaintenanceCollector(Collector):
    def __init__(self, hung_names: Callable[[], Sequence[str]], is_hung: Callable[[str], bool],
                 next_window: Callable[[], float | None]) -> None:
        self._names = hung_names
        self._is_hung = is_hung
        self._next_window = next_window

    def collect(self) -> Iterable[Metric]:
        hung = GaugeMetricFamily("appliance_replica_hung", "1 while a replica has requests running but generated "
                                 "no token for maintenance.hung_after_seconds.", labels=["replica"])
        for name in self._names():
            hung.add_metric([name], 1.0 if self._is_hung(name) else 0.0)
        yield hung
        upcoming = self._next_window()
        if upcoming is not None and not math.isnan(upcoming):
            yield GaugeMetricFamily("appliance_maintenance_next_window_timestamp_seconds",
                                    "Unix time the next maintenance window starts (absent when scheduled "
                                    "maintenance is disabled).", value=upcoming)

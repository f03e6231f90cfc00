"""Alertmanager webhook receiver: a short whitelist of alerts whose runbook remediation the appliance runs itself.

Alertmanager re-sends a firing alert every ``repeat_interval`` and groups alerts into one notification, so an
action is keyed on the alert's identity (fingerprint and start): one firing alert triggers its action once, and
again only after it resolved and fired anew. On top of that, the same action on the same replica runs at most
once per ``alert_action_min_interval_seconds`` (a flapping alert must not restart engines in a loop); the key is
the replica the alert resolves to, so relabelled or re-fingerprinted copies of an alert hit the same limit. The
controller refuses a restart while another alert-driven restart runs or when it would leave fewer than
``min_ready_replicas`` routable: the alert is then "skipped", not marked acted on, and Alertmanager's next repeat
notification tries again. In dry-run
mode the decision is recorded (log, metric, annotation) and nothing is done. Alerts off the whitelist are only
recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.maintenance.controller import MaintenanceController
from appliance.maintenance.errors import MaintenanceError, ReplicaNotFound
from appliance.maintenance.metrics import MaintenanceMetrics
from appliance.maintenance.settings import AlertAction

log = logging.getLogger(__name__)

DEDUPE_TTL_SECONDS = 7 * 24 * 3600


class Alert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = ""  # noqa: N815 - Alertmanager's field names
    endsAt: str = ""  # noqa: N815
    generatorURL: str = ""  # noqa: N815
    fingerprint: str = ""


class AlertmanagerPayload(BaseModel):
    """Alertmanager's webhook body, version 4."""

    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupKey: str = ""  # noqa: N815
    alerts: list[Alert]
    truncatedAlerts: int = 0  # noqa: N815


@dataclass(frozen=True)
class Decision:
    alertname: str
    status: str
    action: str  # the whitelisted action, "none" (recorded only) or "duplicate"
    result: str | None  # for whitelisted firing alerts: ok (scheduled/started), dry_run, rate_limited, skipped
    target: str | None
    detail: str


class AlertActions:
    def __init__(self, controller: MaintenanceController, metrics: MaintenanceMetrics, *,
                 whitelist: dict[str, AlertAction], dry_run: bool, min_interval_seconds: float,
                 want_rolling_restart: Callable[[str, str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.controller = controller
        self.metrics = metrics
        self.whitelist = whitelist
        self.dry_run = dry_run
        self.min_interval_seconds = min_interval_seconds
        self._want_rolling_restart = want_rolling_restart
        self._clock = clock
        self._acted: dict[str, float] = {}  # alert identity -> when acted (deduplication)
        self._last_run: dict[tuple[str, str], float] = {}  # (action, target) -> when (rate limit)

    def handle(self, payload: AlertmanagerPayload) -> list[Decision]:
        now = self._clock()
        self._forget_old(now)
        return [self._one(alert, now) for alert in payload.alerts]

    def _one(self, alert: Alert, now: float) -> Decision:
        name = alert.labels.get("alertname", "unnamed")
        action = self.whitelist.get(name)
        identity = alert.fingerprint or repr(sorted(alert.labels.items()))
        identity += "@" + alert.startsAt
        if action is None or alert.status == "resolved":
            self._acted.pop(identity, None)
            return self._decided(alert, name, "none", None, None, "recorded only")
        if identity in self._acted:
            return self._decided(alert, name, "duplicate", None, None, "already acted on this firing alert")
        target = "all"
        if action == "restart":
            label = alert.labels.get("replica")
            if label is None:
                return self._act(alert, name, action, "skipped", None, "alert has no replica label")
            try:  # the rate limit is keyed on the replica acted on, whatever else the alert's labels say
                target = self.controller.replica(label).name
            except ReplicaNotFound as exc:
                return self._act(alert, name, action, "skipped", label, exc.message)
        last = self._last_run.get((action, target))
        if last is not None and now - last < self.min_interval_seconds:
            return self._act(alert, name, action, "rate_limited", target,
                             f"{action} of {target} ran {now - last:.0f}s ago "
                             f"(at most once per {self.min_interval_seconds:.0f}s)")
        if self.dry_run:
            self._acted[identity] = now
            return self._act(alert, name, action, "dry_run", target, f"dry run: would {action} {target}")
        result, detail = self._run(action, target, name)
        if result == "ok":
            self._acted[identity] = now
            self._last_run[(action, target)] = now
        return self._decided(alert, name, action, result, target, detail)

    def _run(self, action: str, target: str, alertname: str) -> tuple[str, str]:
        if action == "rolling_restart":
            self._want_rolling_restart("alert", alertname)
            return "ok", "rolling restart scheduled for the next low-traffic moment"
        try:
            self.controller.start_restart(target, "alert", reason=alertname)
        except MaintenanceError as exc:
            self.controller.record("restart", "alert", "skipped", replica=target, detail=exc.message)
            return "skipped", exc.message
        return "ok", f"restart of {target} started"

    def _act(self, alert: Alert, name: str, action: str, result: str, target: str | None, detail: str) -> Decision:
        """A whitelisted action decided but not run: counted and annotated like the actions that run."""
        self.controller.record(action, "alert", result, replica=target if target != "all" else None,
                               detail=f"{name}: {detail}")
        return self._decided(alert, name, action, result, target, detail)

    def _decided(self, alert: Alert, name: str, action: str, result: str | None, target: str | None,
                 detail: str) -> Decision:
        self.metrics.alert(name, alert.status, action)
        log.info("alert %s (%s) %s: %s", name, alert.status, action, detail)
        return Decision(name, alert.status, action, result, target, detail)

    def _forget_old(self, now: float) -> None:
        for identity, at in list(self._acted.items()):
            if now - at > DEDUPE_TTL_SECONDS:
                del self._acted[identity]

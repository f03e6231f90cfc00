"""Alertmanager webhook receiver: a short whitelist of alerts whose runbook remediation the appliance runs itself.

Alertmanager re-sends a firing alert every ``repeat_interval`` and groups alerts into one notification, so an
action is keyed on the alert's identity (fingerprint and start): one firing alert triggers its action once, and
again only after it resolved and fired anew. On top of that, the same action on the same replica runs at most
once per ``alert_action_min_interval_seconds`` (a flapping alert must not restart engines in a loop); the key is
the replica the alert resolves to, so relabelled or re-fingerprinted copies of an alert hit the same limit.

Alertmanager takes alerts from anyone who reaches it, so an alert confirms, never commands:
- its action runs only while the appliance's own detectors agree (``confirm``), else it is ``not_confirmed``;
- alert-driven restarts share one budget, ``alert_restarts_per_hour``, whatever the alert or replica; over it
  they are ``refused``;
- the controller never lets an alert take the last routable replica (``refused``; an operator can, through the
  admin API), nor run a restart while another alert-driven one runs or below ``min_ready_replicas``
  (``skipped``).
An alert not acted on for any of these reasons is not marked as acted on: Alertmanager's next repeat notification
tries again. In dry-run mode the decision is recorded and nothing is done. Alerts off the whitelist are only
recorded.

One notification costs bounded work whatever it holds: at most ``alert_max_per_payload`` alerts are looked at
(whitelisted ones first), the rest only counted; decisions are recorded (log line, action counter, annotation)
once per action, target and result, and alerts are logged once per name, status and decision, with their count.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.maintenance.confirm import AlertConfirmation
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
    # for whitelisted firing alerts: ok (scheduled/started), dry_run, rate_limited, not_confirmed, refused, skipped
    result: str | None
    target: str | None
    detail: str


@dataclass(frozen=True)
class Handled:
    decisions: list[Decision]  # one per alert looked at, whitelisted alerts first
    ignored: int  # alerts over the per-payload bound: counted, not looked at


class AlertActions:
    def __init__(self, controller: MaintenanceController, metrics: MaintenanceMetrics, *,
                 whitelist: dict[str, AlertAction], dry_run: bool, min_interval_seconds: float,
                 want_rolling_restart: Callable[[str, str], None], confirmation: AlertConfirmation,
                 restarts_per_hour: int, max_per_payload: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.controller = controller
        self.metrics = metrics
        self.whitelist = whitelist
        self.dry_run = dry_run
        self.min_interval_seconds = min_interval_seconds
        self.confirmation = confirmation
        self.restarts_per_hour = restarts_per_hour
        self.max_per_payload = max_per_payload
        self._want_rolling_restart = want_rolling_restart
        self._clock = clock
        self._acted: dict[str, float] = {}  # alert identity -> when acted (deduplication)
        self._last_run: dict[tuple[str, str], float] = {}  # (action, target) -> when (rate limit)
        self._restarts: deque[float] = deque()  # when each alert-driven restart of the last hour was started

    def handle(self, payload: AlertmanagerPayload) -> Handled:
        now = self._clock()
        self._forget_old(now)
        # Whitelisted alerts first: a flood of other names must not push the ones that act out of the bound.
        alerts = sorted(payload.alerts, key=lambda a: a.labels.get("alertname") not in self.whitelist)
        taken, ignored = alerts[:self.max_per_payload], alerts[self.max_per_payload:]
        decisions = [self._one(alert, now) for alert in taken]
        self._record(decisions)
        self._count(taken, decisions, ignored)
        return Handled(decisions, len(ignored))

    def _one(self, alert: Alert, now: float) -> Decision:
        """Decide on one alert, and start its action when everything agrees; records nothing (``_record``)."""
        name = alert.labels.get("alertname", "unnamed")
        action = self.whitelist.get(name)
        identity = alert.fingerprint or repr(sorted(alert.labels.items()))
        identity += "@" + alert.startsAt
        if action is None or alert.status == "resolved":
            self._acted.pop(identity, None)
            return Decision(name, alert.status, "none", None, None, "recorded only")
        if identity in self._acted:
            return Decision(name, alert.status, "duplicate", None, None, "already acted on this firing alert")

        def decided(result: str, target: str | None, detail: str) -> Decision:
            return Decision(name, alert.status, action, result, target, detail)

        label = alert.labels.get("replica")
        replica = None
        if label is not None:
            try:  # the rate limit is keyed on the replica acted on, whatever else the alert's labels say
                replica = self.controller.replica(label).name
            except ReplicaNotFound as exc:
                if action == "restart":
                    return decided("skipped", label, exc.message)
        if action == "restart":
            if replica is None:
                return decided("skipped", None, "alert has no replica label")
            target = replica
        else:
            target = "all"
        last = self._last_run.get((action, target))
        if last is not None and now - last < self.min_interval_seconds:
            return decided("rate_limited", target, f"{action} of {target} ran {now - last:.0f}s ago "
                           f"(at most once per {self.min_interval_seconds:.0f}s)")
        disagreement = self.confirmation.disagreement(action, replica)
        if disagreement is not None:
            return decided("not_confirmed", target, disagreement)
        if self._budget_spent(now):
            return decided("refused", target, f"{len(self._restarts)} alert-driven restart(s) in the last hour: "
                           f"maintenance.alert_restarts_per_hour ({self.restarts_per_hour}) is spent")
        if self.dry_run:
            self._acted[identity] = now
            return decided("dry_run", target, f"dry run: would {action} {target}")
        result, detail = self._run(action, target, name)
        if result == "ok":
            self._acted[identity] = now
            self._last_run[(action, target)] = now
            self._restarts.append(now)
        return decided(result, target, detail)

    def _run(self, action: str, target: str, alertname: str) -> tuple[str, str]:
        try:
            if action == "rolling_restart":
                self.controller.check_rolling_restart("alert")
                self._want_rolling_restart("alert", alertname)
                return "ok", "rolling restart scheduled for the next low-traffic moment"
            self.controller.start_restart(target, "alert", reason=alertname)
        except MaintenanceError as exc:
            return exc.result, exc.message
        return "ok", f"restart of {target} started"

    def _budget_spent(self, now: float) -> bool:
        while self._restarts and now - self._restarts[0] >= 3600:
            self._restarts.popleft()
        return len(self._restarts) >= self.restarts_per_hour

    def _record(self, decisions: list[Decision]) -> None:
        """Whitelisted actions decided but not run (or not yet: a started restart records its own outcome), once
        per action, target and result: counted and annotated like the actions that run. Unknown replicas share
        one target, so invented ``replica`` labels cannot multiply the records either."""
        known = {r.name for r in self.controller.replicas()} | {"all"}
        groups: dict[tuple[str, str | None, str], list[Decision]] = {}
        for decision in decisions:
            if decision.result is not None and decision.result != "ok":
                target = decision.target if decision.target in known else None
                groups.setdefault((decision.action, target, decision.result), []).append(decision)
        for (action, target, result), group in groups.items():
            first = group[0]
            if len(group) == 1:
                detail = f"{first.alertname}: {first.detail}"
            else:
                names = ", ".join(sorted({d.alertname for d in group}))  # whitelisted names: a short list
                detail = f"{len(group)} alerts ({names}); the first: {first.detail}"
            self.controller.record(action, "alert", result, replica=target if target != "all" else None,
                                   detail=detail)

    def _count(self, taken: list[Alert], decisions: list[Decision], ignored: list[Alert]) -> None:
        """Every alert counted; one log line per alert name (as the metric labels it), status and decision."""
        counts: Counter[tuple[str, str, str]] = Counter()
        for alert, decision in zip(taken, decisions, strict=True):
            counts[(self.metrics.alert_label(decision.alertname), alert.status, decision.action)] += 1
        for alert in ignored:
            counts[(self.metrics.alert_label(alert.labels.get("alertname", "unnamed")), alert.status, "ignored")] += 1
        for (name, status, action), count in counts.items():
            self.metrics.alert(name, status, action, count)
            log.log(logging.WARNING if action == "ignored" else logging.INFO, "alert webhook: %d x %s (%s): %s%s",
                    count, name, status, action,
                    f" (over maintenance.alert_max_per_payload={self.max_per_payload})" if action == "ignored" else "")

    def _forget_old(self, now: float) -> None:
        for identity, at in list(self._acted.items()):
            if now - at > DEDUPE_TTL_SECONDS:
                del self._acted[identity]

"""The monitoring bundle: every file Prometheus and Alertmanager read, rendered into one folder.

`appliance up` renders it under the state dir for its local Prometheus and Alertmanager; compose renders it
into a shared volume with `appliance monitoring-config` (an init container) before those containers start.
Same templates, same renderer: the two deployments cannot drift apart. Each file is written whole (temporary
file, then rename), so a reader never sees half a configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.files import atomic_write_text
from appliance.monitoring.alertmanager import render_alertmanager_config
from appliance.monitoring.config import load_config
from appliance.monitoring.prometheus import RULE_FILES, render_prometheus_config
from appliance.monitoring.settings import MonitoringSettings


@dataclass(frozen=True)
class Bundle:
    """Where the rendered files are."""

    root: Path

    @property
    def prometheus_config(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def alertmanager_config(self) -> Path:
        return self.root / "alertmanager.yml"

    @property
    def rules_dir(self) -> Path:
        return self.root / "rules"


@dataclass(frozen=True)
class BundleTokens:
    """The gateway's bearer tokens the bundle carries, chosen by whoever reads the gateway's settings
    (appliance.composition.monitoring): this package reads its own section only."""

    sd: str | None = None  # what Prometheus' HTTP SD sends to /sd/targets; None: /sd/targets is open
    metrics: str | None = None  # what Prometheus sends when it scrapes /metrics; None: /metrics is open
    alerts: str | None = None  # what Alertmanager's webhook sends to /admin/alerts; None: that receiver is dropped


def write_bundle(out: Path, assets: Path, monitoring: MonitoringSettings, tokens: BundleTokens, *, gateway: str,
                 alertmanager: str | None, prometheus: str, env: Mapping[str, str] | None = None,
                 shared: bool = False, owner: tuple[int, int] | None = None) -> Bundle:
    """Render Prometheus' and Alertmanager's configuration and copy the rules into ``out``, from the templates and
    rules in ``assets``/alerts.

    ``env`` fills the Alertmanager template's webhook URLs; the appliance's own webhook defaults to the gateway's
    /admin/alerts with the alerts token (else the admin token). ``shared``: files readable by other users (compose
    containers run as other users; put the folder where only they can reach it); otherwise the files holding a
    secret are private to this user: the Alertmanager config (its webhook token) and, when it holds a token, the
    Prometheus config (the metrics token, or the /sd/targets token with API keys). ``owner`` (uid, gid): every
    file is handed to that user, the files holding a secret stay 0600: how compose's init container
    (root) gives them to the Prometheus and Alertmanager containers' user without making them world-readable.
    """
    alerts = assets / "alerts"
    values = dict(os.environ if env is None else env)
    values.setdefault("APPLIANCE_ALERTS_WEBHOOK_URL", f"http://{gateway}/admin/alerts")
    for name in ("APPLIANCE_ADMIN_TOKEN", "APPLIANCE_ALERTS_TOKEN"):  # from the settings only: files included
        values.pop(name, None)
    if tokens.alerts is not None:
        values["APPLIANCE_ALERTS_TOKEN"] = tokens.alerts
    bundle = Bundle(out)
    bundle.rules_dir.mkdir(parents=True, exist_ok=True)
    for name in RULE_FILES:
        text = (alerts / name).read_text()
        if monitoring.public_url:
            text = with_public_url(text, alerts, monitoring.public_url)
        atomic_write_text(bundle.rules_dir / name, text, mode=0o644)
    token = tokens.sd
    atomic_write_text(bundle.prometheus_config, render_prometheus_config(
        gateway=gateway, alertmanager=alertmanager, prometheus=prometheus,
        scrape_interval_seconds=monitoring.scrape_interval_seconds, sd_bearer_token=token,
        metrics_bearer_token=tokens.metrics),
        mode=0o644 if shared or token is None else 0o600)
    alertmanager_text = render_alertmanager_config((alerts / "alertmanager.yml").read_text(), values)
    atomic_write_text(bundle.alertmanager_config, alertmanager_text, mode=0o644 if shared else 0o600)
    if owner is not None:  # files only: the folders stay the writer's, so that the next render can replace them
        for path in (*bundle.rules_dir.iterdir(), bundle.prometheus_config, bundle.alertmanager_config):
            os.chown(path, *owner)
    return bundle



def with_public_url(rules: str, alerts: Path, public_url: str) -> str:
    """A rule file's text with every runbook_url annotation at ``public_url`` instead of the generated default
    (alerts/config.yaml's ``appliance_url``): the one URL pattern, filled with the site's URL of its gateway."""
    config = load_config(alerts / "config.yaml")
    marker = "{alertname}"
    default_prefix = config.runbook(marker).split(marker)[0]
    public_prefix = config.runbook(marker, appliance_url=public_url).split(marker)[0]
    return rules.replace(f"runbook_url: {default_prefix}", f"runbook_url: {public_prefix}")

"""The monitoring stack as the settings describe it: the bundle Prometheus and Alertmanager read (the monitoring
section, plus the gateway's address and tokens), and ``appliance up``'s local Prometheus and Alertmanager (plus
the state folder). See ``appliance.composition`` for why this is not in ``appliance.monitoring``.

Light on purpose: ``appliance monitoring-config`` runs it in compose's init container, which has no engine stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from appliance.gateway.settings import GatewaySettings
from appliance.monitoring import bundle as monitoring_bundle
from appliance.monitoring.bundle import Bundle, BundleTokens
from appliance.monitoring.local import LocalMonitoring
from appliance.paths import REPO_ROOT
from appliance.settings import ConfigError, Settings


def assets_dir(settings: Settings) -> Path:
    """The folder holding alerts/ and dashboards/: configured, or the source tree this package runs from."""
    root = settings.monitoring.assets_dir or REPO_ROOT
    if not (root / "alerts" / "alertmanager.yml").is_file():
        raise ConfigError(f"monitoring.assets_dir: {root} holds no alerts/alertmanager.yml "
                          "(set APPLIANCE_MONITORING__ASSETS_DIR to the folder with alerts/ and dashboards/)")
    return root


def sd_bearer_token(settings: Settings) -> str | None:
    """The token Prometheus' HTTP SD sends to the gateway's /sd/targets: the read-only metrics token when set;
    else, when API keys close /sd/targets, the admin token, or (no admin token) the first API key; None when
    /sd/targets is open."""
    if settings.gateway.metrics_token:
        return settings.gateway.metrics_token
    if not settings.all_api_keys:
        return None
    return settings.gateway.admin_token or settings.all_api_keys[0]


def metrics_bearer_token(settings: Settings) -> str | None:
    """The token Prometheus sends when it scrapes the gateway's /metrics: the metrics token when set; else, when
    API keys close /metrics (it names the tenants and their usage), the admin token; None when /metrics is open.
    With API keys and neither token, /metrics is closed to everyone: set gateway.metrics_token."""
    if settings.gateway.metrics_token:
        return settings.gateway.metrics_token
    return settings.gateway.admin_token if settings.all_api_keys else None


def alerts_bearer_token(settings: Settings) -> str | None:
    """The token Alertmanager's webhook sends to /admin/alerts: the alerts token, which opens that route only;
    else the admin token; None: the appliance's receiver is dropped (the route would answer 403)."""
    return settings.gateway.alerts_token or settings.gateway.admin_token


def bundle_tokens(settings: Settings) -> BundleTokens:
    """The gateway's tokens as Prometheus and Alertmanager send them."""
    return BundleTokens(sd=sd_bearer_token(settings), metrics=metrics_bearer_token(settings),
                        alerts=alerts_bearer_token(settings))


def write_bundle(out: Path, settings: Settings, *, gateway: str, alertmanager: str | None, prometheus: str,
                 env: Mapping[str, str] | None = None, shared: bool = False,
                 owner: tuple[int, int] | None = None) -> Bundle:
    """``appliance.monitoring.bundle.write_bundle`` for these settings (its docstring says what each argument
    does): their assets folder, monitoring section and the gateway's tokens."""
    return monitoring_bundle.write_bundle(out, assets_dir(settings), settings.monitoring, bundle_tokens(settings),
                                          gateway=gateway, alertmanager=alertmanager, prometheus=prometheus,
                                          env=env, shared=shared, owner=owner)


def local_monitoring(settings: Settings) -> LocalMonitoring:
    """``appliance up``'s Prometheus and Alertmanager, scraping the gateway these settings run."""
    gateway = local_gateway_address(settings.gateway)

    def write(out: Path, alertmanager: str | None, prometheus: str) -> Bundle:
        return write_bundle(out, settings, gateway=gateway, alertmanager=alertmanager, prometheus=prometheus)

    return LocalMonitoring(settings.monitoring, settings.state_dir, write)


def local_gateway_address(gateway: GatewaySettings) -> str:
    """Where a Prometheus on this host reaches the gateway: loopback for a wildcard bind."""
    host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::", "") else gateway.host
    return f"{host}:{gateway.port}"

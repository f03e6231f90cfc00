"""The Alertmanager template: rendered from the environment, valid, routed and inhibited as documented."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from appliance.monitoring.alertmanager import TemplateError, render_alertmanager_config

from .conftest import ALERTS

TEMPLATE = (ALERTS / "alertmanager.yml").read_text()
FULL_ENV = {
    "APPLIANCE_PAGER_WEBHOOK_URL": "http://pager.example:9000/hook",
    "APPLIANCE_TICKET_WEBHOOK_URL": "http://tickets.example:9000/hook",
    "APPLIANCE_WATCHDOG_WEBHOOK_URL": "http://deadman.example:9000/ping",
    "APPLIANCE_ALERTS_WEBHOOK_URL": "http://127.0.0.1:8000/admin/alerts",
    "APPLIANCE_ALERTS_TOKEN": "s3cret",
}


def receivers(text: str) -> dict[str, dict]:
    return {receiver["name"]: receiver for receiver in yaml.safe_load(text)["receivers"]}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("am") / "alertmanager.yml"
    path.write_text(render_alertmanager_config(TEMPLATE, FULL_ENV))
    return path


def test_render_fills_every_receiver() -> None:
    got = receivers(render_alertmanager_config(TEMPLATE, FULL_ENV))
    assert got["pager"]["webhook_configs"][0]["url"] == FULL_ENV["APPLIANCE_PAGER_WEBHOOK_URL"]
    assert got["ticket"]["webhook_configs"][0]["url"] == FULL_ENV["APPLIANCE_TICKET_WEBHOOK_URL"]
    assert got["watchdog"]["webhook_configs"][0]["url"] == FULL_ENV["APPLIANCE_WATCHDOG_WEBHOOK_URL"]
    own = got["appliance"]["webhook_configs"][0]
    assert own["url"] == FULL_ENV["APPLIANCE_ALERTS_WEBHOOK_URL"]
    assert own["http_config"]["authorization"] == {"type": "Bearer", "credentials": "s3cret"}


def test_unset_urls_make_null_receivers() -> None:
    got = receivers(render_alertmanager_config(TEMPLATE, {}))
    assert set(got) == {"appliance", "pager", "ticket", "watchdog"}
    assert all("webhook_configs" not in receiver for receiver in got.values())
    partial = receivers(render_alertmanager_config(TEMPLATE, {"APPLIANCE_PAGER_WEBHOOK_URL": "http://p/h",
                                                              "APPLIANCE_TICKET_WEBHOOK_URL": ""}))
    assert "webhook_configs" in partial["pager"] and "webhook_configs" not in partial["ticket"]


def test_appliance_receiver_without_token_is_null(caplog: pytest.LogCaptureFixture) -> None:
    """/admin answers 403 without a token: posting there would only fill Alertmanager's logs with failures."""
    text = render_alertmanager_config(TEMPLATE, {"APPLIANCE_ALERTS_WEBHOOK_URL": "http://127.0.0.1:8000/admin/alerts"})
    assert "webhook_configs" not in receivers(text)["appliance"]
    assert "APPLIANCE_ALERTS_TOKEN unset" in caplog.text


def test_secrets_cannot_break_the_yaml() -> None:
    token = 'x"\n  evil: [1'
    got = receivers(render_alertmanager_config(TEMPLATE, {**FULL_ENV, "APPLIANCE_ALERTS_TOKEN": token}))
    assert got["appliance"]["webhook_configs"][0]["http_config"]["authorization"]["credentials"] == token


def test_unknown_placeholder_is_an_error() -> None:
    with pytest.raises(TemplateError, match="APPLIANCE_NOPE"):
        render_alertmanager_config(TEMPLATE + "\ntemplates: ['${APPLIANCE_NOPE}']\n", FULL_ENV)


@pytest.mark.parametrize("env", [FULL_ENV, {}], ids=["configured", "null-receivers"])
def test_amtool_check_config(amtool: str, tmp_path: Path, env: dict) -> None:
    path = tmp_path / "alertmanager.yml"
    path.write_text(render_alertmanager_config(TEMPLATE, env))
    result = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def expected_receivers(labels: dict) -> str:
    if labels.get("alertname") == "Watchdog":
        return "appliance,watchdog"
    return {"critical": "appliance,pager", "warning": "appliance,ticket"}[labels["severity"]]


def test_routes_every_alert(amtool: str, rendered: Path, alert_rules: list[dict]) -> None:
    """critical -> pager, warning -> ticket, Watchdog -> watchdog, and every alert also reaches the appliance."""
    for rule in alert_rules:
        labels = {"alertname": rule["alert"], **rule["labels"], "replica": "replica-0"}
        expected = expected_receivers(labels)
        result = subprocess.run([amtool, "config", "routes", "test", f"--config.file={rendered}",
                                 f"--verify.receivers={expected}", *(f"{k}={v}" for k, v in labels.items())],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{rule['alert']}: {result.stdout}{result.stderr}"


def test_unknown_alerts_still_reach_someone(amtool: str, rendered: Path) -> None:
    result = subprocess.run([amtool, "config", "routes", "test", f"--config.file={rendered}",
                             "--verify.receivers=appliance,ticket", "alertname=SomethingNew"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_symptom_pages_inhibit_cause_tickets_but_not_auto_remediated_alerts() -> None:
    rules = yaml.safe_load(render_alertmanager_config(TEMPLATE, {}))["inhibit_rules"]
    causes = [rule for rule in rules if 'severity="critical"' in rule["source_matchers"]
              and 'severity="warning"' in rule["target_matchers"]]
    assert causes, "no rule lets a page inhibit tickets"
    assert 'remediation!="auto"' in causes[0]["target_matchers"]
    assert all(rule["equal"] == ["cluster"] for rule in rules)


def test_watchdog_repeats_often() -> None:
    routes = yaml.safe_load(TEMPLATE)["route"]["routes"]
    watchdog = next(route for route in routes if route["receiver"] == "watchdog")
    assert watchdog["repeat_interval"] in ("1m", "5m")
    assert routes[0]["receiver"] == "appliance" and routes[0]["continue"] is True

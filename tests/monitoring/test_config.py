"""alerts/config.yaml: one typed loader, clear errors for a bad file, and the places that must agree with it (the
gateway's histogram buckets, the settings' SLO default, Prometheus' scrape jobs, Alertmanager's inhibit rules)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

from appliance.gateway.observation.metrics import LATENCY_BUCKETS, RequestMetrics
from appliance.monitoring import config as config_module
from appliance.monitoring import dashboards, rules
from appliance.monitoring.alertmanager import render_alertmanager_config
from appliance.monitoring.config import (
    CONFIG_PATH,
    MonitoringConfig,
    MonitoringConfigError,
    load_config,
    parse_config,
)
from appliance.monitoring.prometheus import prometheus_config
from appliance.settings import Settings

from .conftest import ALERTS


@pytest.fixture()
def raw() -> dict[str, Any]:
    return yaml.safe_load(CONFIG_PATH.read_text())


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_file_loads_into_typed_frozen_objects(raw: dict[str, Any]) -> None:
    config = load_config()
    assert isinstance(config, MonitoringConfig)
    assert config.slos.ttft.threshold_seconds == raw["slos"]["ttft"]["threshold_seconds"]
    assert config.selectors.appliance == raw["selectors"]["appliance"]
    assert config.alerts.ApplianceQueueBacklog.threshold == raw["alerts"]["ApplianceQueueBacklog"]["threshold"]
    assert config.alerts.ApplianceReplicaNotReady.for_ == raw["alerts"]["ApplianceReplicaNotReady"]["for"]
    assert [b.factor for b in config.burn_rates] == [b["factor"] for b in raw["burn_rates"]]
    assert config.page_burn == max(b["factor"] for b in raw["burn_rates"])
    with pytest.raises(pydantic.ValidationError):
        config.slos.ttft.threshold_seconds = 2.0  # type: ignore[misc]


def test_numbers_keep_the_type_they_are_written_in() -> None:
    """16 stays 16 (not 16.0) in the rendered PromQL, so the rules read like the file."""
    config = load_config()
    assert isinstance(config.alerts.ApplianceQueueBacklog.threshold, int)
    assert isinstance(config.alerts.ApplianceKVCacheNearFull.threshold, float)


def test_a_missing_file_is_an_error_not_the_defaults(tmp_path: Path) -> None:
    with pytest.raises(MonitoringConfigError, match=r"nowhere\.yaml does not exist"):
        load_config(tmp_path / "nowhere.yaml")


def test_a_file_that_is_not_yaml_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("slos: [unclosed\n")
    with pytest.raises(MonitoringConfigError, match="is not valid YAML"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(MonitoringConfigError, match="must be a mapping"):
        load_config(path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["alerts"]["ApplianceKVCacheNearFull"].pop("threshold"),
     r"alerts\.ApplianceKVCacheNearFull\.threshold"),
    (lambda c: c["alerts"]["ApplianceQueueBacklog"].update(treshold=3), r"alerts\.ApplianceQueueBacklog\.treshold"),
    (lambda c: c["alerts"].pop("ApplianceDown"), r"alerts\.ApplianceDown: Field required"),
    (lambda c: c["slos"]["ttft"].update(objective=1.5), r"slos\.ttft\.objective"),
    (lambda c: c["alerts"]["ApplianceDrainStuck"].update({"for": "30 minutes"}), r"ApplianceDrainStuck\.for"),
    (lambda c: c["burn_rates"][0].update(severity="page"), r"burn_rates\.0\.severity"),
    (lambda c: c.update(sli_windows=["5m"]), r"not in sli_windows"),
    (lambda c: c.update(runbook_url="https://example.com/runbooks"), r"runbook_url must contain \{alertname\}"),
    (lambda c: c.update(auto_remediated=["ApplianceNoSuchAlert"]), r"unknown alerts: \['ApplianceNoSuchAlert'\]"),
    (lambda c: c.pop("selectors"), r"selectors: Field required"),
])
def test_an_invalid_file_names_the_key(tmp_path: Path, raw: dict[str, Any], change: Any, message: str) -> None:
    broken = copy.deepcopy(raw)
    change(broken)
    path = write(tmp_path, broken)
    with pytest.raises(MonitoringConfigError, match=message) as error:
        load_config(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("main", [rules.main, dashboards.main])
def test_generators_refuse_a_bad_config_in_one_line(tmp_path: Path, raw: dict[str, Any], main: Any,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    del raw["slos"]["ttft"]["threshold_seconds"]
    path = write(tmp_path, raw)
    out = tmp_path / "out"
    flag = "--out" if main is rules.main else "--dir"
    assert main(["--write", "--config", str(path), flag, str(out)]) == 2
    err = capsys.readouterr().err
    assert "slos.ttft.threshold_seconds: Field required" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_derived_config_renders_the_same_as_the_file(raw: dict[str, Any]) -> None:
    """The typed config's plain mapping (for variants, as the live tests build) round-trips exactly."""
    assert rules.render(load_config().model_dump(by_alias=True)) == rules.render(load_config())
    assert parse_config(load_config().model_dump(by_alias=True)) == load_config()


# --- what must agree with the file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("settings_slo", [Settings().gateway.slo_ttft_p95_seconds, 0.65])
def test_configured_slo_thresholds_are_bucket_bounds_of_the_gateway(settings_slo: float) -> None:
    """The burn-rate SLI reads le="<threshold>": the gateway's histogram has that bucket whatever the appliance's
    own slo_ttft_p95_seconds is, because the threshold is one of its fixed LATENCY_BUCKETS."""
    threshold = load_config().slos.ttft.threshold_seconds
    assert float(threshold) in LATENCY_BUCKETS
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, slo_ttft_seconds=settings_slo)
    metrics.ttft.labels("chat").observe(0.1)
    exposed = generate_latest(registry).decode()
    assert f'appliance_request_ttft_seconds_bucket{{le="{floatToGoString(threshold)}",route="chat"}}' in exposed


def test_a_threshold_between_buckets_is_refused(raw: dict[str, Any]) -> None:
    raw["slos"]["ttft"]["threshold_seconds"] = 0.65
    with pytest.raises(MonitoringConfigError, match="not a bucket bound"):
        rules.render(raw)


def test_the_settings_default_slo_is_the_configured_threshold() -> None:
    """Admission control aims at slo_ttft_p95_seconds; by default that is the SLO the alerts page on."""
    assert Settings().gateway.slo_ttft_p95_seconds == load_config().slos.ttft.threshold_seconds


def test_the_settings_slo_follows_the_config_file_one_way(raw: dict[str, Any], tmp_path, monkeypatch) -> None:
    """One owner: a changed threshold in alerts/config.yaml moves admission's target with it (it used to be a
    second 0.8 in settings.py, kept equal by the test above); an explicit setting still wins."""
    raw["slos"]["ttft"]["threshold_seconds"] = 1.0
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(config_module, "CONFIG_PATH", path)
    assert Settings().gateway.slo_ttft_p95_seconds == 1.0
    assert Settings(slo_ttft_p95_seconds=0.65).gateway.slo_ttft_p95_seconds == 0.65
    path.write_text("slos: [")
    with pytest.raises(MonitoringConfigError, match="not valid YAML"):
        Settings()


def test_the_selectors_name_the_scrape_jobs_prometheus_runs() -> None:
    jobs = {job["job_name"] for job in prometheus_config(gateway="gw:8000", alertmanager=None,
                                                         scrape_interval_seconds=15)["scrape_configs"]}
    selectors = load_config().selectors
    for selector in (selectors.appliance, selectors.vllm):
        [job] = re.findall(r'\bjob="([^"]+)"', selector)
        assert job in jobs, (selector, jobs)


def test_alertmanager_inhibits_on_the_configured_labels() -> None:
    rendered = yaml.safe_load(render_alertmanager_config((ALERTS / "alertmanager.yml").read_text(), {}))
    assert rendered["inhibit_rules"]
    for rule in rendered["inhibit_rules"]:
        assert rule["equal"] == list(load_config().inhibit_equal)


def test_the_settings_slo_follows_the_assets_the_appliance_serves(raw: dict[str, Any], tmp_path, monkeypatch) -> None:
    """The images install the package apart from its assets (monitoring.assets_dir=/opt/appliance): the default
    comes from the config there, not from beside the installed package (where there is none: the compose stack's
    monitoring-config exited 2 on it)."""
    raw["slos"]["ttft"]["threshold_seconds"] = 1.0
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / "config.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(config_module, "CONFIG_PATH", tmp_path / "not-installed" / "config.yaml")
    assert Settings(monitoring={"assets_dir": tmp_path}).gateway.slo_ttft_p95_seconds == 1.0
    monkeypatch.setenv("APPLIANCE_MONITORING__ASSETS_DIR", str(tmp_path))
    assert Settings().gateway.slo_ttft_p95_seconds == 1.0
    assert Settings(slo_ttft_p95_seconds=0.65).gateway.slo_ttft_p95_seconds == 0.65

"""The rendered Prometheus configuration is valid for a real promtool and scrapes what the appliance exposes."""

from __future__ import annotations

import subprocess

import yaml

from appliance.composition.monitoring import write_bundle
from appliance.monitoring.prometheus import prometheus_config
from appliance.settings import Settings
from tests.tools import require_tool


def test_scrapes_the_gateway_and_discovers_engines_through_it() -> None:
    config = prometheus_config(gateway="appliance:8000", alertmanager="alertmanager:9093", scrape_interval_seconds=15)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["appliance"]["static_configs"] == [{"targets": ["appliance:8000"]}]
    assert jobs["vllm"]["http_sd_configs"][0]["url"] == "http://appliance:8000/sd/targets"
    assert config["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    assert config["rule_files"] == ["rules/recording.rules.yaml", "rules/alerts.rules.yaml"]
    assert config["global"]["scrape_timeout"] == "10s"


def test_without_alertmanager_there_is_no_alerting_section() -> None:
    config = prometheus_config(gateway="127.0.0.1:8000", alertmanager=None, scrape_interval_seconds=5)
    assert "alerting" not in config
    assert config["global"]["scrape_timeout"] == "4s"  # below the interval, so scrapes never overlap


def test_promtool_accepts_the_rendered_config_and_its_rules(tmp_path) -> None:
    promtool = require_tool("promtool", "prometheus")
    bundle = write_bundle(tmp_path, Settings(admin_token="t"), gateway="127.0.0.1:8000",
                          alertmanager="127.0.0.1:9093", prometheus="127.0.0.1:9090", env={})
    result = subprocess.run([promtool, "check", "config", str(bundle.prometheus_config)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert yaml.safe_load(bundle.prometheus_config.read_text())["scrape_configs"][0]["job_name"] == "appliance"


def test_engine_discovery_sends_a_bearer_token_when_given() -> None:
    config = prometheus_config(gateway="appliance:8000", alertmanager=None, scrape_interval_seconds=15,
                               sd_bearer_token="admin")
    sd = {job["job_name"]: job for job in config["scrape_configs"]}["vllm"]["http_sd_configs"][0]
    assert sd["authorization"] == {"type": "Bearer", "credentials": "admin"}
    plain = prometheus_config(gateway="appliance:8000", alertmanager=None, scrape_interval_seconds=15)
    assert "authorization" not in plain["scrape_configs"][1]["http_sd_configs"][0]

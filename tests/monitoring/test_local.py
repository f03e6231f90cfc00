"""`appliance up`'s local Prometheus and Alertmanager: real binaries when installed, a clean skip when not."""

from __future__ import annotations

import logging
import time

import httpx

from appliance.composition.monitoring import local_monitoring
from appliance.settings import Settings
from tests.integration.harness import free_port_range
from tests.tools import require_tool


def _settings(tmp_path, **monitoring) -> Settings:
    base = free_port_range(2)
    return Settings(state_dir=tmp_path, admin_token="t",
                    monitoring={"prometheus_port": base, "alertmanager_port": base + 1, **monitoring})


def _alertmanagers(prometheus: str) -> list[str]:
    data = httpx.get(f"{prometheus}/api/v1/alertmanagers", timeout=5).json()["data"]
    return [a["url"] for a in data["activeAlertmanagers"]]


def test_without_prometheus_it_plans_nothing_and_says_why(tmp_path, caplog) -> None:
    settings = _settings(tmp_path, prometheus_binary="no-such-prometheus")
    with caplog.at_level(logging.WARNING):
        assert local_monitoring(settings).plan() == []
    assert "apt-get install prometheus" in caplog.text


def test_real_prometheus_and_alertmanager_start_load_the_rules_and_stop(tmp_path) -> None:
    require_tool("prometheus", "prometheus")
    require_tool("prometheus-alertmanager", "prometheus-alertmanager")
    monitoring = local_monitoring(_settings(tmp_path))
    try:
        ready = monitoring.start(ready_timeout=30)
        assert [s.name for s in ready] == ["prometheus", "alertmanager"]
        prometheus, alertmanager = ready
        groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert any(r["type"] == "alerting" for r in rules) and any(r["type"] == "recording" for r in rules)
        deadline = time.monotonic() + 15  # Prometheus discovers its Alertmanagers shortly after it is ready
        while not (am := _alertmanagers(prometheus.url)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert am == [f"{alertmanager.url}/api/v2/alerts"]
        status = httpx.get(f"{alertmanager.url}/api/v2/status", timeout=5).json()
        assert "receivers" in status["config"]["original"]
        # Issue 21: no lifecycle API, so no local user can stop or reload the appliance's Prometheus over HTTP.
        for action in ("quit", "reload"):
            refused = httpx.post(f"{prometheus.url}/-/{action}", timeout=5)
            assert refused.status_code == 403 and "Lifecycle API is not enabled" in refused.text
        time.sleep(0.5)
        assert prometheus.proc.poll() is None
        assert httpx.get(f"{prometheus.url}/-/ready", timeout=5).status_code == 200
    finally:
        monitoring.stop()
    assert all(s.proc.returncode == 0 for s in monitoring.services), [s.proc.returncode for s in monitoring.services]

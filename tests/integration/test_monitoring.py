"""The monitoring stack against the real appliance: real Prometheus scrapes the gateway and discovers every
engine, every rule evaluates without error on live data, alerts flow through a real Alertmanager back to the
appliance's webhook, and the dashboards' queries return data.

Prometheus and Alertmanager are the ones `appliance up` started for the shared appliance (tests/integration/
conftest.py), scraping every second so the test does not wait for production intervals. Alertmanager keeps its
production group waits (10 s for the appliance's own receiver).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.monitoring.snapshot import SnapshotRequest, snapshot
from tests.tools import require_tool

pytestmark = pytest.mark.engine
T = TypeVar("T")


@dataclass
class Stack:
    prometheus: str
    alertmanager: str
    gateway: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert response["status"] == "success", response
        return response["data"]["result"]


def eventually(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)
    pytest.fail(f"not within {timeout:.0f}s: {what}")


@pytest.fixture(scope="module")
def stack(appliance) -> Stack:
    """The Prometheus and Alertmanager that `appliance up` started next to the shared appliance."""
    require_tool("prometheus", "prometheus")
    require_tool("prometheus-alertmanager", "prometheus-alertmanager")
    urls = [f"http://127.0.0.1:{appliance.env[f'APPLIANCE_MONITORING__{name}_PORT']}"
            for name in ("PROMETHEUS", "ALERTMANAGER")]
    for url in urls:
        eventually(lambda url=url: _ready(url), 30, f"{url} ready")
    assert {p.name() for p in appliance.monitoring_processes()} == {"prometheus", "prometheus-alertmanager"}
    return Stack(urls[0], urls[1], appliance.url)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_prometheus_scrapes_the_gateway_and_discovers_every_engine(stack: Stack) -> None:
    def healthy() -> dict[str, list[dict]] | None:
        targets = httpx.get(f"{stack.prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        by_job: dict[str, list[dict]] = {}
        for target in targets:
            by_job.setdefault(target["labels"]["job"], []).append(target)
        up = all(t["health"] == "up" for t in targets)
        return by_job if up and len(by_job.get("appliance", [])) == 1 and len(by_job.get("vllm", [])) == 2 else None

    by_job = eventually(healthy, 30, "the gateway and both engines scraped and up")
    assert {t["labels"]["replica"] for t in by_job["vllm"]} == {"replica-0", "replica-1"}
    assert stack.query('vllm:num_requests_running{job="vllm"}')  # vLLM's own metrics, under their own names


def test_every_rule_evaluates_without_error_on_live_data(stack: Stack) -> None:
    for _ in range(6):  # traffic, so that rate() and histogram_quantile() have something to chew on
        body = {"model": "demo", "prompt": "The import system", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{stack.gateway}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            response.read()

    def evaluated() -> list[dict] | None:
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if all(r["health"] != "unknown" for r in rules) else None

    rules = eventually(evaluated, 30, "every rule evaluated at least once")
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken
    # The SLIs the paging alerts stand on exist as soon as requests flow.
    eventually(lambda: stack.query("job:appliance_requests:rate5m"), 20, "request-rate recording rule has data")
    eventually(lambda: stack.query("job:appliance_request_ttft_slow:ratio_rate5m"), 20, "TTFT SLI has data")
    assert stack.query('job:appliance_replicas_ready:sum')[0]["value"][1] == "2"


def test_a_firing_alert_reaches_alertmanager_and_the_appliance_webhook(stack: Stack) -> None:
    eventually(lambda: [a for a in httpx.get(f"{stack.alertmanager}/api/v2/alerts", timeout=5).json()
                        if a["labels"]["alertname"] == "Watchdog"], 30, "Watchdog active in Alertmanager")

    def recorded() -> float:
        text = httpx.get(f"{stack.gateway}/metrics", timeout=5).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "appliance_alert_webhook_alerts_total" and s.labels.get("alertname") == "Watchdog")

    eventually(recorded, 45, "the appliance's /admin/alerts received the Watchdog from Alertmanager")


def test_dashboard_queries_return_live_data(stack: Stack, tmp_path) -> None:
    out = tmp_path / "snapshot"
    document = snapshot(SnapshotRequest(prometheus=stack.prometheus, dashboard="appliance-overview", out=out,
                                        start="now-5m", end="now", step="2s", scrape_interval=1))
    status = {panel["title"]: panel["status"] for panel in document["panels"]}
    assert "error" not in status.values(), status  # the real Prometheus accepted every query
    assert status["Request rate"] == "ok", status
    assert (out / "index.html").is_file() and len(list((out / "panels").glob("*.png"))) == len(status)

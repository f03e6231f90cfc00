"""One real appliance (2 vLLM CPU replicas, INT8 demo model) shared by the integration tests.

Test files run in name order; test_serving.py ends with the drain test, which stops the shared appliance, so it
must stay the last user of the fixture (its name sorts last on purpose). test_rolling_restart.py comes late too:
its restarts and long queue waits leave the replicas' adaptive limits and ejections in a state the load
measurements of test_metrics.py should not start from.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import openai
import pytest
import yaml

from appliance.monitoring import rules
from appliance.monitoring.config import load_config
from tests.integration.harness import ApplianceProcess, free_port_range, serving
from tests.integration.harness import _ephemeral_low as ephemeral_low
from tests.integration.harness import _port_free as port_free

REPO = Path(__file__).resolve().parents[2]

ADMIN_TOKEN = "integration-admin"
SHARED_ENV = {
    "APPLIANCE_ADMIN_TOKEN": ADMIN_TOKEN,
    # An engine restarts in 23-35 s (eager, harness.py) and in minutes on a busy host: requests that find no
    # routable replica during a planned restart (test_rolling_restart.py) wait in the gateway queue that long
    # instead of getting a 429. No other test queues for long: their concurrency stays under the limits.
    "APPLIANCE_ADMISSION__QUEUE_TIMEOUT_SECONDS": "300",
    # The production 300 s for an engine to start (and for a restarted replica to be back) is too little here:
    # under test_rolling_restart.py's steady load while the compose images build in the background (scripts/test),
    # a CI run saw a restarting engine still not ready after 300 s. These bound a hang, not a speed.
    "APPLIANCE_ENGINE__START_TIMEOUT_SECONDS": "600",
    "APPLIANCE_MAINTENANCE__RESTART_READY_TIMEOUT_SECONDS": "600",
    # A CI run saw 9 of 24 streams get 502 after connects to both engines timed out at the production 5 s, on a
    # starved 2-core host (the gateway's event loop late, by every other sign in its log): a bound, not a speed.
    "APPLIANCE_GATEWAY__UPSTREAM_CONNECT_TIMEOUT_SECONDS": "30",
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """On a failure, show what the appliance logged: CI keeps no other trace of the gateway and its engines."""
    report = yield
    app = getattr(item, "funcargs", {}).get("appliance")
    if report.failed and isinstance(app, ApplianceProcess):
        exit_code = app.proc.poll() if app.proc else None
        report.sections.append(("appliance log (tail)", f"gateway exit code: {exit_code}\n{app.log_tail(120)}"))
    return report


def live_assets(root: Path) -> Path:
    """alerts/ rendered by the same generator from alerts/config.yaml with one change, the `for:` of
    ApplianceReplicaNotReady cut from minutes to seconds, so that a killed engine's alert fires and resolves
    within one engine restart (test_monitoring.py); dashboards/ as committed."""
    config = load_config().model_dump(by_alias=True)
    config["alerts"]["ApplianceReplicaNotReady"]["for"] = "5s"
    (root / "alerts").mkdir()
    for name, text in rules.render(config).items():
        (root / "alerts" / name).write_text(text)
    # The config the rules were rendered from: the appliance reads its TTFT SLO from the assets it serves.
    (root / "alerts" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copy(REPO / "alerts" / "alertmanager.yml", root / "alerts")
    (root / "dashboards").symlink_to(REPO / "dashboards")
    return root


def monitoring_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`appliance up`'s local Prometheus and Alertmanager (when installed) on two free ports, scraping every second
    so that the tests need not wait for production intervals, and serving the live assets (live_assets)."""
    port = free_port_range(2)
    return {"APPLIANCE_MONITORING__PROMETHEUS_PORT": str(port),
            "APPLIANCE_MONITORING__ALERTMANAGER_PORT": str(port + 1),
            "APPLIANCE_MONITORING__SCRAPE_INTERVAL_SECONDS": "1",
            "APPLIANCE_MONITORING__ASSETS_DIR": str(live_assets(tmp_path_factory.mktemp("assets")))}


# The engines publish their KV-cache events and the gateway routes on them, falling back to its own model of the
# engines' caches per replica while an event index is not current (test_kv_events.py). For prompts that share
# nothing that routes exactly as the approximate mode did (every replica holds none of them).
KV_EVENTS_ENV = {"APPLIANCE_ENGINE__KV_EVENTS": "local",
                 "APPLIANCE_ENGINE__KV_EVENTS_PORT_OFFSET": "1000",
                 "APPLIANCE_ENGINE__KV_EVENTS_REPLAY_PORT_OFFSET": "2000",
                 "APPLIANCE_ROUTING__PREFIX_CACHE__MODE": "precise-with-fallback"}


def ports_with_kv_events(replicas: int, offsets: tuple[int, ...] = (1000, 2000)) -> int:
    """A base port whose engine ports, the gateway's just above them, and the engines' event ports (each port plus
    each offset) are free and below the kernel's ephemeral range: an engine whose event socket cannot bind does not
    start."""
    low = ephemeral_low() or 65536
    for _ in range(100):
        base = free_port_range(replicas + 1)
        ports = [base + i + offset for i in range(replicas) for offset in offsets]
        if max(ports) < low and all(port_free(port) for port in ports):
            return base
    raise RuntimeError("no free port range for engines with KV events")


@pytest.fixture(scope="session")
def appliance(demo_model_int8, tmp_path_factory):
    # `appliance up`, the README's command: the engines and the gateway, plus a local Prometheus and Alertmanager
    # (monitoring_env) for test_monitoring.py.
    env = {**SHARED_ENV, **monitoring_env(tmp_path_factory), **KV_EVENTS_ENV,
           # Scheduled maintenance on, so its metrics (next window) exist, but it never acts during the tests:
           # the window is a month away and the memory triggers cannot be reached.
           "APPLIANCE_MAINTENANCE__ENABLED": "true",
           "APPLIANCE_MAINTENANCE__WINDOW_CRON": "0 0 1 1 *",
           "APPLIANCE_MAINTENANCE__FRAGMENTATION_THRESHOLD": "1",
           "APPLIANCE_MAINTENANCE__MEMORY_GROWTH_THRESHOLD": "1000"}
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("appliance"), replicas=2,
                           env=env, command="up", base_port=ports_with_kv_events(2))
    with serving(app, stop_signal=signal.SIGKILL) as running:
        yield running


@pytest.fixture(scope="session")
def client(appliance):
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="unused", max_retries=0, timeout=60)

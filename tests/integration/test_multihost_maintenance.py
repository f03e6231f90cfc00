"""Scheduled maintenance beyond one host, simulated on one machine (the harness of test_multihost.py): two node
agents (role node, one real vLLM engine each) on distinct loopback addresses, both with maintenance enabled and
the same window, which opens during the test; one gateway (role gateway) finds them through a test DNS server and
grants the restart lease (``maintenance.coordinator_url``). Each node's only engine is restarted once in the
window, never both at once: readiness of both nodes, sampled every 0.2 s all along, never shows the fleet below
``min_ready_replicas`` (1) from the moment both were up. The gateway starts only once both engines are up and
the window is open: until then no node may restart (it cannot ask for the lease), and from then on every sample
sees the fleet at full strength before the first restart.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.engine.dns_server import TestDNSServer
from tests.integration.harness import ADMIN_TOKEN, INTERVAL, NAME, ApplianceProcess, free_port_range, wait_until

pytestmark = pytest.mark.engine

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
ADDRESSES = ("127.0.0.2", "127.0.0.3")


def window_opening_in(seconds: float) -> tuple[str, datetime]:
    """A daily cron window whose start is the first whole minute at least ``seconds`` from now (UTC)."""
    start = (datetime.now(UTC) + timedelta(seconds=seconds + 59)).replace(second=0, microsecond=0)
    return f"{start.minute} {start.hour} * * *", start


def routable(node: ApplianceProcess) -> int | None:
    """The node's own view of its engine: routable (ready, not draining, not hung) or not; None: no answer."""
    try:
        return httpx.get(f"{node.url}/health/ready", timeout=2).json()["routable_replicas"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def admin_status(process: ApplianceProcess) -> dict:
    return httpx.get(f"{process.url}/admin/status", headers=AUTH, timeout=5).json()


def test_node_restarts_in_one_window_never_overlap_nor_drop_below_min_ready(demo_model_int8, tmp_path):
    dns = TestDNSServer().start()
    engine_port = free_port_range(2)
    gateway_base = free_port_range(2)  # the gateway's port (base + 1) is known before it starts
    cron, window_start = window_opening_in(0)  # opens within a minute, while the engines load (25-60 s here)
    common = {"APPLIANCE_ADMIN_TOKEN": ADMIN_TOKEN, "APPLIANCE_DISCOVERY__INTERVAL_SECONDS": str(INTERVAL),
              "APPLIANCE_MAINTENANCE__MIN_READY_REPLICAS": "1", "APPLIANCE_ENGINE__START_TIMEOUT_SECONDS": "600"}
    gateway = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path / "gateway", replicas=1,
                               base_port=gateway_base, env={
                                   **common, "APPLIANCE_ROLE": "gateway",
                                   "APPLIANCE_ENGINE_BASE_PORT": str(engine_port), "APPLIANCE_DISCOVERY__NAME": NAME,
                                   "APPLIANCE_DISCOVERY__NAMESERVER": dns.address})
    gateway.port = gateway_base + 1

    def node(address: str, core: int) -> ApplianceProcess:
        env = {**common, "APPLIANCE_ROLE": "node", "APPLIANCE_HOST": address, "APPLIANCE_ENGINE_HOST": address,
               "APPLIANCE_MAINTENANCE__ENABLED": "true", "APPLIANCE_MAINTENANCE__WINDOW_CRON": cron,
               "APPLIANCE_MAINTENANCE__WINDOW_DURATION_SECONDS": "1200",
               "APPLIANCE_MAINTENANCE__CHECK_INTERVAL_SECONDS": "1",
               "APPLIANCE_MAINTENANCE__TRAFFIC_LOOKBACK_SECONDS": "5",
               "APPLIANCE_MAINTENANCE__MIN_READY_WAIT_SECONDS": "5",  # then the next check asks again
               "APPLIANCE_MAINTENANCE__RESTART_READY_TIMEOUT_SECONDS": "600",
               # only the window restarts here: no fragmentation or memory-growth trigger
               "APPLIANCE_MAINTENANCE__FRAGMENTATION_THRESHOLD": "1.0",
               "APPLIANCE_MAINTENANCE__MEMORY_GROWTH_THRESHOLD": "1000",
               "APPLIANCE_MAINTENANCE__COORDINATOR_URL": gateway.url,
               "APPLIANCE_MAINTENANCE__COORDINATOR_LEASE_SECONDS": "30"}
        return ApplianceProcess(model=demo_model_int8, state_dir=tmp_path / address, replicas=1, env=env,
                                host=address, base_port=engine_port, cores={core})

    started: list[ApplianceProcess] = []
    samples: list[tuple[float, int | None, int | None]] = []  # (monotonic, node 127.0.0.2, node 127.0.0.3)
    stop_sampling = threading.Event()
    nodes = [node(ADDRESSES[0], 0), node(ADDRESSES[1], 1)]

    def sample() -> None:
        while not stop_sampling.is_set():
            samples.append((time.monotonic(), *(routable(n) for n in nodes)))
            stop_sampling.wait(0.2)

    def alive() -> None:
        for process in started:
            assert process.proc.poll() is None, f"appliance exited:\n{process.log_tail()}"

    try:
        dns.set(NAME, list(ADDRESSES))
        for process in nodes:
            process.start()
            started.append(process)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        # Both engines up and the window open, with low traffic (none), and no coordinator yet: a node that
        # cannot ask for the restart lease does not restart.
        def both_up() -> bool:
            alive()
            return any(a == 1 and b == 1 for _, a, b in list(samples))

        wait_until(both_up, timeout=600, step=0.5)
        wait_until(lambda: datetime.now(UTC) > window_start + timedelta(seconds=8), timeout=120, step=0.5)
        before = [admin_status(n) for n in nodes]
        assert [s["replicas"][0]["restarts"] for s in before] == [0, 0]
        assert all(s["maintenance"]["in_window"] and s["maintenance"]["last_action"] is None for s in before)
        up_at = time.monotonic()

        gateway.start()  # the coordinator: from now on the nodes restart, one at a time
        started.append(gateway)

        def restarted(process: ApplianceProcess) -> bool:
            alive()
            status = admin_status(process)
            action = status["maintenance"]["last_action"] or {}
            return status["replicas"][0]["restarts"] >= 1 and action.get("action") == "rolling_restart" \
                and not status["maintenance"]["rolling_restart_in_progress"]

        wait_until(lambda: all(restarted(n) for n in nodes), timeout=900, step=1)
        wait_until(lambda: all(routable(n) == 1 for n in nodes), timeout=120)
        time.sleep(3)  # a few more checks in the same window: nothing more may restart
        stop_sampling.set()
        sampler.join(timeout=10)

        statuses = [admin_status(n) for n in nodes]
        lease = admin_status(gateway)["maintenance"]["restart_lease"]
        after = [s for s in samples if s[0] >= up_at]
        both = [(a, b) for _, a, b in after if a is not None and b is not None]
        fleet = [a + b for a, b in both]
        overlaps = sum(1 for a, b in both if a == 0 and b == 0)
        out = [[t for t, *views in after if views[i] == 0] for i in range(2)]
        spans = [(min(ts), max(ts)) if ts else (None, None) for ts in out]
        seconds_out = [round(b - a, 1) if a is not None else None for a, b in spans]
        print(f"\nmultihost maintenance: window {window_start:%H:%M} UTC, samples={len(after)} "
              f"restarts={[s['replicas'][0]['restarts'] for s in statuses]} "
              f"results={[s['maintenance']['last_action']['result'] for s in statuses]} overlaps={overlaps} "
              f"min_fleet_ready={min(fleet)} leases_granted={lease['granted']} "
              f"out_of_routing_s={seconds_out}")
        assert [s["replicas"][0]["restarts"] for s in statuses] == [1, 1]  # each once in this window
        assert [s["maintenance"]["last_action"]["result"] for s in statuses] == ["ok", "ok"]
        assert overlaps == 0 and min(fleet) >= 1
        assert all(out), "the samples saw each node out of routing during its restart"
        # one after the other: one node's time out of routing ends before the other's begins
        (a0, a1), (b0, b1) = spans
        assert a1 < b0 or b1 < a0, spans
        assert lease["granted"] == 2 and lease["holder"] is None
    finally:
        stop_sampling.set()
        ApplianceProcess.stop_all(started)
        dns.stop()

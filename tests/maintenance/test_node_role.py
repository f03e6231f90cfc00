"""Maintenance on a node pod (role node): traffic as its engines count it, readiness that drops a hung engine,
and no automatic restarts without a fleet-wide coordinator. Engines here are fake engines whose /metrics counters the
tests set (tests/fake_engine.py); the real thing runs in tests/integration/test_multihost_maintenance.py."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.cli import main
from appliance.context import context_of
from appliance.exit_codes import EXIT_USAGE
from appliance.maintenance.engine_traffic import EngineCounts, EngineTraffic, parse_counts
from appliance.settings import ConfigError, Settings, load_settings
from tests.fake_engine import FakeEngine
from tests.maintenance.support import fleet, judge_hung

NODE = {"role": "node", "admin_token": "t0ken", "collectors": {"enabled": False}}


@pytest.fixture
def engine():
    fake = FakeEngine().start()
    yield fake
    fake.stop()


def node_app(replicas, **maintenance) -> TestClient:
    settings = Settings(served_model_name="demo", **NODE, maintenance=maintenance)
    client = TestClient(create_app(settings, replicas=lambda: replicas, registry=CollectorRegistry()),
                        raise_server_exceptions=False)
    return client


def test_a_node_judges_traffic_by_its_engines_counters_not_its_own_gateway(engine):
    """Gateway pods call the engines directly: the node's own gateway counts nothing, yet the engines are busy.
    Before: the node's verdict came from its gateway counter (0 requests) and the restart started at peak."""
    replicas = fleet([engine.url])
    window_open = {"enabled": True, "window_cron": "* * * * *", "window_duration_seconds": 3600,
                   "check_interval_seconds": 3600, "traffic_lookback_seconds": 0.2, "max_request_rate": 0.5,
                   "coordinator_url": "http://127.0.0.1:9"}
    with node_app(replicas, **window_open) as client:
        scheduler = context_of(client.app).maintenance.scheduler
        client.portal.call(scheduler.check)
        engine.finished += 40  # other gateways' requests, straight to the engine
        engine.running = 2
        time.sleep(0.3)
        decision = client.portal.call(scheduler.check)
        assert decision.startswith("waiting: request rate"), decision
        assert scheduler.last_verdict.request_rate > 0.5
        assert context_of(client.app).gateway.metrics is not None
        assert all(r.status.restarts == 0 for r in replicas)
        # and once the engines are quiet over a whole look-back, the same node says low
        time.sleep(0.3)
        client.portal.call(scheduler.check)
        time.sleep(0.3)
        client.portal.call(scheduler.check)
        assert scheduler.last_verdict.low, scheduler.last_verdict


def test_engine_waiting_requests_are_the_nodes_queue(engine):
    replicas = fleet([engine.url])
    with node_app(replicas, check_interval_seconds=3600, traffic_lookback_seconds=0.2, max_request_rate=100,
                  max_queue=0) as client:
        scheduler = context_of(client.app).maintenance.scheduler
        engine.waiting = 3
        client.portal.call(scheduler.check)
        time.sleep(0.3)
        client.portal.call(scheduler.check)
        verdict = scheduler.traffic.verdict(time.monotonic())
        assert not verdict.low and verdict.max_queue == 3, verdict


@pytest.mark.parametrize("restarts", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_arrivals_survive_engine_restarts_and_unreadable_pages(seed, restarts):
    """Invariant: the arrivals counter never goes down; with no restart it counts every arrival exactly once
    however many readings are missed; restarts (counter resets) never make it count more than arrived."""
    import random

    rng = random.Random(seed)
    traffic = EngineTraffic(lambda: [])
    finished = running = waiting = 0
    truth = 0.0
    last = None
    traffic.record("e", EngineCounts())
    for _ in range(500):
        step = rng.choice(["arrive", "start", "finish", "skip"] + (["restart"] if restarts else []))
        if step == "arrive":
            waiting += 1
            truth += 1
        elif step == "start" and waiting:
            waiting, running = waiting - 1, running + 1
        elif step == "finish" and running:
            running, finished = running - 1, finished + 1
        elif step == "restart":
            finished = running = waiting = 0
        if step != "skip" and rng.random() < 0.8:  # some readings are missed
            traffic.record("e", EngineCounts(finished, running, waiting))
        assert last is None or traffic.requests_total() >= last
        last = traffic.requests_total()
    traffic.record("e", EngineCounts(finished, running, waiting))
    # Every arrival is counted once, except those that arrived and vanished in a restart between two readings.
    assert traffic.requests_total() <= truth
    if not restarts:
        assert traffic.requests_total() == truth


def test_parse_counts_sums_label_sets_and_ignores_the_rest():
    page = (b'# HELP vllm:request_success_total x\nvllm:request_success_total{finished_reason="stop"} 5.0\n'
            b'vllm:request_success_total{finished_reason="length"} 2.0\nvllm:num_requests_running{m="a"} 1.0\n'
            b'vllm:num_requests_waiting{m="a"} 4.0\nvllm:num_requests_waiting_bogus 9\nvllm:broken{a="b"} x\n')
    assert parse_counts(page) == EngineCounts(finished=7, running=1, waiting=4)


def test_node_readiness_fails_while_its_engine_is_hung(stubs):
    """Before: a node whose only engine was hung stayed ready, so gateway pods kept routing to it."""
    replicas = fleet([stubs[0].url])
    with node_app(replicas, check_interval_seconds=3600) as client:
        assert client.get("/health/ready").status_code == 200
        judge_hung(client, "replica-0")
        response = client.get("/health/ready")
        assert response.status_code == 503, response.json()
        assert response.json()["hung_replicas"] == ["replica-0"]
        assert response.json()["routable_replicas"] == 0


def test_a_hung_replica_of_two_leaves_the_node_ready(stubs):
    replicas = fleet([stubs[0].url, stubs[1].url])
    with node_app(replicas, check_interval_seconds=3600) as client:
        judge_hung(client, "replica-1")
        body = client.get("/health/ready").json()
        assert body["status"] == "ready" and body["routable_replicas"] == 1 and body["hung_replicas"] == ["replica-1"]


def test_role_all_readiness_is_unchanged_by_this(stubs, make_app):
    client, _, _ = make_app(1)
    assert "hung_replicas" not in client.get("/health/ready").json()


def test_role_node_with_maintenance_and_no_coordinator_is_refused(monkeypatch, tmp_path, capsys):
    with pytest.raises(ConfigError, match="maintenance.coordinator_url"):
        load_settings(role="node", maintenance={"enabled": True})
    load_settings(role="node", maintenance={"enabled": True, "coordinator_url": "http://gw:8000"})
    load_settings(role="node")  # not enabled: nothing to coordinate
    load_settings(maintenance={"enabled": True})  # one host
    # `appliance serve` refuses at start with exit 2 and says how to configure it
    for key in [k for k in __import__("os").environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("APPLIANCE_ROLE", "node")
    monkeypatch.setenv("APPLIANCE_MAINTENANCE__ENABLED", "true")
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    assert main(["serve"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "maintenance.coordinator_url" in err and "COORDINATOR_URL" in err


def test_a_nodes_restart_drains_what_its_engine_reports_not_only_its_own_requests(engine):
    """Gateway pods' requests never pass the node's router: before, the drain saw 0 in flight and restarted the
    engine under them at once."""
    replicas = fleet([engine.url])
    replicas[0].restart_seconds = 0.05
    engine.running = 2  # two requests from gateway pods on the engine
    with node_app(replicas, check_interval_seconds=3600, restart_ready_timeout_seconds=1) as client:
        # a drain long enough to see it wait; the restart is asked for by an operator
        procedure = context_of(client.app).maintenance.controller.procedure
        procedure.timeouts = procedure.timeouts.__class__(
            drain_seconds=60, ready_seconds=1, min_ready_wait_seconds=1, poll_seconds=0.05)
        assert client.post("/admin/replicas/replica-0/restart", headers={"authorization": "Bearer t0ken"}
                           ).status_code == 202
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert replicas[0].status.restarts == 0, "restarted while its engine still ran requests"
            time.sleep(0.1)
        assert [e[0] for e in replicas[0].events] == ["drain"]
        engine.running = 0  # they finished
        deadline = time.monotonic() + 10
        while replicas[0].status.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert replicas[0].status.restarts == 1

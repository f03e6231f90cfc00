"""Maintenance through the admin API over stub replicas: rolling restart (202, 409), single-replica planned
restart where requests wait instead of failing, status, actions counted."""

import threading
import time

from tests.maintenance.support import AUTH, actions, wait_idle


def test_rolling_restart_is_accepted_runs_in_the_background_and_refuses_a_second(make_app):
    client, replicas, registry = make_app()
    for replica in replicas:
        replica.restart_seconds = 0.3
    response = client.post("/admin/rolling-restart", headers=AUTH)
    assert response.status_code == 202
    assert response.json()["replicas"] == ["replica-0", "replica-1"]
    second = client.post("/admin/rolling-restart", headers=AUTH)
    assert second.status_code == 409 and second.json()["error"]["code"] == "maintenance_in_progress"
    status = wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 1]
    assert status["maintenance"]["last_action"]["action"] == "rolling_restart"
    assert status["maintenance"]["last_restart"] is not None
    assert actions(registry, "rolling_restart", "ok", trigger="admin") == 1
    assert client.post("/admin/rolling-restart").status_code == 401


def test_single_replica_requests_wait_for_the_planned_restart_and_succeed(make_app):
    client, replicas, registry = make_app(replica_count=1)
    replicas[0].restart_seconds = 1.0
    assert client.post("/admin/replicas/replica-0/restart", headers=AUTH).status_code == 202
    while replicas[0].routable:
        time.sleep(0.01)
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(client.post("/v1/completions",
                                                                        json={"prompt": "x"}).status_code))
    thread.start()
    thread.join(10)
    assert results == [200]
    wait_idle(client)
    assert actions(registry, "restart", "ok", trigger="admin") == 1


def test_drain_and_undrain_are_counted(make_app):
    client, _replicas, registry = make_app()
    client.post("/admin/replicas/replica-0/drain", headers=AUTH)
    client.post("/admin/replicas/replica-0/undrain", headers=AUTH)
    assert actions(registry, "drain", "ok", trigger="admin") == 1
    assert actions(registry, "undrain", "ok", trigger="admin") == 1


def test_status_and_metrics_show_maintenance(make_app):
    client, _replicas, registry = make_app(maintenance={"enabled": True, "window_cron": "0 3 * * *"})
    m = client.get("/admin/status", headers=AUTH).json()["maintenance"]
    assert m["enabled"] and m["next_window"].endswith("03:00:00+00:00")
    assert m["hung_replicas"] == [] and m["rolling_restart_in_progress"] is False
    assert registry.get_sample_value("appliance_maintenance_next_window_timestamp_seconds") == \
        m["next_window_timestamp"]
    assert registry.get_sample_value("appliance_replica_hung", {"replica": "replica-0"}) == 0
    assert "appliance_replica_hung" in client.get("/metrics").text


def test_format_status_shows_next_window_and_last_restart(make_app):
    from appliance.admin_client import format_status

    client, _replicas, _registry = make_app(maintenance={"enabled": True})
    client.post("/admin/rolling-restart", headers=AUTH)
    text = format_status(wait_idle(client))
    assert "next window 20" in text and "last restart 20" in text
    assert "last action: rolling_restart (admin) ok" in text


def test_status_shows_spawn_failures_and_their_last_error(make_app):
    from appliance.admin_client import format_status

    client, replicas, _registry = make_app()
    replicas[1].drain()
    replicas[1].status.spawn_failures = 3
    replicas[1].status.last_error = "spawn failed: FileNotFoundError: [Errno 2] No such file or directory: 'vllm'"
    status = client.get("/admin/status", headers=AUTH).json()
    assert status["replicas"][1]["spawn_failures"] == 3
    assert status["replicas"][1]["last_error"].startswith("spawn failed")
    text = format_status(status)
    assert "! replica-1: 3 failed spawn(s); last error: spawn failed: FileNotFoundError" in text
    assert "replica-0:" not in text


def test_status_lists_the_tenants_heaviest_first_with_what_they_hold(make_app):
    """`appliance status` answers "who is using the engines": tenants by tokens used, with in-flight and 429s."""
    from appliance.admin_client import format_status

    client, _replicas, _registry = make_app(tenants=[{"name": "batch", "api_keys": ["kb"]},
                                                     {"name": "chat", "api_keys": ["kc"], "requests_per_minute": 1}])
    for key, count in (("kb", 3), ("kc", 2)):
        for _ in range(count):
            client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 4},
                        headers={"Authorization": f"Bearer {key}"})
    status = client.get("/admin/status", headers=AUTH).json()
    rows = {row["tenant"]: row for row in status["tenants"]}
    # The stub reports no usage, so tokens tie and names decide; the order by tokens is accounting's own test.
    assert [row["tenant"] for row in status["tenants"]] == ["batch", "chat"]
    assert rows["batch"]["requests"] == 3 and rows["batch"]["rate_limited"] == 0
    assert rows["chat"]["requests"] == 2 and rows["chat"]["rate_limited"] == 1  # one a minute
    assert rows["batch"]["in_flight"] == 0 and rows["batch"]["queued"] == 0
    text = format_status(status)
    header = next(line for line in text.splitlines() if line.startswith("tenant"))
    assert "in-flight" in header and "429s" in header
    assert text.index("\nbatch ") < text.index("\nchat ")


def test_status_without_tenants_prints_no_tenant_table(make_app):
    from appliance.admin_client import format_status

    client, _replicas, _registry = make_app()
    status = client.get("/admin/status", headers=AUTH).json()
    assert [row["tenant"] for row in status["tenants"]] == ["default"]
    assert "in-flight  queued" not in format_status(status).split("\n", 1)[1]


def test_cli_restart_needs_a_replica_or_rolling(capsys):
    from appliance.cli import main

    assert main(["restart"]) == 2
    assert main(["restart", "replica-0", "--rolling"]) == 2
    assert "REPLICA or --rolling" in capsys.readouterr().err


def test_replicas_this_appliance_does_not_run_cannot_be_restarted():
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from appliance.app import create_app
    from appliance.settings import Settings
    from tests.doubles import FakeReplica

    external = [FakeReplica("external-0", "http://127.0.0.1:9")]  # no restart(): like ExternalReplica
    settings = Settings(admin_token="t0ken", collectors={"enabled": False})
    with TestClient(create_app(settings, replicas=lambda: external, registry=CollectorRegistry())) as client:
        for path in ("/admin/rolling-restart", "/admin/replicas/external-0/restart"):
            response = client.post(path, headers=AUTH)
            assert response.status_code == 409 and response.json()["error"]["code"] == "not_supervised"
        assert client.post("/admin/replicas/nope/restart", headers=AUTH).status_code == 404


def test_status_shows_the_kv_cache_dtype(make_app):
    from appliance.admin_client import format_status

    client, _replicas, _registry = make_app(engine={"kv_cache_dtype": "fp8"})
    status = client.get("/admin/status", headers=AUTH).json()
    assert status["kv_cache_dtype"] == "fp8"
    assert "kv-cache fp8" in format_status(status).splitlines()[0]


def test_undrain_is_refused_while_maintenance_restarts_that_replica(make_app):
    """Undrained mid-restart, it would take requests the restart then kills; it returns by itself when warmed."""
    client, replicas, _registry = make_app()
    replicas[0].restart_seconds = 0.5
    assert client.post("/admin/replicas/replica-0/restart", headers=AUTH).status_code == 202
    while replicas[0].routable:
        time.sleep(0.01)
    refused = client.post("/admin/replicas/replica-0/undrain", headers=AUTH)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "maintenance_in_progress"
    wait_idle(client)
    assert client.post("/admin/rolling-restart", headers=AUTH).status_code == 202
    while replicas[0].routable:
        time.sleep(0.01)
    assert client.post("/admin/replicas/replica-0/undrain", headers=AUTH).status_code == 409
    assert client.post("/admin/replicas/replica-1/undrain", headers=AUTH).status_code == 200  # not being restarted
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [2, 1] and all(r.routable for r in replicas)
    undrains = [e for e in replicas[0].events if e == ("undrain", "replica-0")]
    assert len(undrains) == 2  # only maintenance's own, after each warm-up

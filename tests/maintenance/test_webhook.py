"""POST /admin/alerts: a firing whitelisted alert triggers its action once; everything else is only recorded;
dry run, rate limit, bad payloads and missing tokens."""

import time

from tests.maintenance.conftest import AUTH


def alert(name: str, status: str = "firing", replica: str | None = "replica-0", fingerprint: str = "f1",
          starts: str = "2026-12-02T03:00:00Z") -> dict:
    labels = {"alertname": name, "severity": "critical"} | ({"replica": replica} if replica else {})
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": starts, "endsAt": "",
            "generatorURL": "", "fingerprint": fingerprint}


def payload(*alerts: dict) -> dict:
    return {"version": "4", "status": alerts[0]["status"], "receiver": "appliance", "groupKey": "{}:{}",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "truncatedAlerts": 0,
            "alerts": list(alerts)}


def wait_idle(client) -> dict:
    for _ in range(200):
        status = client.get("/admin/status", headers=AUTH).json()
        if not status["maintenance"]["restarting"] and not status["maintenance"]["rolling_restart_in_progress"]:
            return status
        time.sleep(0.02)
    raise AssertionError("maintenance still busy")


def actions(registry, action: str, result: str, trigger: str = "alert") -> float:
    return registry.get_sample_value("appliance_maintenance_actions_total",
                                     {"action": action, "trigger": trigger, "result": result}) or 0


def alerts_seen(registry, name: str, status: str, action: str) -> float:
    return registry.get_sample_value("appliance_alert_webhook_alerts_total",
                                     {"alertname": name, "status": status, "action": action}) or 0


def test_hung_replica_alert_restarts_that_replica_exactly_once(make_app):
    client, replicas, registry = make_app()
    body = payload(alert("ApplianceReplicaHung"))
    response = client.post("/admin/alerts", json=body, headers=AUTH)
    assert response.status_code == 200
    assert response.json()["decisions"][0]["action"] == "restart"
    wait_idle(client)
    for _ in range(2):  # Alertmanager's repeat notifications of the same firing alert
        assert client.post("/admin/alerts", json=body, headers=AUTH).status_code == 200
    status = wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]
    assert all(r.routable for r in replicas)
    assert actions(registry, "restart", "ok") == 1
    assert alerts_seen(registry, "ApplianceReplicaHung", "firing", "restart") == 1
    assert alerts_seen(registry, "ApplianceReplicaHung", "firing", "duplicate") == 2
    assert status["maintenance"]["last_action"]["replica"] == "replica-0"
    assert status["replicas"][0]["last_maintenance_restart"] is not None


def test_resolved_and_unlisted_alerts_are_only_recorded(make_app):
    client, replicas, registry = make_app()
    body = payload(alert("ApplianceReplicaHung", status="resolved"), alert("HighTTFT", fingerprint="f2"))
    decisions = client.post("/admin/alerts", json=body, headers=AUTH).json()["decisions"]
    assert [d["action"] for d in decisions] == ["none", "none"]
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [0, 0]
    assert alerts_seen(registry, "other", "firing", "none") == 1  # off the whitelist: one bounded series
    assert registry.get_sample_value("appliance_maintenance_actions_total",
                                     {"action": "restart", "trigger": "alert", "result": "ok"}) is None


def test_fragmentation_alert_schedules_a_rolling_restart_for_the_next_quiet_moment(make_app):
    client, replicas, _registry = make_app()
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceFragmentationRising")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["action"] == "rolling_restart" and decisions[0]["result"] == "ok"
    status = client.get("/admin/status", headers=AUTH).json()["maintenance"]
    assert status["restart_wanted"] == "ApplianceFragmentationRising"  # waits for low traffic, not run at once
    assert [r.status.restarts for r in replicas] == [0, 0]


def test_dry_run_records_but_does_not_act(make_app):
    client, replicas, registry = make_app(maintenance={"alert_dry_run": True})
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "dry_run"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [0, 0]
    assert actions(registry, "restart", "dry_run") == 1


def test_rate_limit_per_action_and_target(make_app):
    client, replicas, registry = make_app(maintenance={"alert_action_min_interval_seconds": 3600})
    client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")), headers=AUTH)
    wait_idle(client)
    refired = alert("ApplianceReplicaHung", fingerprint="f1", starts="2026-12-02T03:30:00Z")  # a new firing
    decisions = client.post("/admin/alerts", json=payload(refired), headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "rate_limited"
    other = alert("ApplianceReplicaHung", replica="replica-1", fingerprint="f9")
    assert client.post("/admin/alerts", json=payload(other), headers=AUTH).json()["decisions"][0]["result"] == "ok"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 1]
    assert actions(registry, "restart", "rate_limited") == 1


def test_unknown_replica_is_skipped(make_app):
    client, replicas, registry = make_app()
    body = payload(alert("ApplianceReplicaHung", replica="replica-7"))
    assert client.post("/admin/alerts", json=body, headers=AUTH).json()["decisions"][0]["result"] == "skipped"
    assert actions(registry, "restart", "skipped") == 1


def test_bad_payloads_are_400_in_openai_shape(make_app):
    client, _replicas, _registry = make_app()
    for body in (b"{not json", b'{"version": "3", "status": "firing", "alerts": []}', b'{"version": "4"}',
                 b"[]"):
        response = client.post("/admin/alerts", content=body, headers=AUTH | {"content-type": "application/json"})
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_alert_payload"


def test_webhook_needs_the_admin_token(make_app):
    client, replicas, _registry = make_app()
    body = payload(alert("ApplianceReplicaHung"))
    assert client.post("/admin/alerts", json=body).status_code == 401
    assert client.post("/admin/alerts", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
    disabled, _, _ = make_app(admin_token=None)
    assert disabled.post("/admin/alerts", json=body, headers=AUTH).status_code == 403
    time.sleep(0.1)
    assert [r.status.restarts for r in replicas] == [0, 0]


def test_alert_names_off_the_whitelist_share_one_series(make_app):
    client, _replicas, registry = make_app()
    invented = [alert(f"Invented{i}", replica=None, fingerprint=f"x{i}") for i in range(200)]
    client.post("/admin/alerts", json=payload(*invented), headers=AUTH)
    client.post("/admin/alerts", json=payload(*(a | {"status": "resolved"} for a in invented)), headers=AUTH)
    series = [s for metric in registry.collect() if metric.name == "appliance_alert_webhook_alerts"
              for s in metric.samples if s.name.endswith("_total")]
    assert {s.labels["alertname"] for s in series} == {"other"}
    assert alerts_seen(registry, "other", "firing", "none") == 200
    assert alerts_seen(registry, "other", "resolved", "none") == 200

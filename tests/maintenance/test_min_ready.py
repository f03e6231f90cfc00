"""No action path takes routable replicas below ``maintenance.min_ready_replicas``; restarts from alerts run one
at a time; the alert rate limit is keyed on the replica the alert resolves to, not on the alert's labels."""

from appliance.context import context_of
from tests.maintenance.support import AUTH, actions, alert, judge_hung, payload, wait_idle


def restarts(replicas) -> list[tuple]:
    return [e for e in replicas[0].events if e[0] == "restart"]


def test_hung_alerts_for_every_replica_never_leave_zero_routable(make_app):
    client, replicas, registry = make_app()
    for replica in replicas:
        replica.restart_seconds = 0.3
    judge_hung(client, "replica-0", "replica-1")  # even when the appliance's own view agrees with every alert
    forged = payload(alert("ApplianceReplicaHung", replica="replica-0", fingerprint="a"),
                     alert("ApplianceReplicaHung", replica="replica-1", fingerprint="b"))
    decisions = client.post("/admin/alerts", json=forged, headers=AUTH).json()["decisions"]
    assert [d["result"] for d in decisions] == ["ok", "skipped"]
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]
    assert all(routable_others >= 1 for _, _, routable_others, _ in restarts(replicas))
    assert actions(registry, "restart", "skipped") == 1


def test_alert_restarts_are_serialized_even_with_capacity_to_spare(stubs, make_app):
    client, replicas, _registry = make_app(replica_count=2, maintenance={"min_ready_replicas": 0})
    for replica in replicas:
        replica.restart_seconds = 0.3
    judge_hung(client, "replica-0", "replica-1")
    forged = payload(alert("ApplianceReplicaHung", replica="replica-0", fingerprint="a"),
                     alert("ApplianceReplicaHung", replica="replica-1", fingerprint="b"))
    decisions = client.post("/admin/alerts", json=forged, headers=AUTH).json()["decisions"]
    assert [d["result"] for d in decisions] == ["ok", "skipped"]
    assert "one at a time" in decisions[1]["detail"]
    wait_idle(client)
    # Alertmanager re-sends the firing alert; once the first restart is done the second may run.
    again = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung", replica="replica-1",
                                                            fingerprint="b")), headers=AUTH).json()
    assert again["decisions"][0]["result"] == "ok"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 1]


def test_admin_restart_that_would_go_below_min_ready_is_refused_with_409(make_app):
    client, replicas, _registry = make_app()
    replicas[0].restart_seconds = 0.5
    assert client.post("/admin/replicas/replica-0/restart", headers=AUTH).status_code == 202
    refused = client.post("/admin/replicas/replica-1/restart", headers=AUTH)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "min_ready_replicas" and "min_ready_replicas" in error["message"]
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]


def test_admin_drain_of_the_last_routable_replica_is_refused(make_app):
    client, replicas, _registry = make_app()
    assert client.post("/admin/replicas/replica-0/drain", headers=AUTH).status_code == 200
    refused = client.post("/admin/replicas/replica-1/drain", headers=AUTH)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "min_ready_replicas"
    assert replicas[1].routable
    # draining a replica that is already out of routing takes no capacity away
    assert client.post("/admin/replicas/replica-0/drain", headers=AUTH).status_code == 200


def test_single_replica_keeps_its_documented_planned_restart(make_app):
    client, replicas, registry = make_app(replica_count=1)
    assert client.post("/admin/replicas/replica-0/restart", headers=AUTH).status_code == 202
    wait_idle(client)
    assert replicas[0].status.restarts == 1 and replicas[0].routable
    assert actions(registry, "restart", "ok", trigger="admin") == 1


def test_rate_limit_cannot_be_bypassed_by_changing_labels(make_app):
    client, replicas, registry = make_app(maintenance={"alert_action_min_interval_seconds": 3600})
    judge_hung(client, "replica-0")
    client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")), headers=AUTH)
    wait_idle(client)
    relabelled = alert("ApplianceReplicaHung", fingerprint="forged-2", starts="2026-12-02T04:00:00Z")
    relabelled["labels"] |= {"instance": "elsewhere:1", "severity": "page", "job": "other"}
    decisions = client.post("/admin/alerts", json=payload(relabelled), headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "rate_limited"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]
    assert actions(registry, "restart", "rate_limited") == 1


def test_an_ejected_replica_is_not_capacity(make_app):
    """The router would send nothing to an ejected replica (and everything, in panic, once the other leaves)."""
    client, replicas, _registry = make_app(maintenance={"min_ready_wait_seconds": 0.2})
    context_of(client.app).gateway.router.eject("replica-1", "5 consecutive failures")
    refused = client.post("/admin/replicas/replica-0/restart", headers=AUTH)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "min_ready_replicas"
    assert client.post("/admin/replicas/replica-0/drain", headers=AUTH).status_code == 409
    assert client.post("/admin/rolling-restart", headers=AUTH).status_code == 202
    status = wait_idle(client)
    assert status["maintenance"]["last_action"]["result"] == "skipped"
    assert [r.status.restarts for r in replicas] == [0, 0] and replicas[0].routable
    # acting on the ejected replica itself takes no routable capacity away
    assert client.post("/admin/replicas/replica-1/drain", headers=AUTH).status_code == 200

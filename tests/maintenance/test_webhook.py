"""POST /admin/alerts: a firing whitelisted alert triggers its action once; everything else is only recorded;
dry run, rate limit, bad payloads and missing tokens."""

import asyncio
import time

from prometheus_client import CollectorRegistry

from appliance.composition.maintenance import build_maintenance
from appliance.maintenance.memory import MemoryReading, MemoryWatch
from appliance.maintenance.service import DataPathView
from appliance.maintenance.webhook import AlertmanagerPayload, Decision
from appliance.settings import Settings
from tests.maintenance.support import AUTH, actions, alert, fleet, judge_hung, payload, wait_idle


def alerts_seen(registry, name: str, status: str, action: str) -> float:
    return registry.get_sample_value("appliance_alert_webhook_alerts_total",
                                     {"alertname": name, "status": status, "action": action}) or 0


def test_hung_replica_alert_restarts_that_replica_exactly_once(make_app):
    client, replicas, registry = make_app()
    judge_hung(client, "replica-0")
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


def test_fragmentation_alert_without_a_memory_reading_of_its_own_is_not_confirmed(make_app):
    """Collectors off: the appliance cannot see fragmentation, so it does not take the alert's word for it (the
    confirmed case, a rolling restart wanted for the next quiet moment, is further down)."""
    client, replicas, registry = make_app()
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceFragmentationRising")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["action"] == "rolling_restart" and decisions[0]["result"] == "not_confirmed"
    assert "no memory reading" in decisions[0]["detail"]
    status = client.get("/admin/status", headers=AUTH).json()["maintenance"]
    assert status["restart_wanted"] is None
    assert [r.status.restarts for r in replicas] == [0, 0]
    assert actions(registry, "rolling_restart", "not_confirmed") == 1


def test_dry_run_records_but_does_not_act(make_app):
    client, replicas, registry = make_app(maintenance={"alert_dry_run": True})
    judge_hung(client, "replica-0")
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "dry_run"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [0, 0]
    assert actions(registry, "restart", "dry_run") == 1


def test_rate_limit_per_action_and_target(make_app):
    client, replicas, registry = make_app(maintenance={"alert_action_min_interval_seconds": 3600})
    judge_hung(client, "replica-0", "replica-1")
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


def test_deeply_nested_json_is_a_400_not_a_500(make_app):
    client, _replicas, _registry = make_app()
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"alerts": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_001):
        response = client.post("/admin/alerts", content=body, headers=AUTH | {"content-type": "application/json"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_alert_payload" and "nested too deeply" in error["message"]


def test_alert_names_off_the_whitelist_share_one_series(make_app):
    client, _replicas, registry = make_app()
    invented = [alert(f"Invented{i}", replica=None, fingerprint=f"x{i}") for i in range(200)]
    client.post("/admin/alerts", json=payload(*invented), headers=AUTH)
    client.post("/admin/alerts", json=payload(*(a | {"status": "resolved"} for a in invented)), headers=AUTH)
    series = [s for metric in registry.collect() if metric.name == "appliance_alert_webhook_alerts"
              for s in metric.samples if s.name.endswith("_total")]
    assert {s.labels["alertname"] for s in series} == {"other"}
    for status in ("firing", "resolved"):  # 100 looked at (alert_max_per_payload), the rest only counted
        assert alerts_seen(registry, "other", status, "none") == 100
        assert alerts_seen(registry, "other", status, "ignored") == 100


# -- alerts confirm, never command ---------------------------------------------------------------------


def test_a_hung_alert_for_a_replica_that_makes_progress_is_not_confirmed(make_app, caplog):
    client, replicas, registry = make_app()
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "not_confirmed" and "not hung" in decisions[0]["detail"]
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [0, 0]
    assert actions(registry, "restart", "not_confirmed") == 1
    assert any("not_confirmed" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    judge_hung(client, "replica-0")  # Alertmanager's repeat, once the appliance's own view agrees, acts
    again = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")), headers=AUTH).json()
    assert again["decisions"][0]["result"] == "ok"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]


def test_an_alert_never_restarts_the_last_routable_replica_but_an_operator_can(make_app):
    client, replicas, registry = make_app(replica_count=1)
    judge_hung(client, "replica-0")
    decisions = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung")),
                            headers=AUTH).json()["decisions"]
    assert decisions[0]["result"] == "refused" and "last routable" in decisions[0]["detail"]
    assert replicas[0].status.restarts == 0 and replicas[0].routable
    assert actions(registry, "restart", "refused") == 1
    assert client.post("/admin/replicas/replica-0/restart", headers=AUTH).status_code == 202
    wait_idle(client)
    assert replicas[0].status.restarts == 1


def test_alert_restarts_spend_one_global_hourly_budget(make_app):
    client, replicas, registry = make_app(replica_count=2, maintenance={"alert_restarts_per_hour": 1})
    judge_hung(client, "replica-0", "replica-1")
    first = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung", fingerprint="a")),
                        headers=AUTH).json()["decisions"][0]
    wait_idle(client)
    judge_hung(client, "replica-1")
    second = client.post("/admin/alerts", json=payload(alert("ApplianceReplicaHung", replica="replica-1",
                                                             fingerprint="b")), headers=AUTH).json()["decisions"][0]
    assert (first["result"], second["result"]) == ("ok", "refused")
    assert "alert_restarts_per_hour" in second["detail"]
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]
    assert actions(registry, "restart", "refused") == 1


def test_a_fragmentation_alert_acts_only_on_the_appliances_own_memory_reading():
    """Through the maintenance service as the app builds it, with the memory watch reading set by hand."""
    fragmentation = {"replica-0": 0.1, "replica-1": 0.1}
    memory = MemoryWatch(lambda: {n: MemoryReading(1, 10**9, f) for n, f in fragmentation.items()},
                         fragmentation_threshold=0.5, growth_threshold=None, growth_lookback_seconds=600)
    replicas = fleet(["http://a", "http://b"])
    registry = CollectorRegistry()
    maintenance = build_maintenance(
        Settings(served_model_name="demo", collectors={"enabled": False}), registry=registry,
        replicas=lambda: replicas, memory=memory,
        data_path=DataPathView(in_flight=lambda _n: 0, loads=dict, queue_length=lambda: 0,
                               requests_total=lambda: 0.0))

    def fire(fingerprint: str) -> Decision:
        body = AlertmanagerPayload.model_validate(payload(alert("ApplianceFragmentationRising", replica="replica-1",
                                                               fingerprint=fingerprint)))
        return maintenance.alerts.handle(body).decisions[0]

    async def scenario() -> list[Decision]:
        await maintenance.scheduler.check()  # the job reads memory whether or not automatic restarts are on
        low = fire("a")
        fragmentation["replica-1"] = 0.35  # over the alert's own threshold, under the automatic one
        await maintenance.scheduler.check()
        return [low, fire("a")]

    low, high = asyncio.run(scenario())
    assert low.result == "not_confirmed" and "0.10" in low.detail
    assert high.result == "ok"
    assert maintenance.scheduler.wanted == ("alert", "ApplianceFragmentationRising")
    assert actions(registry, "rolling_restart", "not_confirmed") == 1


# -- one payload, bounded work -------------------------------------------------------------------------


def test_a_payload_of_many_alerts_makes_one_record_per_action_target_and_result(make_app, caplog):
    client, replicas, registry = make_app(maintenance={"alert_max_per_payload": 1000})
    for replica in replicas:
        replica.restart_seconds = 0.3
    judge_hung(client, "replica-0")
    flood = [alert("ApplianceReplicaHung", fingerprint=f"h{i}") for i in range(300)]
    flood += [alert("ApplianceReplicaHung", replica=f"ghost-{i}", fingerprint=f"g{i}") for i in range(300)]
    flood += [alert(f"Invented{i}", replica=None, fingerprint=f"x{i}") for i in range(300)]
    caplog.clear()
    response = client.post("/admin/alerts", json=payload(*flood), headers=AUTH).json()
    wait_idle(client)
    results = [d["result"] for d in response["decisions"]]
    assert (results.count("ok"), results.count("rate_limited"), results.count("skipped")) == (1, 299, 300)
    assert actions(registry, "restart", "ok") == 1  # the one restart, recorded when done
    assert actions(registry, "restart", "rate_limited") == 1  # replica-0's 299 copies: one record
    assert actions(registry, "restart", "skipped") == 1  # 300 unknown replicas: one record
    assert alerts_seen(registry, "other", "firing", "none") == 300  # every alert is still counted
    lines = [r for r in caplog.records if r.name.startswith("appliance.maintenance")]
    assert len(lines) <= 8, [r.getMessage() for r in lines]
    assert [r.status.restarts for r in replicas] == [1, 0]


def test_alerts_beyond_the_per_payload_bound_are_counted_not_acted_on_whitelisted_first(make_app):
    client, replicas, registry = make_app(maintenance={"alert_max_per_payload": 10})
    judge_hung(client, "replica-0")
    flood = [alert(f"Invented{i}", replica=None, fingerprint=f"x{i}") for i in range(30)]
    flood.append(alert("ApplianceReplicaHung"))  # last in the payload, still acted on
    response = client.post("/admin/alerts", json=payload(*flood), headers=AUTH).json()
    assert response["received"] == 31 and response["ignored"] == 21
    assert len(response["decisions"]) == 10 and response["decisions"][0]["result"] == "ok"
    wait_idle(client)
    assert [r.status.restarts for r in replicas] == [1, 0]
    assert alerts_seen(registry, "other", "firing", "none") == 9
    assert alerts_seen(registry, "other", "firing", "ignored") == 21

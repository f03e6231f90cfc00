"""The request records' ring: bounded, newest first, filtered; off at capacity 0; each record JSON-ready with its
routing decision explained."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from appliance.gateway.observation.records import (
    ID_MAX_CHARS,
    AttemptRecord,
    MigrationRecord,
    RequestRecord,
    RequestRecords,
    record_id,
)
from appliance.gateway.routing.request import Decision, RoutingRequest
from appliance.gateway.routing.router import Router
from appliance.settings import Settings
from tests.doubles import FakeReplica


def record(id: str, *, tenant: str = "team-a", replica: str = "replica-0", e2e: float = 0.5, status: int = 200,
           outcome: str = "success", arrived_at: float = 1000.0) -> RequestRecord:
    made = RequestRecord(id, "/v1/chat/completions", tenant, True, arrived_at, 0.01)
    made.attempts.append(AttemptRecord(replica, Decision(replica, 1.0, "single"), 0.01, outcome, None,
                                       arrived_at + 0.01))
    made.ttft_seconds, made.e2e_seconds, made.status, made.outcome = 0.1, e2e, status, outcome
    return made


def ids(listed: list[dict]) -> list[str]:
    return [r["id"] for r in listed]


def test_the_ring_keeps_the_newest_capacity_records_newest_first():
    records = RequestRecords(3)
    for n in range(5):
        records.add(record(f"r{n}"))
    assert len(records) == 3
    assert ids(records.recent()) == ["r4", "r3", "r2"]
    assert ids(records.recent(limit=2)) == ["r4", "r3"]
    assert records.get("r1") is None and records.get("r2")["id"] == "r2"


def test_capacity_zero_keeps_nothing():
    records = RequestRecords(0)
    records.add(record("r0"))
    assert len(records) == 0 and records.recent() == [] and records.get("r0") is None
    assert not records.enabled
    with pytest.raises(ValueError):
        RequestRecords(-1)


def test_filters_tenant_replica_slowness_and_status():
    records = RequestRecords(10)
    records.add(record("a", tenant="team-a", replica="replica-0", e2e=0.2))
    records.add(record("b", tenant="team-b", replica="replica-1", e2e=3.0, status=503, outcome="failure"))
    moved = record("c", tenant="team-a", replica="replica-0", e2e=5.0)
    moved.migrations.append(MigrationRecord("replica-0", "replica-1", "connection", 12, "continued"))
    records.add(moved)
    records.add(record("d", tenant="team-b", replica="replica-0", e2e=1.0, status=200, outcome="aborted"))
    assert ids(records.recent(tenant="team-a")) == ["c", "a"]
    assert ids(records.recent(replica="replica-1")) == ["c", "b"]  # c was moved there
    assert ids(records.recent(min_seconds=1.0)) == ["d", "c", "b"]
    assert ids(records.recent(status=503)) == ids(records.recent(status="503")) == ["b"]
    assert ids(records.recent(status="5xx")) == ["b"]
    assert ids(records.recent(status="2xx")) == ["d", "c", "a"]
    assert ids(records.recent(status="aborted")) == ["d"]
    assert ids(records.recent(tenant="team-a", min_seconds=1.0)) == ["c"]
    assert ids(records.recent(tenant="team-a", min_seconds=1.0, limit=1, replica="replica-1")) == ["c"]
    assert records.recent(tenant="nobody") == []


def test_get_finds_the_newest_record_of_a_reused_id():
    records = RequestRecords(5)
    records.add(record("same", e2e=1.0))
    records.add(record("same", e2e=2.0))
    assert records.get("same")["e2e_seconds"] == 2.0


def test_to_json_explains_the_routing_decision_and_where_the_time_went():
    replicas = [FakeReplica("replica-0"), FakeReplica("replica-1", routable=False)]
    router = Router(lambda: replicas)
    first, second = RoutingRequest("p"), RoutingRequest("p")
    router.try_acquire(request=first)
    router.try_acquire({"replica-0"}, request=second)  # nothing left: no decision for this one
    made = RequestRecord("abc", "/v1/completions", "team-a", False, 1000.0, 0.25)
    made.attempts.append(AttemptRecord("replica-0", first.decision, 0.25, "failure", "retry: HTTP 503", 1000.25))
    made.attempts.append(AttemptRecord("replica-0", None, 0.0, "success", None, 1000.5))
    made.ttft_seconds, made.e2e_seconds, made.status, made.outcome = 0.8, 1.2, 200, "success"
    out = made.to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["replica"] == "replica-0" and out["retries"] == 1 and out["decided_by"] == "single"
    assert out["attempts"][0]["reason"] == "retry: HTTP 503"
    assert out["attempts"][1]["started_after_seconds"] == 0.5
    decision = out["attempts"][0]["decision"]
    assert decision["candidates"] == ["replica-0", "replica-1"]
    assert decision["removed"] == {"replica-1": "ready"}
    assert set(decision["scores"]["replica-0"]) == {"outstanding", "kv_cache", "queue", "prefix", "cache_room"}
    assert decision["picked"] == "replica-0" and decision["decided_by"] == "single"
    assert decision["total"] == decision["totals"]["replica-0"]


def test_the_replica_that_answered_is_where_the_last_migration_took_it():
    made = record("m", replica="replica-0")
    made.migrations.append(MigrationRecord("replica-0", None, "drain", 3, "failed"))
    assert made.replica == "replica-0"  # nobody took it
    made.migrations.append(MigrationRecord("replica-0", "replica-2", "drain", 3, "continued"))
    assert made.replica == "replica-2" and made.to_json()["migrations"][1]["to_replica"] == "replica-2"
    assert RequestRecord("none", "/v1/completions").to_json()["replica"] is None


def test_record_ids_are_the_clients_or_short_generated_ones():
    assert record_id(" client-id-1 ") == "client-id-1"
    assert len(record_id("x" * 10_000)) == ID_MAX_CHARS  # the ring's memory is not the client's to set
    generated = {record_id(None) for _ in range(100)} | {record_id("  ")}
    assert len(generated) == 101 and all(len(g) == 12 for g in generated)


def test_the_setting_defaults_to_1000_and_0_turns_it_off():
    assert Settings(served_model_name="demo").gateway.request_records == 1000
    assert Settings(served_model_name="demo", gateway={"request_records": 0}).gateway.request_records == 0
    with pytest.raises(ValidationError):
        Settings(served_model_name="demo", gateway={"request_records": -1})

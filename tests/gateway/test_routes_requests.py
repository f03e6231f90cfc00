"""GET /admin/requests and /admin/requests/{id}: the admin token required, filters applied, unknown ids and bad
query values answered in OpenAI's error shape. Records are put into the ring by hand (the request path fills them
elsewhere)."""

from __future__ import annotations

import pytest

from appliance.context import context_of
from appliance.gateway.observation.records import AttemptRecord, MigrationRecord, RequestRecord
from appliance.gateway.routing.request import Decision

AUTH = {"authorization": "Bearer t0ken"}


@pytest.fixture
def admin(make_client):
    client = make_client(gateway={"admin_token": "t0ken"})
    records = context_of(client.app).gateway.records
    for n, (tenant, replica, e2e, status) in enumerate([("team-a", "replica-0", 0.2, 200),
                                                        ("team-b", "replica-1", 3.0, 503),
                                                        ("team-a", "replica-1", 4.0, 200)]):
        made = RequestRecord(f"req-{n}", "/v1/chat/completions", tenant, True, 1000.0 + n, 0.0)
        made.attempts.append(AttemptRecord(replica, Decision(replica, 1.0, "single", considered=[replica]),
                                           started_at=1000.0 + n))
        made.e2e_seconds, made.status, made.outcome = e2e, status, "success" if status == 200 else "failure"
        records.add(made)
    return client


def listed(client, **query) -> list[str]:
    response = client.get("/admin/requests", params=query, headers=AUTH)
    assert response.status_code == 200, response.text
    return [r["id"] for r in response.json()["requests"]]


def test_the_admin_token_is_required(admin, make_client):
    for path in ("/admin/requests", "/admin/requests/req-0"):
        assert admin.get(path).status_code == 401
        wrong = admin.get(path, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_token"
    disabled = make_client()  # no admin token configured: the admin API is off
    assert disabled.get("/admin/requests", headers=AUTH).status_code == 403


def test_lists_newest_first_with_filters(admin):
    body = admin.get("/admin/requests", headers=AUTH).json()
    assert (body["capacity"], body["held"]) == (1000, 3)
    assert [r["id"] for r in body["requests"]] == ["req-2", "req-1", "req-0"]
    assert listed(admin, tenant="team-a") == ["req-2", "req-0"]
    assert listed(admin, replica="replica-1") == ["req-2", "req-1"]
    assert listed(admin, min_seconds=3) == ["req-2", "req-1"]
    assert listed(admin, status="5xx") == listed(admin, status="503") == listed(admin, status="failure") == ["req-1"]
    assert listed(admin, limit=1) == ["req-2"]


def test_one_request_by_id_and_404_for_an_unknown_one(admin):
    one = admin.get("/admin/requests/req-1", headers=AUTH)
    assert one.status_code == 200
    body = one.json()
    assert body["id"] == "req-1" and body["attempts"][0]["decision"]["candidates"] == ["replica-1"]
    missing = admin.get("/admin/requests/nope", headers=AUTH)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"
    assert missing.json()["error"]["type"] == "not_found_error"


def test_a_clients_id_with_any_character_is_found(admin):
    made = RequestRecord("tenant/42 ?&#x", "/v1/completions")
    made.migrations.append(MigrationRecord("replica-0", "replica-1", "connection", 3, "continued"))
    context_of(admin.app).gateway.records.add(made)
    response = admin.get("/admin/requests/tenant%2F42%20%3F%26%23x", headers=AUTH)
    assert response.status_code == 200 and response.json()["replica"] == "replica-1"


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 1001}, {"limit": "many"}, {"min_seconds": -1},
                                   {"min_seconds": "nan"}, {"min_seconds": "inf"}, {"min_seconds": "slow"},
                                   {"status": "5XX!"}, {"status": "600"}, {"tenant": "t" * 201}])
def test_bad_query_values_are_400_in_openais_shape(admin, query):
    response = admin.get("/admin/requests", params=query, headers=AUTH)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["param"] == next(iter(query))


def test_capacity_zero_answers_an_empty_view(make_client):
    client = make_client(gateway={"admin_token": "t0ken", "request_records": 0})
    records = context_of(client.app).gateway.records
    records.add(RequestRecord("x", "/v1/completions"))
    body = client.get("/admin/requests", headers=AUTH).json()
    assert body == {"capacity": 0, "held": 0, "requests": []}
    assert client.get("/admin/requests/x", headers=AUTH).status_code == 404

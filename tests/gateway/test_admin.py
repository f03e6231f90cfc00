"""Admin API: token required, status readable, drain takes a replica out of routing."""

import pytest


@pytest.fixture
def admin(make_client):
    return make_client(admin_token="t0ken")


AUTH = {"authorization": "Bearer t0ken"}


def test_admin_needs_the_token(admin, make_client):
    assert admin.get("/admin/status").status_code == 401
    assert admin.get("/admin/status", headers={"authorization": "Bearer nope"}).status_code == 401
    disabled = make_client()  # no admin_token configured: the admin API is off
    assert disabled.get("/admin/status", headers=AUTH).status_code == 403


def test_status_lists_replicas(admin):
    status = admin.get("/admin/status", headers=AUTH).json()
    assert status["ready_replicas"] == 2
    assert [r["name"] for r in status["replicas"]] == ["replica-0", "replica-1"]


def test_drain_moves_traffic_away_and_undrain_brings_it_back(admin, replicas):
    assert admin.post("/admin/replicas/replica-0/drain", headers=AUTH).status_code == 200
    for _ in range(3):
        assert admin.post("/v1/completions", json={"prompt": "x"}).headers["x-appliance-replica"] == "replica-1"
    admin.post("/admin/replicas/replica-0/undrain", headers=AUTH)
    assert admin.post("/v1/completions", json={"prompt": "x"}).headers["x-appliance-replica"] == "replica-0"


def test_unknown_replica_is_a_404(admin):
    response = admin.post("/admin/replicas/replica-9/drain", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "replica_not_found"

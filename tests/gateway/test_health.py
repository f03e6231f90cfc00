"""Readiness reflects the capacity the router can actually use, ejection included."""

from appliance.context import context_of


def test_readiness_counts_routable_capacity_after_ejection(client, replicas):
    router = context_of(client.app).gateway.router
    router.eject("replica-0", "test")
    body = client.get("/health/ready").json()
    assert body["status"] == "ready"
    assert body["ready_replicas"] == 2 and body["routable_replicas"] == 1 and body["ejected_replicas"] == 1
    router.eject("replica-1", "test")  # every replica ejected: panic routing keeps serving, and says so
    response = client.get("/health/ready")
    assert response.status_code == 200
    assert response.json()["routable_replicas"] == 2 and response.json()["panic"] is True
    for replica in replicas:
        replica.routable = False
    response = client.get("/health/ready")
    assert response.status_code == 503 and response.json()["routable_replicas"] == 0

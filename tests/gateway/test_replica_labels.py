"""Clients never learn an internal address: a replica found by DNS is named by its address (10.42.0.17:8100), so
what answers to clients name it by an opaque label, stable for one replica, different between replicas."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.upstream.labels import client_label
from appliance.settings import Settings
from tests.doubles import FakeReplica

ADDRESSES = ("10.42.0.17:8100", "10.42.3.5:8100")
BODY = {"model": "demo", "prompt": "hi", "max_tokens": 2}


def client_for(stubs) -> TestClient:
    replicas = [FakeReplica(name, stub.url) for name, stub in zip(ADDRESSES, stubs, strict=True)]
    settings = Settings(served_model_name="demo", collectors={"enabled": False})
    return TestClient(create_app(settings, replicas=lambda: replicas, registry=CollectorRegistry()),
                      raise_server_exceptions=False)


def test_the_replica_header_never_shows_an_address(stubs):
    with client_for(stubs) as client:
        labels = set()
        for stream in (False, True, False, True):
            response = client.post("/v1/completions", json={**BODY, "stream": stream})
            assert response.status_code == 200
            label = response.headers["x-appliance-replica"]
            assert not any(part in label for part in ("10.42", ":8100")), label
            assert label.startswith("replica-")
            labels.add(label)
        assert labels <= {client_label(name) for name in ADDRESSES}


def test_readiness_names_drifted_replicas_by_label(stubs, monkeypatch):
    """/health/ready is open to anyone."""
    with client_for(stubs) as client:
        audit = context_of(client.app).gateway.admission.audit
        monkeypatch.setattr(audit, "drifted", lambda name: name == ADDRESSES[0])
        body = client.get("/health/ready").json()
        assert body["slot_drift"] == [client_label(ADDRESSES[0])] and "10.42" not in str(body)


def test_opaque_names_are_shown_as_they_are_and_labels_are_stable():
    assert client_label("replica-0") == "replica-0" and client_label("external-2") == "external-2"
    assert client_label(ADDRESSES[0]) == client_label(ADDRESSES[0]) != client_label(ADDRESSES[1])

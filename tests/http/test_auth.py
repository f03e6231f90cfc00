"""The bearer checks: one Authorization header only, the same answer everywhere; constant-time comparison of
digests against every accepted value; /metrics closed once API keys are set."""

from __future__ import annotations

import hmac

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.http import auth
from appliance.http.credentials import Credentials
from appliance.settings import Settings
from tests.doubles import FakeReplica

TWO = [("authorization", "Bearer adm"), ("authorization", "Bearer k1")]


@pytest.fixture
def client():
    settings = Settings(served_model_name="demo", api_keys=["k1"], admin_token="adm", collectors={"enabled": False})
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0")], registry=CollectorRegistry())
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize("path", ["/v1/models", "/admin/status", "/metrics", "/health/live", "/sd/targets"])
@pytest.mark.parametrize("order", [TWO, TWO[::-1]])
def test_two_authorization_headers_are_refused_the_same_way_on_every_path(client, path, order):
    """The intake read the last header and the routes the first: with one valid and one not, which one counted
    depended on where it was checked. Now neither is read."""
    response = client.get(path, headers=order)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_authorization"
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_routes_refuse_two_headers_too(client, monkeypatch):
    """Defence in depth: the routes' own dependency refuses them when the intake did not see the request."""
    monkeypatch.setattr(auth, "check_for_path", lambda _path: None)  # what a route mounted elsewhere looks like
    response = client.get("/admin/status", headers=TWO)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_authorization"
    assert client.get("/admin/status", headers={"authorization": "Bearer adm"}).status_code == 200


def test_every_accepted_value_is_compared_as_a_digest_in_constant_time(monkeypatch):
    """No early exit on a match (which one matched would show in the time), and equal-length digests, never the
    plaintext (compare_digest returns at once on a length mismatch, which shows a secret's length)."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    credentials = Credentials(api_keys=("first-key", "a-much-longer-second-key", "third"))
    assert auth.api_key_error(credentials, "Bearer first-key") is None
    assert len(compared) == 3
    assert all(isinstance(a, bytes) and len(a) == len(b) == 32 for a, b in compared)
    assert all(b"first-key" not in b for _, b in compared)


def test_metrics_are_closed_once_api_keys_are_set(client):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"authorization": "Bearer k1"}).status_code == 401  # a client's key
    assert client.get("/metrics", headers={"authorization": "Bearer adm"}).status_code == 200


def test_metrics_without_keys_or_tokens_stay_open_and_with_keys_and_no_token_are_closed():
    assert auth.metrics_error(Credentials(), None) is None
    refused = auth.metrics_error(Credentials(api_keys=("k1",)), "Bearer k1")
    assert refused is not None and refused.status == 403 and "metrics_token" in refused.message
    assert auth.metrics_error(Credentials(api_keys=("k1",), metrics_token="m"), "Bearer m") is None

"""Issue 21: with every engine down the gateway Service must keep its endpoints, so that clients get 503 +
Retry-After from a gateway rather than a refused connection. The path the gateway Deployment's readinessProbe
names (read from the rendered manifest) answers 200 on a gateway with no routable engine and 503 once it drains;
/health/ready keeps its single-host meaning (503 without an engine). Stub upstreams: this is the gateway's own
logic, not serving."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.context import context_of
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.kubernetes.manifests import render

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


@pytest.fixture(scope="module")
def gateway_probe() -> str:
    objects = render("overlays/gpu")
    gateway = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "appliance-gateway")
    probe = gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["port"] == "http"
    return probe["path"]


@pytest.fixture
def gateway(stubs):
    replicas = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    app = create_app(Settings(served_model_name="demo"), replicas=lambda: replicas)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, replicas


def test_the_gateway_probe_stays_ready_without_engines_and_clients_get_503(gateway, gateway_probe):
    client, replicas = gateway
    assert client.get(gateway_probe).status_code == 200
    assert client.get("/health/ready").status_code == 200
    for replica in replicas:  # every engine down
        replica.routable = False
    answers = [client.get(gateway_probe) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[-1].json()["routable_replicas"] == 0
    assert client.get("/health/ready").status_code == 503, "the single-host readiness keeps its meaning"
    response = client.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["message"]


def test_the_gateway_probe_fails_while_draining(gateway, gateway_probe):
    """Draining takes the pod out of the Service (its preStop has already waited for that), engines or not."""
    client, _ = gateway
    context_of(client.app).live.draining = True
    response = client.get(gateway_probe)
    assert response.status_code == 503 and response.json()["draining"] is True
    context_of(client.app).live.draining = False
    assert client.get(gateway_probe).status_code == 200

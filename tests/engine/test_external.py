"""External engines: routed to by URL, followed by health, never started or stopped by the appliance."""

import time

from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.engine.external import ExternalFleet
from appliance.settings import Settings
from tests.gateway.stub import StubUpstream


def test_gateway_routes_to_external_engines_once_healthy():
    stub = StubUpstream().start()
    try:
        fleet = ExternalFleet([stub.url + "/"])
        with TestClient(create_app(Settings(engine_urls=[stub.url]), fleet=fleet)) as client:
            deadline = time.monotonic() + 10
            while client.get("/health/ready").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            response = client.post("/v1/completions", json={"prompt": "hi"})
            assert response.status_code == 200
            assert response.headers["x-appliance-replica"] == "external-0"
        assert fleet.replicas[0].status.state.value == "stopped"
    finally:
        stub.stop()

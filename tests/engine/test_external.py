"""External engines: routed to by URL, followed by health, never started or stopped by the appliance."""

import asyncio
import time

import aiohttp
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.composition.fleet import build_specs
from appliance.engine.external import ExternalFleet
from appliance.engine.health import Health, probe_health
from appliance.settings import Settings
from tests.fake_engine import FakeEngine


def test_gateway_routes_to_external_engines_once_healthy():
    stub = FakeEngine().start()
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


def test_a_health_probe_is_judged_against_the_configured_timeout():
    """engine.health_timeout_seconds: an engine whose /health answers in 0.3 s fails a 0.1 s probe and passes a
    1 s one; the supervised replicas' specs and the external fleet both take the setting."""
    async def scenario() -> tuple[Health, Health]:
        async with FakeEngine(health_delay=0.3) as engine, aiohttp.ClientSession() as session:
            return await probe_health(session, engine.url, 0.1), await probe_health(session, engine.url, 1.0)

    assert asyncio.run(scenario()) == (Health.LATE, Health.OK)
    settings = Settings(engine={"health_timeout_seconds": 7.5, "max_model_len": 64}, model="/nonexistent")
    assert {spec.health_timeout_seconds for spec in build_specs(settings, settings.model)} == {7.5}
    assert ExternalFleet(["http://x"], 7.5).replicas[0].health_timeout_seconds == 7.5

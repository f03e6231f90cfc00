"""External engines: routed to by URL, followed by health, never started or stopped by the appliance."""

import asyncio
import time

import aiohttp
from aiohttp import web
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.engine.external import ExternalFleet
from appliance.engine.health import Health, probe_health
from appliance.engine.supervisor import build_specs
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


def test_a_health_probe_is_judged_against_the_configured_timeout():
    """engine.health_timeout_seconds: an engine whose /health answers in 0.3 s fails a 0.1 s probe and passes a
    1 s one; the supervised replicas' specs and the external fleet both take the setting."""
    async def scenario() -> tuple[Health, Health]:
        async def slow(_request: web.Request) -> web.Response:
            await asyncio.sleep(0.3)
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as session:
                return await probe_health(session, url, 0.1), await probe_health(session, url, 1.0)
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == (Health.LATE, Health.OK)
    settings = Settings(engine={"health_timeout_seconds": 7.5, "max_model_len": 64}, model="/nonexistent")
    assert {spec.health_timeout_seconds for spec in build_specs(settings, settings.model)} == {7.5}
    assert ExternalFleet(["http://x"], 7.5).replicas[0].health_timeout_seconds == 7.5

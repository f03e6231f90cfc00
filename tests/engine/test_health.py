"""A late /health from an engine that streams is not a failure; a refused one, or a late one from a silent engine,
is (appliance/engine/health.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from appliance.engine.contract import ReplicaState, ReplicaStatus
from appliance.engine.external import ExternalReplica
from appliance.engine.health import Health, HealthFailures

GRACE = 4.0


@given(st.lists(st.tuples(st.sampled_from(list(Health)), st.none() | st.floats(0, 10)), max_size=40))
def test_the_count_is_the_failures_since_the_last_green_probe_not_excused_by_progress(probes):
    """Against a model: after each probe, the count is the number of probes since the last OK that were FAILED, or
    LATE with no engine bytes within the grace window (``age``: seconds since the data path last received some)."""
    now = [100.0]
    status = ReplicaStatus(state=ReplicaState.READY)
    failures = HealthFailures(status, GRACE, clock=lambda: now[0])
    expected = 0
    for result, age in probes:
        status.last_progress = None if age is None else now[0] - age
        if result is Health.OK:
            expected = 0
        elif result is Health.FAILED or age is None or age > GRACE:
            expected += 1
        assert failures.record(result) == expected
        now[0] += 1.0


@asynccontextmanager
async def engine(health: dict[str, float]) -> AsyncIterator[str]:
    """An engine whose /health answers ``health["status"]`` after ``health["delay"]`` seconds, counting the probes
    it receives (``health["probes"]``)."""
    async def answer(_request: web.Request) -> web.Response:
        health["probes"] += 1
        await asyncio.sleep(health["delay"])
        return web.Response(status=int(health["status"]), text="ok")

    app = web.Application()
    app.router.add_get("/health", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "streaming", "routable"), [
    (200, True, True),  # late but streaming: busy, kept in routing
    (200, False, False),  # late and silent: hung, taken out
    (503, True, False),  # refused while streaming: a failed probe counts whatever the data path sees
])
def test_a_ready_engine_is_taken_out_of_routing_only_for_failures_that_progress_does_not_explain(
        monkeypatch, status, streaming, routable):
    """An external engine turns slow (0.3 s /health against a 0.1 s probe limit) or refuses, after becoming ready;
    the data path writes ``last_progress`` every 20 ms while ``streaming``. After 8 more probes (3 failures in a row
    take a replica out of routing), is it still routable? Counted in probes, not seconds: a loaded host probes less
    often."""
    monkeypatch.setattr(ExternalReplica, "HEALTH_INTERVAL_SECONDS", 0.02)

    async def scenario() -> bool:
        health = {"delay": 0.0, "status": 200.0, "probes": 0.0}
        async with engine(health) as url, aiohttp.ClientSession() as session:
            replica = ExternalReplica(0, url, health_timeout_seconds=0.1)
            replica.start(session)
            try:
                while not replica.routable:
                    await asyncio.sleep(0.01)
                health.update(delay=0.3 if status == 200 else 0.0, status=float(status))
                until = health["probes"] + 8
                while health["probes"] < until:
                    if streaming:
                        replica.status.last_progress = time.monotonic()
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.15)  # the last probe's verdict
                return replica.routable
            finally:
                await replica.stop()

    assert asyncio.run(scenario()) is routable

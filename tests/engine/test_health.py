"""A late /health from an engine that streams is not a failure; a refused one, or a late one from a silent engine,
is (appliance/engine/health.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.engine.contract import ReplicaState, ReplicaStatus
from appliance.engine.external import ExternalReplica
from appliance.engine.health import Health, HealthFailures
from tests.fake_engine import FakeEngine

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
        async with FakeEngine() as engine, aiohttp.ClientSession() as session:
            replica = ExternalReplica(0, engine.url, health_timeout_seconds=0.1)
            replica.start(session)
            try:
                while not replica.routable:
                    await asyncio.sleep(0.01)
                engine.health_delay, engine.health_status = (0.3 if status == 200 else 0.0), status
                until = engine.health_checks + 8
                while engine.health_checks < until:
                    if streaming:
                        replica.status.last_progress = time.monotonic()
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.15)  # the last probe's verdict
                return replica.routable
            finally:
                await replica.stop()

    assert asyncio.run(scenario()) is routable

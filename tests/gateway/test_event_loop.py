"""The gateway's event-loop lag probe: a blocked loop shows as lag, stop() ends the probe, the interval is checked,
and a running app exposes the histogram. Bounds on time are lower bounds only (the test host may be loaded)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from appliance.gateway.observation.event_loop import EventLoopLag
from appliance.settings import ConfigError, load_settings

LAG = "appliance_event_loop_lag_seconds"
PATIENCE = 30.0  # seconds to wait for the next observation on a loaded host; a guard against hanging, not a bound


def observations(registry: CollectorRegistry) -> float:
    return registry.get_sample_value(f"{LAG}_count") or 0.0


def at_most(registry: CollectorRegistry, seconds: str) -> float:
    return registry.get_sample_value(f"{LAG}_bucket", {"le": seconds}) or 0.0


async def observed(registry: CollectorRegistry, more_than: float) -> None:
    """Until the probe has observed more than ``more_than`` times."""
    deadline = time.monotonic() + PATIENCE
    while observations(registry) <= more_than:
        assert time.monotonic() < deadline, "the probe observed nothing"
        await asyncio.sleep(0.01)


def test_a_blocking_call_on_the_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()
    probe = EventLoopLag(registry, 0.01)

    async def main() -> None:
        probe.start()
        await observed(registry, 0)  # the probe is asleep now: it sleeps again right after each observation
        before = observations(registry)
        time.sleep(0.3)  # a synchronous call holds the loop; the probe's timer is due within 0.01 s
        await observed(registry, before)
        await probe.stop()

    asyncio.run(main())
    assert observations(registry) - at_most(registry, "0.25") >= 1  # woke at least 0.3 - 0.01 s late


def test_stop_ends_the_probe_and_a_second_stop_is_harmless() -> None:
    registry = CollectorRegistry()
    probe = EventLoopLag(registry, 0.01)

    async def main() -> None:
        await probe.stop()  # before start: nothing to stop
        probe.start()
        task = probe._task
        assert task is not None
        await observed(registry, 0)
        await probe.stop()
        assert task.done()
        stopped_at = observations(registry)
        await asyncio.sleep(0.1)
        assert observations(registry) == stopped_at
        await probe.stop()

    asyncio.run(main())


@pytest.mark.parametrize("seconds", [0, -0.1])
def test_the_probe_interval_must_be_positive(seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        EventLoopLag(CollectorRegistry(), seconds)
    monkeypatch.setenv("APPLIANCE_GATEWAY__EVENT_LOOP_PROBE_SECONDS", str(seconds))
    with pytest.raises(ConfigError, match=r"gateway\.event_loop_probe_seconds: Input should be greater than 0"):
        load_settings()


def test_the_probe_interval_defaults_to_a_tenth_of_a_second() -> None:
    assert load_settings().gateway.event_loop_probe_seconds == 0.1


def test_the_running_app_exposes_the_lag(make_client) -> None:
    client = make_client(gateway={"event_loop_probe_seconds": 0.01})
    deadline = time.monotonic() + PATIENCE
    while True:
        response = client.get("/metrics")
        assert response.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(response.text)}
        assert families[LAG].type == "histogram"
        count = next(s.value for s in families[LAG].samples if s.name == f"{LAG}_count")
        if count >= 1:  # observed: the probe was started with the app
            break
        assert time.monotonic() < deadline, "the app's probe observed nothing"
        time.sleep(0.05)

"""Engine readings per replica (fresh only) and replica life-cycle counters."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors.base import CollectorHealth, HealthCollector
from appliance.collectors.engine import EngineCollector
from appliance.engine.load import EngineLoad
from tests.collectors.support import FakeClock, FakeReplica, cpu_replica, label_sets, scrape, value


def build(replicas: list, loads: dict[str, EngineLoad], clock: FakeClock) -> CollectorRegistry:
    registry = CollectorRegistry()
    health = CollectorHealth()
    registry.register(EngineCollector(lambda: replicas, lambda: loads, max_age_seconds=5.0, health=health,
                                      clock=clock))
    registry.register(HealthCollector(health))
    return registry


def test_fresh_readings_are_exported_and_stale_ones_omitted() -> None:
    clock = FakeClock()
    loads = {
        "replica-0": EngineLoad(kv_cache_usage=0.42, waiting=3, running=7, read_at=clock() - 1),
        "replica-1": EngineLoad(kv_cache_usage=0.9, waiting=9, running=9, read_at=clock() - 30),
        "replica-2": EngineLoad(kv_cache_usage=None, waiting=0, running=1, read_at=clock()),
    }
    families = scrape(build([], loads, clock))
    assert value(families, "appliance_engine_kv_cache_usage_ratio", replica="replica-0") == pytest.approx(0.42)
    assert value(families, "appliance_engine_requests_waiting", replica="replica-0") == 3
    assert value(families, "appliance_engine_requests_running", replica="replica-0") == 7
    assert {s["replica"] for s in label_sets(families, "appliance_engine_requests_running")} == {
        "replica-0", "replica-2"}
    assert value(families, "appliance_engine_kv_cache_usage_ratio", replica="replica-2") is None  # unknown
    assert value(families, "appliance_collector_source", collector="engine", source="engine_load") == 1


def test_no_readings_no_series() -> None:
    families = scrape(build([], {}, FakeClock()))
    assert families["appliance_engine_kv_cache_usage_ratio"].samples == []
    assert value(families, "appliance_collector_source", collector="engine", source="none") == 1


def test_life_cycle() -> None:
    fresh = cpu_replica("replica-0", 123)
    restarted = cpu_replica("replica-1", 456)
    restarted.status.starts, restarted.status.restarts, restarted.status.crashes = 3, 2, 1
    restarted.status.load_seconds, restarted.status.last_start_time = 35.5, 1_700_000_000.0
    families = scrape(build([fresh, restarted], {}, FakeClock()))
    assert value(families, "appliance_replica_starts_total", replica="replica-0") == 1
    assert value(families, "appliance_replica_restarts_total", replica="replica-1") == 2
    assert value(families, "appliance_replica_crashes_total", replica="replica-1") == 1
    assert value(families, "appliance_replica_spawn_failures_total", replica="replica-1") == 0
    assert value(families, "appliance_replica_model_load_seconds", replica="replica-1") == 35.5
    assert value(families, "appliance_replica_model_load_seconds", replica="replica-0") is None  # not loaded yet
    assert value(families, "appliance_replica_last_restart_timestamp_seconds", replica="replica-1") == 1.7e9
    assert value(families, "appliance_replica_last_restart_timestamp_seconds", replica="replica-0") is None


def test_a_replica_the_appliance_does_not_run_has_zero_counters_and_no_load_time() -> None:
    families = scrape(build([FakeReplica("external-0")], {}, FakeClock()))
    assert value(families, "appliance_replica_starts", replica="external-0") == 0
    assert value(families, "appliance_replica_model_load_seconds", replica="external-0") is None
    assert value(families, "appliance_replica_last_restart_timestamp_seconds", replica="external-0") is None


def test_spawn_failures_are_exported() -> None:
    failing = cpu_replica("replica-0", None)
    failing.status.spawn_failures = 4
    families = scrape(build([failing], {}, FakeClock()))
    assert value(families, "appliance_replica_spawn_failures_total", replica="replica-0") == 4

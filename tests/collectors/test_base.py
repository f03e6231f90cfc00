"""The shared machinery: collect() never raises, health is reported once, rates over minimum windows."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.collectors.base import (
    CollectorHealth,
    HealthCollector,
    KeyedRates,
    MonotonicCounter,
    RateWindow,
    SafeCollector,
    ratio,
)
from tests.collectors.support import scrape, value


class Broken(SafeCollector):
    name = "broken"

    def families(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("appliance_partial", "Never reaches the page.", value=1)
        raise RuntimeError("source exploded")


class PartlyBroken(SafeCollector):
    name = "partly"

    def families(self) -> Iterable[Metric]:
        page = []
        with self.source("bad"):
            raise OSError("unreadable")
        with self.source("good"):
            page.append(GaugeMetricFamily("appliance_good", "Still exported.", value=2))
        self.health.set_sources(self.name, ["good"])
        return page


def test_a_failing_collector_yields_nothing_and_is_counted() -> None:
    registry = CollectorRegistry()
    health = CollectorHealth()
    registry.register(Broken(health))
    registry.register(HealthCollector(health))
    families = scrape(registry)
    assert "appliance_partial" not in families
    assert value(families, "appliance_collector_errors", collector="broken", source="collect") == 1
    assert value(families, "appliance_collector_duration_seconds", collector="broken") >= 0


def test_a_failing_source_costs_only_its_metrics() -> None:
    registry = CollectorRegistry()
    health = CollectorHealth()
    registry.register(PartlyBroken(health))
    registry.register(HealthCollector(health))
    families = scrape(registry)
    families = scrape(registry)
    assert value(families, "appliance_good") == 2
    assert value(families, "appliance_collector_errors", collector="partly", source="bad") == 2
    assert value(families, "appliance_collector_source", collector="partly", source="good") == 1


def test_no_source_reads_none() -> None:
    health = CollectorHealth()
    health.set_sources("compute", [])
    assert health.sources["compute"] == {"none"}


def test_rate_window_waits_for_the_minimum_window_and_restarts_on_reset() -> None:
    window = RateWindow(5.0)
    assert window.update(0.0, 100.0) is None
    assert window.update(1.0, 110.0) is None  # too close, and no rate yet
    assert window.update(10.0, 200.0) == 10.0
    assert window.update(11.0, 500.0) == 10.0  # too close: the last rate, baseline kept
    assert window.update(20.0, 300.0) == 10.0
    assert window.update(25.0, 50.0) is None  # went down: the source restarted
    assert window.update(30.0, 100.0) == 10.0


def test_keyed_rates_forget_departed_keys() -> None:
    rates = KeyedRates(1.0)
    rates.update("a", 0.0, 0.0)
    rates.update("b", 0.0, 0.0)
    rates.retain(["a"])
    assert rates.update("a", 2.0, 4.0) == 2.0
    assert rates.update("b", 2.0, 4.0) is None


def test_monotonic_counter_holds_within_a_generation_and_resets_across() -> None:
    counter = MonotonicCounter()
    assert counter.value("r", 1, 10.0) == 10.0
    assert counter.value("r", 1, 9.0) == 10.0  # an unreaped child vanished: hold
    assert counter.value("r", 1, 12.0) == 12.0
    assert counter.value("r", 2, 1.0) == 1.0  # restarted: a real reset


def test_ratio() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(5.0, 4.0) == 1.0
    assert ratio(5.0, 4.0, clamp=False) == 1.25
    assert ratio(1.0, 0.0) is None

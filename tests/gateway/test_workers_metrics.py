"""The decider's registry with its workers' metrics summed in (appliance.gateway.workers.metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from appliance.gateway.workers.metrics import MergedRegistry, snapshot, total


class Ratio:
    def __init__(self, value: float) -> None:
        self.value = value

    def collect(self):  # type: ignore[no-untyped-def]
        yield GaugeMetricFamily("appliance_gateway_cpu_ratio", "busy", value=self.value)


def worker(requests: int, open_streams: int, lag: float, cpu: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("appliance_requests", "r", ["code"], registry=registry).labels("200").inc(requests)
    Gauge("appliance_open_streams", "o", registry=registry).set(open_streams)
    Histogram("appliance_event_loop_lag_seconds", "l", registry=registry, buckets=(0.01, 0.1)).observe(lag)
    registry.register(Ratio(cpu))
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_counters_histograms_and_gauges_sum_over_the_decider_and_its_workers() -> None:
    decider = MergedRegistry()
    own = worker(1, 0, 0.5, 0.2)
    for collector in list(own._collector_to_names):
        decider.register(collector)
    decider.push(1, snapshot(worker(10, 3, 0.005, 0.9)))
    decider.push(2, snapshot(worker(5, 2, 0.05, 0.4)))
    assert value(decider, "appliance_requests_total", code="200") == 16
    assert total(decider, "appliance_requests_total") == 16
    assert value(decider, "appliance_open_streams") == 5
    assert value(decider, "appliance_event_loop_lag_seconds_count") == 3
    assert value(decider, "appliance_event_loop_lag_seconds_bucket", le="0.01") == 1
    assert value(decider, "appliance_event_loop_lag_seconds_bucket", le="0.1") == 2
    assert value(decider, "appliance_gateway_cpu_ratio") == 0.9  # the busiest process's, not a sum
    created = [s.value for m in decider.collect() for s in m.samples if s.name == "appliance_requests_created"]
    assert len(created) == 1
    text = generate_latest(decider).decode()
    assert text.count("# TYPE appliance_requests_total counter") == 1  # one family, never two of a name


def test_a_worker_that_left_keeps_its_counts_and_loses_its_gauges() -> None:
    decider = MergedRegistry()
    decider.push(1, snapshot(worker(10, 3, 0.005, 0.9)))
    decider.push(2, snapshot(worker(5, 2, 0.05, 0.4)))
    decider.retire(2)
    assert value(decider, "appliance_requests_total", code="200") == 15
    assert value(decider, "appliance_event_loop_lag_seconds_count") == 2
    assert value(decider, "appliance_open_streams") == 3
    decider.push(2, snapshot(worker(1, 1, 0.05, 0.1)))  # the new worker 2 counts from 0 again: no fall
    assert value(decider, "appliance_requests_total", code="200") == 16


def test_maintenance_counts_the_workers_requests_too() -> None:
    """Low-traffic windows read the gateway's request count (``appliance.app.requests_total``, what maintenance is
    given): with workers, the decider answers almost none itself."""
    from appliance.app import create_app, requests_total
    from appliance.context import context_of
    from appliance.settings import Settings
    from tests.doubles import FakeReplica

    registry = MergedRegistry()
    app = create_app(Settings(served_model_name="demo"), replicas=lambda: [FakeReplica("replica-0", "http://r0")],
                     registry=registry)
    gateway = context_of(app).gateway
    registry.push(1, snapshot(worker(10, 0, 0.01, 0.1)))
    registry.push(2, snapshot(worker(5, 0, 0.01, 0.1)))
    registry.retire(2)
    assert requests_total(gateway, registry)() == 15  # type: ignore[arg-type]

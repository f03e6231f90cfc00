"""The low-traffic gate: rate and queue over the whole look-back, from the gateway's own counters."""

from prometheus_client import CollectorRegistry, Counter

from appliance.maintenance.traffic import TrafficSampler, counter_total


class Source:
    def __init__(self) -> None:
        self.requests = 0.0
        self.queue = 0


def sampler(source: Source) -> TrafficSampler:
    return TrafficSampler(lambda: source.requests, lambda: source.queue, lookback_seconds=60,
                          max_request_rate=1.0, max_queue=0)


def run(gate: TrafficSampler, source: Source, seconds: int, *, rate: float, queue: int = 0, start: float = 0):
    for t in range(start, start + seconds + 1, 5):
        source.queue = queue
        gate.sample(t)
        source.requests += rate * 5
    return start + seconds


def test_not_low_until_the_look_back_is_covered():
    source = Source()
    gate = sampler(source)
    run(gate, source, 30, rate=0)
    assert not gate.verdict(30).low
    end = run(gate, source, 30, rate=0, start=35)
    assert gate.verdict(end).low


def test_rate_above_threshold_is_not_low_and_becomes_low_after_a_quiet_look_back():
    source = Source()
    gate = sampler(source)
    end = run(gate, source, 120, rate=3)
    verdict = gate.verdict(end)
    assert not verdict.low and verdict.request_rate > 1
    end = run(gate, source, 60, rate=0.2, start=end + 5)
    assert gate.verdict(end).low


def test_one_queued_request_in_the_look_back_is_not_low():
    source = Source()
    gate = sampler(source)
    end = run(gate, source, 60, rate=0)
    source.queue = 1
    gate.sample(end + 1)
    source.queue = 0
    gate.sample(end + 2)
    verdict = gate.verdict(end + 2)
    assert not verdict.low and "queue" in verdict.reason


def test_counter_total_sums_every_label_set():
    counter = Counter("appliance_requests", "x", ["route", "code"], registry=CollectorRegistry())
    counter.labels("completions", "200").inc(3)
    counter.labels("chat", "429").inc(2)
    assert counter_total(counter)() == 5

"""The low-traffic gate: the gateway's own request count and queue length, sampled in-process.

Prometheus may be absent (the embedded default) or lag a scrape interval behind; the gateway knows its traffic
exactly. Traffic is low only when, over the whole look-back, the request rate stayed at or under its threshold
and the queue never exceeded its own: a gateway that has not been up for a look-back yet does not know, and
says not low.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter


@dataclass(frozen=True)
class TrafficSample:
    at: float  # seconds, any monotonic-enough clock
    requests_total: float
    queue_length: int


@dataclass(frozen=True)
class TrafficVerdict:
    low: bool
    request_rate: float | None  # requests/s over the look-back; None until the look-back is covered
    max_queue: int
    reason: str


class TrafficSampler:
    def __init__(self, requests_total: Callable[[], float], queue_length: Callable[[], int], *,
                 lookback_seconds: float, max_request_rate: float, max_queue: int) -> None:
        self._requests_total = requests_total
        self._queue_length = queue_length
        self.lookback_seconds = lookback_seconds
        self.max_request_rate = max_request_rate
        self.max_queue = max_queue
        self._samples: deque[TrafficSample] = deque()

    def sample(self, now: float) -> None:
        self._samples.append(TrafficSample(now, self._requests_total(), self._queue_length()))
        # Keep one sample at or before the look-back's start: the rate is taken from it.
        while len(self._samples) > 1 and self._samples[1].at <= now - self.lookback_seconds:
            self._samples.popleft()

    def verdict(self, now: float) -> TrafficVerdict:
        if not self._samples:
            return TrafficVerdict(False, None, 0, "no traffic sample yet")
        oldest, newest = self._samples[0], self._samples[-1]
        peak_queue = max(s.queue_length for s in self._samples)
        if now - oldest.at < self.lookback_seconds:
            return TrafficVerdict(False, None, peak_queue,
                                  f"traffic observed for {now - oldest.at:.0f}s of a {self.lookback_seconds:.0f}s "
                                  "look-back")
        span = max(newest.at - oldest.at, 1e-9)
        rate = max(0.0, newest.requests_total - oldest.requests_total) / span
        if rate > self.max_request_rate:
            return TrafficVerdict(False, rate, peak_queue,
                                  f"request rate {rate:.2f}/s above {self.max_request_rate:.2f}/s")
        if peak_queue > self.max_queue:
            return TrafficVerdict(False, rate, peak_queue, f"queue reached {peak_queue} (limit {self.max_queue})")
        return TrafficVerdict(True, rate, peak_queue, f"request rate {rate:.2f}/s, queue at most {peak_queue}")


def counter_total(counter: Counter) -> Callable[[], float]:
    """Sum of a labelled counter's ``_total`` samples: every request the gateway answered, whatever its code."""

    def total() -> float:
        return sum(sample.value for metric in counter.collect() for sample in metric.samples
                   if sample.name.endswith("_total"))

    return total

"""What every collector shares: never raising out of ``collect()``, reporting its own health, and rates.

A scrape must always produce a page: one broken source (NVML gone after a driver update, an unreadable /proc
file) costs that source's metrics and shows up as ``appliance_collector_errors_total``, never as a failed scrape
that would blind every other metric with it. The health of all collectors is exported by one ``HealthCollector``
(a metric family may appear only once per page, so the collectors cannot each export their own copy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

NONE_SOURCE = "none"


@dataclass
class CollectorHealth:
    """Sources in use, failures and time spent per collector, filled in by the collectors as they run."""

    sources: dict[str, set[str]] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)

    def set_sources(self, collector: str, sources: Iterable[str]) -> None:
        """Replace a collector's sources with those that answered this scrape (``none`` when nothing did)."""
        self.sources[collector] = set(sources) or {NONE_SOURCE}

    def record_error(self, collector: str, source: str) -> None:
        key = (collector, source)
        first = key not in self.errors
        self.errors[key] = self.errors.get(key, 0) + 1
        # The first failure of a source is logged with its traceback; repeats every scrape would flood the log.
        log.log(logging.WARNING if first else logging.DEBUG, "collector %s: source %s failed", collector, source,
                exc_info=True)


class SafeCollector(Collector):
    """Base of the appliance's collectors: ``families()`` builds the page, ``collect()`` guarantees no raise."""

    name = "base"

    def __init__(self, health: CollectorHealth | None = None) -> None:
        self.health = health if health is not None else CollectorHealth()
        self._lock = threading.Lock()  # a sync /metrics route may scrape from two threads at once

    def families(self) -> Iterable[Metric]:
        raise NotImplementedError

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            started = time.perf_counter()
            try:
                page = list(self.families())
            except Exception:  # the scrape must survive any collector bug; the error counter says it happened
                self.health.record_error(self.name, "collect")
                page = []
            self.health.durations[self.name] = time.perf_counter() - started
        return page

    @contextmanager
    def source(self, source: str) -> Iterator[None]:
        """Run one source's reads; a failure is counted and logged, and the rest of the collector carries on."""
        try:
            yield
        except Exception:
            self.health.record_error(self.name, source)


class HealthCollector(Collector):
    """Exports the collectors' own health; registered last so that it reports the scrape it is part of."""

    def __init__(self, health: CollectorHealth) -> None:
        self.health = health

    def collect(self) -> Iterable[Metric]:
        sources = GaugeMetricFamily(
            "appliance_collector_source",
            "1 for each source a collector read this scrape (e.g. compute: nvml, gpm, cpu_time; none = no source "
            "answered, so its metrics are absent).", labels=["collector", "source"])
        for collector, names in sorted(self.health.sources.items()):
            for name in sorted(names):
                sources.add_metric([collector, name], 1.0)
        errors = CounterMetricFamily(
            "appliance_collector_errors", "Failed reads of a collector's source (the scrape still succeeds; that "
            "source's metrics are missing).", labels=["collector", "source"])
        for (collector, source), count in sorted(self.health.errors.items()):
            errors.add_metric([collector, source], count)
        durations = GaugeMetricFamily(
            "appliance_collector_duration_seconds", "Wall time each collector took in its latest collection, in "
            "seconds (its share of the /metrics response time).", labels=["collector"])
        for collector, seconds in sorted(self.health.durations.items()):
            durations.add_metric([collector], seconds)
        return [sources, errors, durations]


class ScrapeStart(Collector):
    """Registered first: makes shared snapshots (processes, NVML) read afresh once per scrape, so that every
    collector of one scrape sees the same readings and no scrape reuses the previous one's."""

    def __init__(self, *sources: Any) -> None:
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            source.invalidate()
        return []


class RateWindow:
    """Rate of a growing value between readings at least ``min_window`` apart.

    Readings closer than that repeat the last rate instead of dividing tiny deltas (a second scrape right after
    the first, or a human's curl between Prometheus scrapes). A value that goes down means its source restarted:
    the window starts over and nothing is reported until the next full window.
    """

    def __init__(self, min_window: float) -> None:
        self.min_window = min_window
        self._base: tuple[float, float] | None = None
        self._rate: float | None = None

    def update(self, at: float, value: float) -> float | None:
        if self._base is None or value < self._base[1] or at < self._base[0]:
            self._base, self._rate = (at, value), None
            return None
        elapsed = at - self._base[0]
        if elapsed < self.min_window:
            return self._rate
        self._rate = (value - self._base[1]) / elapsed
        self._base = (at, value)
        return self._rate


class KeyedRates:
    """One ``RateWindow`` per key (replica, process role...), forgetting keys that stopped being updated."""

    def __init__(self, min_window: float) -> None:
        self.min_window = min_window
        self._windows: dict[object, RateWindow] = {}

    def update(self, key: object, at: float, value: float) -> float | None:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = RateWindow(self.min_window)
        return window.update(at, value)

    def retain(self, keys: Iterable[object]) -> None:
        """Drop the windows of keys not seen this scrape, so departed replicas do not leak state."""
        alive = set(keys)
        for key in [k for k in self._windows if k not in alive]:
            del self._windows[key]


class MonotonicCounter:
    """Keeps a summed counter from going backwards while its owner (identified by ``generation``) lives.

    A replica's CPU seconds are a sum over its live processes plus what their parents reaped; a short-lived
    child that nobody waited for would make the sum dip, which Prometheus would read as a counter reset and
    turn into a spike in rate(). Within one generation (the launcher's pid) the counter holds its high-water
    mark; a new generation (a restart) may start lower, which is a genuine reset.
    """

    def __init__(self) -> None:
        self._high: dict[str, tuple[object, float]] = {}

    def value(self, key: str, generation: object, raw: float) -> float:
        previous = self._high.get(key)
        if previous is not None and previous[0] == generation and previous[1] > raw:
            return previous[1]
        self._high[key] = (generation, raw)
        return raw


def ratio(value: float, denominator: float, *, clamp: bool = True) -> float | None:
    """``value / denominator`` as a 0..1 ratio; None where the denominator is not positive."""
    if denominator <= 0:
        return None
    result = value / denominator
    return min(1.0, max(0.0, result)) if clamp else result


def replica_gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    """A gauge family of one series per engine replica: labelled ``replica``, then ``labels``."""
    return GaugeMetricFamily(name, documentation, labels=["replica", *labels])


def replica_counter(name: str, documentation: str, *labels: str) -> CounterMetricFamily:
    """A counter family of one series per engine replica: labelled ``replica``, then ``labels``."""
    return CounterMetricFamily(name, documentation, labels=["replica", *labels])


Clock = Callable[[], float]

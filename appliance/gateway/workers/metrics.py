"""The workers' metrics in the decider's exposition: one /metrics for the whole gateway, every series summed over
the processes that count it.

A worker collects its own registry every ``PUSH_SECONDS`` and sends it (``Metrics``); the decider's registry
(``MergedRegistry``) adds each family's samples to its own family of the same name, label set by label set:
counters and histograms sum (requests, tokens, latencies: a histogram's buckets add up to the fleet's
distribution), gauges sum (what they count adds up: open streams, breakers open in each worker) but for a
process's own ratio (``BUSIEST``: the highest is the gateway's), and a ``_created`` sample keeps the earliest. A
worker that goes away leaves its counters and histograms behind (``retire``), as prometheus-client's multiprocess
mode keeps a dead process's files: a sum that fell when a worker restarted would read as a counter reset. Its
gauges go with it.

Why not prometheus-client's multiprocess mode: it sees no custom collector (the breakers', read at scrape time),
needs its directory set before the first metric is made in every process, and labels each gauge by pid unless
each one is told otherwise; summing what the workers' own registries say needs none of that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

PUSH_SECONDS = 1.0  # how often a worker sends its metrics (a scrape sees them at most this old)
KEPT_TYPES = ("counter", "histogram", "summary")  # what a worker that left leaves behind
BUSIEST = frozenset({"appliance_gateway_cpu_ratio"})  # gauges of one process each: the highest is the gateway's

Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]  # name, help, type, unit, samples
SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def snapshot(registry: CollectorRegistry) -> bytes:
    """A registry's families now, encoded for the decider."""
    families: list[Family] = [(metric.name, metric.documentation, metric.type, metric.unit,
                               [(sample.name, sample.labels, sample.value) for sample in metric.samples])
                              for metric in registry.collect()]
    return msgspec.msgpack.encode(families)


def decode(payload: bytes) -> list[Family]:
    return [tuple(family) for family in msgspec.msgpack.decode(payload)]


class MergedRegistry(CollectorRegistry):
    """The decider's registry: its own collectors, with each worker's last snapshot (and what workers that left
    counted) added in."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: dict[int, list[Family]] = {}
        self.retired: dict[str, tuple[str, str, str, dict[SampleKey, float]]] = {}

    def push(self, worker: int, payload: bytes) -> None:
        self.workers[worker] = decode(payload)

    def others_total(self, sample_name: str) -> float:
        """The workers' (and departed workers') samples called ``sample_name``, summed, without collecting this
        process's own collectors: for readers that add it to their own count often (maintenance's traffic)."""
        live = sum(value for families in self.workers.values() for _name, _doc, _kind, _unit, samples in families
                   for name, _labels, value in samples if name == sample_name)
        return live + sum(value for _doc, _kind, _unit, samples in self.retired.values()
                          for (name, _labels), value in samples.items() if name == sample_name)

    def retire(self, worker: int) -> None:
        """The worker left: its counters and histograms stay in the sums, its gauges go."""
        for name, documentation, kind, unit, samples in self.workers.pop(worker, []):
            if kind not in KEPT_TYPES:
                continue
            kept = self.retired.setdefault(name, (documentation, kind, unit, {}))[3]
            for sample_name, labels, value in samples:
                _add(kept, (sample_name, tuple(sorted(labels.items()))), value)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, tuple[Metric, dict[SampleKey, float]]] = {}
        for metric in super().collect():
            values: dict[SampleKey, float] = {}
            for sample in metric.samples:
                _add(values, (sample.name, tuple(sorted(sample.labels.items()))), sample.value)
            merged[metric.name] = (metric, values)
        sources: list[Iterable[Family]] = [*self.workers.values(), [
            (name, documentation, kind, unit, [(key[0], dict(key[1]), value) for key, value in samples.items()])
            for name, (documentation, kind, unit, samples) in self.retired.items()]]
        for families in sources:
            for name, documentation, kind, unit, samples in families:
                if name not in merged:
                    merged[name] = (Metric(name, documentation, kind, unit), {})
                values = merged[name][1]
                for sample_name, labels, value in samples:
                    key = (sample_name, tuple(sorted(labels.items())))
                    if name in BUSIEST:
                        values[key] = max(values.get(key, value), value)
                    else:
                        _add(values, key, value)
        for metric, values in merged.values():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [Sample(name, dict(labels), value) for (name, labels), value in values.items()]
            yield out


def _add(values: dict[SampleKey, float], key: SampleKey, value: float) -> None:
    """Sum, but the earliest of a ``_created`` timestamp."""
    before = values.get(key)
    if before is None:
        values[key] = value
    elif key[0].endswith("_created"):
        values[key] = min(before, value)
    elif not (math.isnan(before) or math.isnan(value)):
        values[key] = before + value


def total(registry: CollectorRegistry, name: str) -> float:
    """The sum of every sample called ``name`` (``appliance_requests_total``): for readers that need the whole
    gateway's count, not one process's."""
    return sum(sample.value for metric in registry.collect() for sample in metric.samples if sample.name == name)

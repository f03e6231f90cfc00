"""Reads memory and KV-cache occupancy from the appliance's Prometheus ``/metrics`` during a soak.

A leak shows as memory that keeps growing at steady load; a KV-block leak as occupancy that keeps growing at
steady concurrency. Which metric carries each differs between the appliance's gateway (its collectors export
per-replica RSS, device memory and KV usage) and a bare vLLM server, so each series is found by a list of
candidate names (first present wins, overridable), and the report names the metric it used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Series:
    """One soak series read from /metrics: candidate metric names (first present wins) and how to aggregate
    several series of it (replicas, devices): summed for bytes, worst (max) for occupancy ratios."""

    key: str
    candidates: tuple[str, ...]
    aggregate: str  # "sum" | "max"


# The appliance's own collectors first (they cover every replica), then what a bare vLLM server exports.
SERIES = (
    Series("memory_bytes", ("appliance_engine_resident_memory_bytes", "process_resident_memory_bytes"), "sum"),
    Series("device_memory_bytes", ("appliance_engine_gpu_memory_bytes", "appliance_gpu_memory_used_bytes"), "sum"),
    Series("kv_usage", ("appliance_engine_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
                        "vllm:gpu_cache_usage_perc"), "max"),
)
SERIES_KEYS = tuple(s.key for s in SERIES)
SKIP_SUFFIXES = ("_created", "_bucket", "_count", "_sum", "_total")


@dataclass(frozen=True)
class Reading:
    """One scrape: seconds since the run's start; per series key its value and the metric it came from."""

    t: float
    values: dict[str, float | None]
    metrics: dict[str, str | None]


def parse_samples(text: str) -> dict[str, list[float]]:
    """Sample values by sample name, for gauges and untyped samples (not histogram/counter parts)."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(SKIP_SUFFIXES):
                continue
            samples.setdefault(sample.name, []).append(float(sample.value))
    return samples


def pick(samples: dict[str, list[float]], candidates: Iterable[str], explicit: str | None = None) -> str | None:
    """The metric to use: ``explicit`` when given (None if absent), else the first candidate present."""
    if explicit:
        return explicit if explicit in samples else None
    return next((name for name in candidates if name in samples), None)


def _aggregate(series: Series, values: list[float]) -> float:
    if series.aggregate == "sum":
        return sum(values)
    worst = max(values)
    return worst / 100.0 if worst > 1.0 else worst  # a percentage (0..100) becomes a ratio


def read(text: str, t: float, overrides: dict[str, str] | None = None) -> Reading:
    """Extract every series from one /metrics body; ``overrides`` maps series keys to metric names."""
    samples = parse_samples(text)
    values: dict[str, float | None] = {}
    metrics: dict[str, str | None] = {}
    for series in SERIES:
        name = pick(samples, series.candidates, (overrides or {}).get(series.key))
        metrics[series.key] = name
        values[series.key] = _aggregate(series, samples[name]) if name else None
    return Reading(t, values, metrics)


@dataclass
class MetricsPoller:
    """Scrapes ``url`` every ``interval_s`` until stopped; scrape failures are counted, not fatal."""

    url: str
    interval_s: float
    clock: Callable[[], float]
    overrides: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # bearer credential: /metrics requires one where the appliance sets metrics_token
    readings: list[Reading] = field(default_factory=list)
    failures: int = 0
    last_error: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(10.0, self.interval_s)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                await self.scrape_once(session)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    async def scrape_once(self, session: aiohttp.ClientSession) -> Reading | None:
        try:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            async with session.get(self.url, headers=headers) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await resp.text()
            reading = read(text, self.clock(), self.overrides)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        self.readings.append(reading)
        return reading

    def summary(self) -> dict[str, object]:
        used = {key: next((r.metrics[key] for r in self.readings if r.metrics.get(key)), None) for key in SERIES_KEYS}
        return {"url": self.url, "scrapes": len(self.readings), "failures": self.failures,
                "last_error": self.last_error, "metrics": used}

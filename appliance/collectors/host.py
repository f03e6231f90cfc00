"""Host CPU pressure, and the CPU saturation of the processes that feed the accelerator.

The seed's field notes saw GPUs at 40% instead of 90% because CPU threads starved them: tokenisation,
detokenisation, sampling and scheduling run in Python processes (vLLM's API server and engine core) that use
about one core each whatever the GPU does. So the CPU use of each replica is split by process role, and each
role's ratio is over the CPU it can actually use:

- ``api_server`` and (on GPU hosts) ``engine_core`` and ``worker``: one core per process (their hot loop holds
  the GIL), so 1 means that process is saturated;
- on CPU hosts ``engine_core`` and ``worker`` run the model on OpenMP threads over the replica's pinned cores,
  so their ratio is over those cores (the same as the replica's utilisation);
- ``other``: the launcher and helpers, one core per process.

Ratios are clamped to 0..1 (helper threads can push a GIL-bound process slightly past one core).
``appliance_replica_gpu_utilization_ratio`` (compute) is the number to compare them with: a high API-server
ratio with a low GPU utilisation is a CPU-starved GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.collectors.base import Clock, CollectorHealth, KeyedRates, RateWindow, SafeCollector, ratio
from appliance.collectors.procs import ENGINE_CORE, WORKER, ProcessTable, ReplicaProcs

PSI_CPU = Path("/proc/pressure/cpu")


def role_capacity(procs: ReplicaProcs, role: str, processes: int) -> int:
    """Cores a role can use: the placement's cores for CPU model compute, else one core per process."""
    if procs.device == "cpu" and role in (ENGINE_CORE, WORKER):
        return procs.cores
    return processes


def psi_some_seconds(path: Path = PSI_CPU) -> float | None:
    """Total time some runnable task waited for a CPU (pressure stall information), in seconds."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                return int(fields["total"]) / 1e6  # microseconds
    except (OSError, KeyError, ValueError):
        return None
    return None


class GatewayCpu:
    """``appliance_gateway_cpu_ratio`` of this process: its CPU time over one core, between scrapes. A gateway
    with workers (``gateway.workers``) exports it from each process, and the decider's /metrics keeps the busiest
    one's (``appliance.gateway.workers.metrics``): every process runs one event loop, so the first to reach 1 is
    the bottleneck."""

    def __init__(self, min_window: float = 5.0, clock: Clock = time.monotonic) -> None:
        self._rate = RateWindow(min_window)
        self._clock = clock
        self._self = psutil.Process()

    def family(self, now: float | None = None) -> Metric:
        times = self._self.cpu_times()
        rate = self._rate.update(self._clock() if now is None else now, times.user + times.system)
        family = GaugeMetricFamily(
            "appliance_gateway_cpu_ratio", "CPU time of the gateway process over one core (0..1): its event loop "
            "is one thread, so near 1 means the gateway itself is the bottleneck. With gateway.workers, the "
            "busiest of the decider and its workers.")
        if rate is not None:
            family.add_metric([], min(1.0, max(0.0, rate)))
        return family

    def collect(self) -> Iterable[Metric]:
        yield self.family()


class HostCollector(SafeCollector):
    name = "host"

    def __init__(self, table: ProcessTable, *, min_window: float = 5.0, psi_path: Path = PSI_CPU,
                 health: CollectorHealth | None = None, clock: Clock = time.monotonic) -> None:
        super().__init__(health)
        self._table = table
        self._clock = clock
        self._psi_path = psi_path
        self._host_busy = RateWindow(min_window)
        self._gateway = GatewayCpu(min_window, clock)
        self._roles = KeyedRates(min_window)
        self._self = psutil.Process()

    def families(self) -> Iterable[Metric]:
        sources: set[str] = set()
        page: list[Metric] = []
        now = self._clock()
        with self.source("host_cpu"):
            page += self._host_cpu(now)
            sources.add("host_cpu")
        with self.source("psi"):
            stalled = psi_some_seconds(self._psi_path)
            if stalled is not None:
                page.append(CounterMetricFamily(
                    "appliance_host_cpu_pressure_stalled_seconds", "Time some runnable task waited for a CPU "
                    "(Linux PSI cpu 'some'), in seconds; its rate is the fraction of time the host was short of CPU.",
                    value=stalled))
                sources.add("psi")
        with self.source("gateway_cpu"):
            page.append(self._gateway.family(now))
            sources.add("gateway_cpu")
        with self.source("process_cpu"):
            family = self._process_family(now)
            page.append(family)
            if family.samples:
                sources.add("process_cpu")
        self.health.set_sources(self.name, sources)
        return page

    def _host_cpu(self, now: float) -> list[Metric]:
        cores = psutil.cpu_count() or 1
        # Busy time from the fields that only grow. Not "total - idle - iowait": Linux's iowait (and with it the
        # total) can go backwards, which a rate window reads as a restart and answers with no value (seen here
        # in 2 of 3 test runs while other work wrote files).
        times = psutil.cpu_times()
        busy = sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))
        busy_rate = self._host_busy.update(now, busy)
        utilisation = GaugeMetricFamily(
            "appliance_host_cpu_utilization_ratio", "Fraction (0..1) of all host CPU time that was busy (not idle "
            "or iowait) between scrapes at least rate_min_window_seconds apart.")
        if busy_rate is not None:
            utilisation.add_metric([], min(1.0, max(0.0, busy_rate / cores)))
        load = GaugeMetricFamily("appliance_host_load_per_core", "Load average (runnable + uninterruptible tasks) "
                                 "per logical core over 1, 5 and 15 minutes; above 1 means tasks queue for CPU.",
                                 labels=["window"])
        for window, value in zip(("1m", "5m", "15m"), os.getloadavg(), strict=True):
            load.add_metric([window], value / cores)
        return [utilisation, load, GaugeMetricFamily("appliance_host_cpu_cores", "Logical CPU cores of the host.",
                                                     value=cores)]

    def _process_family(self, now: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "appliance_engine_process_cpu_ratio", "CPU use of a replica's processes by role (api_server, "
            "engine_core, worker, other) over the CPU that role can use (0..1): one core per process, or the "
            "replica's cores for CPU-host model compute.", labels=["replica", "process"])
        keys = []
        for name, procs in sorted(self._table.snapshot().items()):
            for role, members in sorted(procs.by_role().items()):
                key = (name, procs.root_pid, role)
                keys.append(key)
                rate = self._roles.update(key, now, sum(p.cpu_seconds for p in members))
                value = ratio(rate, role_capacity(procs, role, len(members))) if rate is not None else None
                if value is not None:
                    family.add_metric([name, role], value)
        self._roles.retain(keys)
        return family

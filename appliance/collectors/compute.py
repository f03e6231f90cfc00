"""Compute utilisation per device: GPUs through NVML (and GPM where the GPU has it), CPU replicas through the
CPU time of their process tree.

On a GPU host the question is "how busy is each GPU, and is it really computing": NVML's utilisation (time a
kernel ran), GPM's SM and tensor-core activity, temperature and power (a throttling GPU is slow for no visible
reason), device memory, and how much of it each replica's processes hold. On a CPU host the engines compute on
their pinned cores, so the utilisation of a replica is the CPU time of its processes over the time its cores
had: ``delta CPU seconds / (delta wall seconds x cores in its placement)``.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.collectors.base import (
    Clock,
    CollectorHealth,
    KeyedRates,
    MonotonicCounter,
    SafeCollector,
    ratio,
    replica_counter,
    replica_gauge,
)
from appliance.collectors.nvml import GpuReading, NvmlSource
from appliance.collectors.procs import ProcessTable

if TYPE_CHECKING:
    from appliance.engine.contract import Replica

# (attribute of GpuReading or GPM key, metric name, help) of the per-GPU gauges.
GPU_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("utilization", "appliance_gpu_utilization_ratio",
     "Fraction of time (0..1) at least one kernel ran on the GPU over NVML's last sample period; 1 does not "
     "mean the GPU is full (see appliance_gpu_sm_activity_ratio)."),
    ("memory_used_bytes", "appliance_gpu_memory_used_bytes", "Device memory in use on the GPU, in bytes."),
    ("memory_total_bytes", "appliance_gpu_memory_total_bytes", "Device memory of the GPU, in bytes."),
    ("temperature_celsius", "appliance_gpu_temperature_celsius", "GPU core temperature, in degrees Celsius."),
    ("power_watts", "appliance_gpu_power_watts", "GPU power draw, in watts."),
    ("power_limit_watts", "appliance_gpu_power_limit_watts",
     "Enforced power limit of the GPU, in watts; draw near it means power capping (slower clocks)."),
)
GPM_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("sm_activity", "appliance_gpu_sm_activity_ratio",
     "GPM: fraction (0..1) of the GPU's SMs that were busy since the previous scrape."),
    ("tensor_activity", "appliance_gpu_tensor_activity_ratio",
     "GPM: fraction of time (0..1) the SMs ran tensor-core instructions since the previous scrape."),
    ("dram_bandwidth", "appliance_gpu_dram_bandwidth_utilization_ratio",
     "GPM: DRAM bandwidth used over the theoretical maximum (0..1) since the previous scrape."),
)


class ComputeCollector(SafeCollector):
    name = "compute"

    def __init__(self, table: ProcessTable, nvml: NvmlSource, replicas: Callable[[], Sequence[Replica]], *,
                 min_window: float = 5.0, health: CollectorHealth | None = None,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(health)
        self._table = table
        self._nvml = nvml
        self._replicas = replicas
        self._clock = clock
        self._cpu_rates = KeyedRates(min_window)
        self._cpu_counter = MonotonicCounter()

    def families(self) -> Iterable[Metric]:
        sources: set[str] = set()
        page: list[Metric] = []
        with self.source("nvml"):
            readings = self._nvml.readings()
            for failure in self._nvml.failures:
                self.health.record_error(self.name, f"nvml_{failure}")
            if readings:
                sources.add("nvml")
                page += self._gpu_families(readings)
                if self._nvml.gpm_in_use:
                    sources.add("gpm")
        with self.source("cpu_time"):
            cpu = self._cpu_families()
            if cpu:
                sources.add("cpu_time")
                page += cpu
        self.health.set_sources(self.name, sources)
        return page

    def _gpu_families(self, readings: list[GpuReading]) -> list[Metric]:
        info = GaugeMetricFamily("appliance_gpu_info", "1 per GPU, labelled with its NVML index and model name.",
                                 labels=["gpu", "name"])
        families: list[Metric] = [info]
        for reading in readings:
            info.add_metric([str(reading.index), reading.name], 1.0)
        for attribute, metric, doc in GPU_GAUGES:
            families.append(_per_gpu(metric, doc, readings, operator.attrgetter(attribute)))
        for key, metric, doc in GPM_GAUGES:
            if any(key in r.gpm for r in readings):
                families.append(_per_gpu(metric, doc, readings, _gpm_value(key)))
        families += self._replica_gpu_families(readings)
        return families

    def _replica_gpu_families(self, readings: list[GpuReading]) -> list[Metric]:
        """GPU memory held by each replica's processes, and each replica's mean GPU utilisation."""
        owners = self._table.owners()
        held = replica_gauge(
            "appliance_engine_gpu_memory_bytes", "Device memory held by a replica's processes on each GPU, in "
            "bytes (NVML's per-process accounting).", "gpu")
        for reading in readings:
            per_replica: dict[str, int] = {}
            for pid, used in reading.processes:
                if pid in owners and used is not None:
                    per_replica[owners[pid]] = per_replica.get(owners[pid], 0) + used
            for owner, used in sorted(per_replica.items()):
                held.add_metric([owner, str(reading.index)], used)
        util = replica_gauge(
            "appliance_replica_gpu_utilization_ratio", "Mean NVML utilisation (0..1) of the GPUs in a replica's "
            "placement; compare with appliance_engine_process_cpu_ratio to spot a CPU-starved GPU.")
        by_index = {r.index: r.utilization for r in readings if r.utilization is not None}
        for replica in self._replicas():
            gpus = _placement_gpus(replica)
            values = [by_index[g] for g in gpus if g in by_index]
            if values:
                util.add_metric([replica.name], sum(values) / len(values))
        return [held, util]

    def _cpu_families(self) -> list[Metric]:
        snapshot = self._table.snapshot()
        if not snapshot:
            return []
        now = self._clock()
        seconds = replica_counter(
            "appliance_engine_cpu_seconds", "CPU time (user + system) used by a replica's whole process tree "
            "since it started, in seconds; resets when the replica restarts.")
        utilisation = replica_gauge(
            "appliance_engine_cpu_utilization_ratio", "CPU time of a replica's process tree over the time its "
            "cores had (0..1): delta CPU seconds / (delta wall seconds x cores in its placement), between scrapes "
            "at least rate_min_window_seconds apart.")
        for name, procs in sorted(snapshot.items()):
            total = self._cpu_counter.value(name, procs.root_pid, procs.cpu_seconds)
            seconds.add_metric([name], total)
            rate = self._cpu_rates.update((name, procs.root_pid), now, total)
            value = ratio(rate, procs.cores) if rate is not None else None
            if value is not None:
                utilisation.add_metric([name], value)
        self._cpu_rates.retain((name, procs.root_pid) for name, procs in snapshot.items())
        return [seconds, utilisation]


def _per_gpu(metric: str, doc: str, readings: list[GpuReading],
             value_of: Callable[[GpuReading], float | int | None]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, doc, labels=["gpu"])
    for reading in readings:
        value = value_of(reading)
        if value is not None:
            family.add_metric([str(reading.index)], float(value))
    return family


def _gpm_value(key: str) -> Callable[[GpuReading], float | None]:
    """A reading's GPM metric ``key``; a function of its own, so each one keeps its key."""
    return lambda reading: reading.gpm.get(key)


def _placement_gpus(replica: Replica) -> tuple[int, ...]:
    return tuple(replica.placement.gpus) if replica.placement is not None else ()

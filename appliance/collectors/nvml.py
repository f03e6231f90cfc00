"""NVML readings of every GPU, taken once per scrape and shared by the compute and roofline collectors.

NVML is optional: on CPU hosts the library or the driver is absent and ``readings()`` is empty; init is retried
every ``retry_seconds`` (a driver can appear after the gateway starts, e.g. a container started before it).
Every NVML call is guarded separately: a GPU or driver that does not support one reading (power on some
boards, GPM before Hopper) loses that reading only.

GPM (GPU performance monitoring, Hopper and later) gives what plain utilisation cannot: plain "GPU utilisation"
is the fraction of time *any* kernel ran, so a GPU running one tiny kernel all the time reads 100%. GPM's SM
activity, tensor-core activity and DRAM bandwidth utilisation are computed from two samples; the previous
scrape's sample is kept, so each scrape reports the activity since the one before.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from appliance.collectors.base import Clock

log = logging.getLogger(__name__)

# GPM metric ids (pynvml's NVML_GPM_METRIC_*), by the name the collectors export them under.
GPM_METRICS = {"sm_activity": 2, "tensor_activity": 5, "dram_bandwidth": 10}


@dataclass
class GpuReading:
    """One GPU at one scrape; fields a GPU does not support stay None."""

    index: int
    name: str = ""
    utilization: float | None = None  # ratio of time a kernel was running
    memory_utilization: float | None = None  # ratio of time device memory was read or written
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    peak_bandwidth_bytes_per_second: float | None = None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used GPU memory bytes)
    gpm: dict[str, float] = field(default_factory=dict)  # GPM_METRICS names -> ratio


class _Gpm:
    """The GPM sample pair of one GPU: the previous scrape's sample and a buffer for the current one."""

    def __init__(self, nvml: ModuleType) -> None:
        self.previous = nvml.nvmlGpmSampleAlloc()
        self.current = nvml.nvmlGpmSampleAlloc()
        self.previous_at: float | None = None
        self.values: dict[str, float] = {}


class NvmlSource:
    """Lazily initialised NVML with per-scrape cached readings."""

    def __init__(self, *, loader: Callable[[], ModuleType] | None = None, retry_seconds: float = 300.0,
                 gpm_min_interval: float = 1.0, ttl: float = 0.5, clock: Clock = time.monotonic) -> None:
        self._loader = loader or (lambda: importlib.import_module("pynvml"))
        self._retry = retry_seconds
        self._gpm_min_interval = gpm_min_interval
        self._ttl = ttl
        self._clock = clock
        self._nvml: ModuleType | None = None
        self._handles: list[Any] = []
        self._gpm: dict[int, _Gpm | None] = {}
        self._static: dict[int, tuple[str, float | None]] = {}
        self._tried_at = -float("inf")
        self._readings: list[GpuReading] = []
        self._taken_at = -float("inf")
        self.failures: list[str] = []  # reads that failed in the latest snapshot (for the error counter)
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._ensure_init()

    def invalidate(self) -> None:
        self._taken_at = -float("inf")

    def readings(self) -> list[GpuReading]:
        with self._lock:
            now = self._clock()
            if now - self._taken_at >= self._ttl:
                self._taken_at = now
                self.failures = []
                ready = self._ensure_init()
                self._readings = [self._read(i, h, now) for i, h in enumerate(self._handles)] if ready else []
            return self._readings

    @property
    def gpm_in_use(self) -> bool:
        return any(reading.gpm for reading in self._readings)

    def _ensure_init(self) -> bool:
        if self._nvml is not None:
            return True
        now = self._clock()
        if now - self._tried_at < self._retry:
            return False
        self._tried_at = now
        try:
            nvml = self._loader()
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no library, no driver, no permission: all mean "no NVML here"
            log.debug("NVML unavailable: %s", exc)
            return False
        self._nvml = nvml
        return True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call; "not supported" is silent, other failures are remembered for the error counter."""
        try:
            return fn(*args)
        except Exception as exc:
            not_supported = getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
            if getattr(exc, "value", None) != not_supported:
                self.failures.append(what)
            return None

    def _read(self, index: int, handle: Any, now: float) -> GpuReading:
        nvml = self._nvml
        assert nvml is not None
        name, peak = self._static_of(index, handle)
        reading = GpuReading(index, name=name, peak_bandwidth_bytes_per_second=peak)
        rates = self._call("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None:
            reading.utilization, reading.memory_utilization = rates.gpu / 100.0, rates.memory / 100.0
        memory = self._call("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            reading.memory_used_bytes, reading.memory_total_bytes = int(memory.used), int(memory.total)
        reading.temperature_celsius = self._call("temperature", nvml.nvmlDeviceGetTemperature, handle,
                                                 getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        power = self._call("power", nvml.nvmlDeviceGetPowerUsage, handle)
        reading.power_watts = power / 1000.0 if power is not None else None
        limit = self._call("power", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        reading.power_limit_watts = limit / 1000.0 if limit is not None else None
        processes = self._call("processes", nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        reading.processes = [(int(p.pid), _used_memory(p)) for p in processes]
        reading.gpm = self._read_gpm(index, handle, now)
        return reading

    def _static_of(self, index: int, handle: Any) -> tuple[str, float | None]:
        """Name and peak memory bandwidth never change; read them once per GPU."""
        if index not in self._static:
            nvml = self._nvml
            assert nvml is not None
            name = self._call("name", nvml.nvmlDeviceGetName, handle) or ""
            name = name.decode() if isinstance(name, bytes) else str(name)
            bus_bits = self._call("bus_width", nvml.nvmlDeviceGetMemoryBusWidth, handle)
            clock_mhz = self._call("memory_clock", nvml.nvmlDeviceGetMaxClockInfo, handle,
                                   getattr(nvml, "NVML_CLOCK_MEM", 2))
            self._static[index] = (name, peak_bandwidth(bus_bits, clock_mhz))
        return self._static[index]

    def _read_gpm(self, index: int, handle: Any, now: float) -> dict[str, float]:
        gpm = self._gpm_of(index, handle)
        if gpm is None:
            return {}
        nvml = self._nvml
        assert nvml is not None  # GPM was found through it
        if self._call("gpm", nvml.nvmlGpmSampleGet, handle, gpm.current) is None:
            return gpm.values
        if gpm.previous_at is not None and now - gpm.previous_at < self._gpm_min_interval:
            return gpm.values  # too close to the previous sample: keep it, report the last values
        if gpm.previous_at is not None:
            gpm.values = self._gpm_values(gpm) or gpm.values
        gpm.previous, gpm.current = gpm.current, gpm.previous
        gpm.previous_at = now
        return gpm.values

    def _gpm_of(self, index: int, handle: Any) -> _Gpm | None:
        if index not in self._gpm:
            nvml = self._nvml
            support = self._call("gpm", getattr(nvml, "nvmlGpmQueryDeviceSupport", _unsupported), handle)
            self._gpm[index] = None
            if support is not None and getattr(support, "isSupportedDevice", False):
                self._gpm[index] = self._call("gpm", _Gpm, nvml)
        return self._gpm[index]

    def _gpm_values(self, gpm: _Gpm) -> dict[str, float]:
        nvml = self._nvml
        assert nvml is not None
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = gpm.previous, gpm.current
        for slot, metric_id in enumerate(GPM_METRICS.values()):
            request.metrics[slot].metricId = metric_id
        if self._call("gpm", nvml.nvmlGpmMetricsGet, request) is None:
            return {}
        values = {}
        for slot, name in enumerate(GPM_METRICS):
            metric = request.metrics[slot]
            if metric.nvmlReturn == 0:  # NVML_SUCCESS
                values[name] = min(1.0, max(0.0, metric.value / 100.0))
        return values


def peak_bandwidth(bus_width_bits: int | None, max_memory_clock_mhz: int | None) -> float | None:
    """Theoretical DRAM bandwidth: bus width x max memory clock x 2 (double data rate), in bytes/s.

    Checks: H100 SXM 5120 bit x 2619 MHz -> 3.35 TB/s; A100 40GB 5120 x 1215 -> 1.56 TB/s; L4 192 x 6251 ->
    300 GB/s, as their datasheets say.
    """
    if not bus_width_bits or not max_memory_clock_mhz:
        return None
    return bus_width_bits / 8 * max_memory_clock_mhz * 1e6 * 2


def _used_memory(process: Any) -> int | None:
    used = getattr(process, "usedGpuMemory", None)
    return int(used) if used is not None else None


def _unsupported(_handle: Any) -> None:
    return None

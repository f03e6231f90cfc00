"""The gateway's resource collectors: compute, bandwidth (MBU/MFU), KV occupancy and queue length, memory and
fragmentation, host CPU pressure. All read live state when Prometheus scrapes; none runs a background thread.

This package also holds the vLLM plugin that every engine process imports (``engine_plugin``), and Python
imports a package before its module: so this file imports nothing heavy at module level. ``register_collectors``
imports the collectors when the gateway calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.collectors.engine_plugin import ENGINE_STATS_DIR_ENV, ENGINE_STATS_INTERVAL_ENV

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from appliance.collectors.probes import HostPeaks
    from appliance.collectors.settings import CollectorSettings
    from appliance.engine.contract import Replica
    from appliance.engine.load import EngineLoad

__all__ = ["ENGINE_STATS_DIR_ENV", "ENGINE_STATS_INTERVAL_ENV", "engine_stats_dir", "engine_stats_env",
           "register_collectors"]

log = logging.getLogger(__name__)


def engine_stats_dir(settings: CollectorSettings, state_dir: Path) -> Path:
    """Where the engine plugin writes and the memory collector reads allocator statistics."""
    return settings.engine_stats_dir if settings.engine_stats_dir is not None else state_dir / "engine-stats"


def engine_stats_env(settings: CollectorSettings, state_dir: Path) -> dict[str, str]:
    """Environment for each engine process that switches the allocator-statistics plugin on."""
    if not settings.enabled:
        return {}
    return {ENGINE_STATS_DIR_ENV: str(engine_stats_dir(settings, state_dir).resolve()),
            ENGINE_STATS_INTERVAL_ENV: str(settings.engine_stats_interval_seconds)}


def register_collectors(
    registry: CollectorRegistry,
    *,
    replicas: Callable[[], Sequence[Replica]],
    router_load: Callable[[], Mapping[str, EngineLoad]],
    settings: CollectorSettings,
    model_dir: Path | None,
    state_dir: Path,
) -> None:
    """Register every collector on ``registry``.

    ``replicas`` returns the supervisor's replicas (``appliance.engine.replica.Replica``), ``router_load`` the
    router's latest ``EngineLoad`` per replica name. Unless both peaks are configured (or ``probe_bandwidth``
    is off), this measures the host's memory bandwidth and FLOP/s first, which takes a fraction of a second:
    call it before the engines start, so the probe and the engines do not disturb each other.
    """
    if not settings.enabled:
        return
    from appliance.collectors.base import CollectorHealth, HealthCollector, ScrapeStart
    from appliance.collectors.compute import ComputeCollector
    from appliance.collectors.engine import EngineCollector
    from appliance.collectors.host import HostCollector
    from appliance.collectors.memory import AllocatorStatsReader, MemoryCollector
    from appliance.collectors.nvml import NvmlSource
    from appliance.collectors.procs import ProcessTable
    from appliance.collectors.roofline import RooflineCollector

    health = CollectorHealth()
    table = ProcessTable(replicas, tree_refresh_seconds=settings.process_tree_refresh_seconds)
    nvml = NvmlSource()
    window = settings.rate_min_window_seconds
    reader = AllocatorStatsReader(engine_stats_dir(settings, state_dir),
                                  max_age_seconds=settings.engine_stats_max_age_seconds)
    peaks = _host_peaks(settings, replicas, nvml.available)
    collectors = [
        ScrapeStart(table, nvml),
        EngineCollector(replicas, router_load, max_age_seconds=settings.engine_load_max_age_seconds, health=health),
        ComputeCollector(table, nvml, replicas, min_window=window, health=health),
        RooflineCollector(replicas, router_load, settings, model_dir=model_dir, nvml=nvml, host_peaks=peaks,
                          health=health),
        MemoryCollector(table, reader, health=health),
        HostCollector(table, min_window=window, health=health),
        HealthCollector(health),  # last: it reports the durations and sources of this very scrape
    ]
    for collector in collectors:
        registry.register(collector)


def _host_peaks(settings: CollectorSettings, replicas: Callable[[], Sequence[Replica]],
                gpu_host: bool) -> HostPeaks | None:
    """Probe the host's peaks when a CPU replica may need them and the operator has not configured both."""
    configured = settings.peak_memory_bandwidth_bytes_per_second is not None and settings.peak_flops is not None
    from appliance.collectors.procs import replica_device

    devices = {replica_device(r) for r in replicas()}
    needed = "cpu" in devices or (not devices and not gpu_host)
    if configured or not needed or not settings.probe_bandwidth:
        return None
    from appliance.collectors.probes import measure_host_peaks

    try:
        peaks = measure_host_peaks(settings.probe_buffer_bytes, max_buffer_bytes=settings.probe_max_buffer_bytes)
    except Exception:  # a probe that cannot run (memory limits) costs MBU/MFU, never the gateway
        log.warning("host bandwidth/FLOP/s probe failed; MBU and MFU need configured peaks", exc_info=True)
        return None
    log.info("host peaks: memory bandwidth %.1f GB/s (one core %.1f GB/s), %.1f GFLOP/s fp32 on %d cores",
             peaks.all_cores_bandwidth / 1e9, peaks.single_core_bandwidth / 1e9, peaks.flops / 1e9, peaks.cores)
    return peaks


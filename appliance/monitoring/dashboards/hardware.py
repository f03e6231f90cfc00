"""Appliance / Hardware: is the hardware the bottleneck? Compute, bandwidth, memory, fragmentation, thermals, CPU.

GPU panels (NVML, GPM, the CUDA allocator) have no data on CPU hosts; *Collector sources* says why.
"""

from __future__ import annotations

from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import Section, Selectors, dashboard, resolve
from appliance.monitoring.dashboards.panels import RATE, gauge, increase_by, runbooks, stat, table, target, timeseries

UID = "appliance-hardware"
STARVED = "ApplianceAcceleratorStarved"


def build(config: MonitoringConfig | None = None) -> dict[str, Any]:
    config = resolve(config)
    sel = Selectors.of(config)
    gw, gw_replica = sel.gateway, sel.gateway_replica
    knobs = config.alerts
    # The host's and the gateway's own series, shown alone now and next to the engines' over time.
    host_cpu = f"appliance_host_cpu_utilization_ratio{{{gw}}}"
    gateway_cpu = f"appliance_gateway_cpu_ratio{{{gw}}}"
    host_available = f"appliance_host_memory_available_bytes{{{gw}}}"
    panels = [
        gauge(1, "MBU (mean)", target(f"avg(appliance_mbu_ratio{{{gw_replica}}})"), unit="percentunit",
              thresholds=[(None, "blue"), (0.5, "green"), (knobs.ApplianceBandwidthBound.threshold, "orange")],
              links=runbooks(config, "ApplianceBandwidthBound"),
              description="Model bandwidth utilisation: bytes read per decode step x steps/s over peak memory "
                          "bandwidth. Decode is bandwidth bound, so this is its efficiency."),
        gauge(2, "MFU (mean)", target(f"avg(appliance_mfu_ratio{{{gw_replica}}})"), unit="percentunit",
              thresholds=[(None, "blue"), (0.4, "green"), (0.8, "orange")],
              description="Model FLOPs utilisation: 2 x parameters x tokens/s over peak FLOP/s (prefill is "
                          "compute bound)."),
        gauge(3, "Host CPU", target(host_cpu), unit="percentunit",
              thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
              description="Busy fraction of all host CPU time."),
        gauge(4, "Gateway CPU", target(gateway_cpu), unit="percentunit",
              thresholds=[(None, "green"), (0.7, "orange"), (0.9, "red")],
              description="The gateway's single event-loop thread; near 100 % the gateway itself is the "
                          "bottleneck."),
        stat(5, "Max GPU temperature", target(f"max(appliance_gpu_temperature_celsius{{{gw}}})"), unit="celsius",
             w=4, h=6, thresholds=[(None, "green"), (80, "orange"), (88, "red")],
             description="Hottest GPU core (NVML); absent on CPU hosts."),
        stat(6, "Host memory available", target(host_available), unit="bytes",
             w=4, h=6, description="Memory the host can still give to new allocations without swapping."),
        timeseries(7, "Compute utilisation by replica",
                   target(f"appliance_replica_gpu_utilization_ratio{{{gw_replica}}}", "gpu {{replica}}"),
                   target(f"appliance_engine_cpu_utilization_ratio{{{gw_replica}}}", "cpu {{replica}}"),
                   unit="percentunit", min_=0, max_=1,
                   thresholds=[(None, "green"), (knobs.ApplianceComputeSaturated.threshold, "red")],
                   links=runbooks(config, "ApplianceComputeSaturated", STARVED),
                   description="Each replica's GPUs (NVML utilisation) or, on CPU hosts, its CPU time over its "
                               "cores; the dashed line is ApplianceComputeSaturated's threshold."),
        timeseries(8, "GPU utilisation by GPU",
                   target(f"appliance_gpu_utilization_ratio{{{gw}}}", "util gpu{{gpu}}"),
                   target(f"appliance_gpu_sm_activity_ratio{{{gw}}}", "SM active gpu{{gpu}}"),
                   target(f"appliance_gpu_tensor_activity_ratio{{{gw}}}", "tensor gpu{{gpu}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="NVML utilisation (any kernel running) and, where GPM exists, SM and tensor-core "
                               "activity, which show how busy the kernels really keep the chip."),
        timeseries(9, "MBU and MFU by replica", target(f"appliance_mbu_ratio{{{gw_replica}}}", "MBU {{replica}}"),
                   target(f"appliance_mfu_ratio{{{gw_replica}}}", "MFU {{replica}}"), unit="percentunit", min_=0,
                   links=runbooks(config, "ApplianceBandwidthBound"),
                   description="Roofline estimates per replica against the configured or probed peaks."),
        timeseries(10, "Memory bandwidth utilisation",
                   target(f"appliance_gpu_memory_bandwidth_utilization_ratio{{{gw}}}", "NVML gpu{{gpu}}"),
                   target(f"appliance_gpu_dram_bandwidth_utilization_ratio{{{gw}}}", "GPM gpu{{gpu}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="Fraction of time device memory was read or written (NVML) and DRAM bandwidth "
                               "used (GPM)."),
        timeseries(11, "Resident memory by replica",
                   target(f"appliance_engine_resident_memory_bytes{{{gw_replica}}}", "{{replica}}"),
                   target(host_available, "host available"), unit="bytes",
                   description="RSS of each replica's process tree, and what the host has left; steady growth "
                               "under steady load is a leak."),
        timeseries(12, "GPU memory", target(f"appliance_gpu_memory_used_bytes{{{gw}}}", "used gpu{{gpu}}"),
                   target(f"appliance_gpu_memory_total_bytes{{{gw}}}", "total gpu{{gpu}}"),
                   target(f"sum by (replica) (appliance_engine_gpu_memory_bytes{{{gw_replica}}})", "{{replica}}"),
                   unit="bytes", description="Device memory used and installed per GPU, and what each replica's "
                                             "processes hold (vLLM reserves most of it for the KV cache)."),
        timeseries(13, "Allocator: reserved vs allocated",
                   target(f"appliance_engine_allocator_reserved_bytes{{{gw_replica}}}",
                          "reserved {{replica}} {{kind}}"),
                   target(f"appliance_engine_allocator_allocated_bytes{{{gw_replica}}}",
                          "allocated {{replica}} {{kind}}"),
                   target(f"appliance_engine_allocator_free_held_bytes{{{gw_replica}}}",
                          "free held {{replica}} {{kind}}"),
                   unit="bytes", description="Bytes the allocators (PyTorch CUDA cache, glibc arenas) hold, hand "
                                             "out, and keep free; a growing free-held share is fragmentation."),
        timeseries(14, "Memory fragmentation",
                   target(f"appliance_engine_memory_fragmentation_ratio{{{gw_replica}}}", "{{replica}} {{kind}}"),
                   unit="percentunit", min_=0, max_=1,
                   thresholds=[(None, "green"), (knobs.ApplianceFragmentationRising.threshold, "orange")],
                   links=runbooks(config, "ApplianceFragmentationRising"),
                   description="Free bytes held by the allocators over the bytes they hold; high and rising under "
                               "steady load means a large allocation may fail despite free memory (restart in a "
                               "low-traffic window)."),
        timeseries(15, "Allocation retries and OOMs",
                   increase_by("appliance_engine_allocation_retries_total", gw_replica, "replica", "retries"),
                   increase_by("appliance_engine_oom_total", gw_replica, "replica", "OOM"),
                   unit="none", description="PyTorch CUDA allocations that flushed the cache and retried, and "
                                            "out-of-memory errors, per interval."),
        timeseries(16, "GPU temperature", target(f"appliance_gpu_temperature_celsius{{{gw}}}", "gpu{{gpu}}"),
                   unit="celsius", thresholds=[(None, "green"), (85, "red")],
                   description="GPU core temperature (NVML); throttling starts in the high 80s on most parts."),
        timeseries(17, "GPU power", target(f"appliance_gpu_power_watts{{{gw}}}", "draw gpu{{gpu}}"),
                   target(f"appliance_gpu_power_limit_watts{{{gw}}}", "limit gpu{{gpu}}"), unit="watt",
                   description="Power draw against the enforced limit; at the limit clocks drop."),
        timeseries(18, "Host CPU vs engine CPU",
                   target(host_cpu, "host"), target(gateway_cpu, "gateway"),
                   target(f"appliance_engine_process_cpu_ratio{{{gw_replica}}}", "{{replica}} {{process}}"),
                   unit="percentunit", min_=0, max_=1, links=runbooks(config, STARVED),
                   description="Host busy fraction against each engine process role (api_server, engine_core, "
                               "worker): a saturated api_server or engine_core starves the accelerator."),
        timeseries(19, "CPU pressure",
                   target(f"rate(appliance_host_cpu_pressure_stalled_seconds_total{{{gw}}}[{RATE}])", "PSI some"),
                   target(f'appliance_host_load_per_core{{{gw}, window="1m"}}', "load/core 1m"), unit="percentunit",
                   description="Fraction of time some task waited for a CPU (Linux PSI) and the 1-minute load per "
                               "core (above 1 = tasks queue for CPU)."),
        table(20, "Collector sources", f"appliance_collector_source{{{gw}}} == 1",
              description="Which source each collector read on the latest scrape (nvml, gpm, cpu_time, ...); "
                          "'none' means its metrics are absent, not zero."),
        timeseries(21, "Collector errors and duration",
                   increase_by("appliance_collector_errors_total", gw, "collector, source", "errors"),
                   target(f"appliance_collector_duration_seconds{{{gw}}}", "duration {{collector}}"), unit="short",
                   description="Failed source reads per interval (a metric went missing, the scrape survived) "
                               "and each collector's share of the /metrics time in seconds."),
    ]
    by_id = {panel["id"]: panel for panel in panels}
    sections = [Section(101, "Utilisation now", [by_id[i] for i in (1, 2, 3, 4, 5, 6)]),
                Section(102, "Compute and bandwidth", [by_id[i] for i in (7, 8, 9, 10)]),
                Section(103, "Memory", [by_id[i] for i in (11, 12, 13, 14, 15)]),
                Section(104, "Thermals and power", [by_id[i] for i in (16, 17)]),
                Section(105, "CPU", [by_id[i] for i in (18, 19)]),
                Section(106, "Collectors", [by_id[i] for i in (20, 21)])]
    return dashboard(UID, "Appliance / Hardware",
                     "Is the hardware the bottleneck? Compute, bandwidth, memory, fragmentation, thermals, CPU.",
                     sections, ["hardware"], sel)

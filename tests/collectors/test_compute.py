"""Compute: NVML (absent here; present through a fake pynvml), GPM sample pairs, CPU time of process trees."""

from __future__ import annotations

import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors.base import CollectorHealth, HealthCollector, ScrapeStart
from appliance.collectors.compute import ComputeCollector
from appliance.collectors.nvml import NvmlSource, peak_bandwidth
from appliance.collectors.procs import ProcessTable
from tests.collectors.support import (
    EngineTree,
    FakeClock,
    FakeNVMLError,
    cpu_replica,
    fake_pynvml,
    gpu_replica,
    label_sets,
    scrape,
    value,
)


def build(replicas: list, nvml: NvmlSource, clock=time.monotonic, min_window: float = 5.0) -> CollectorRegistry:
    registry = CollectorRegistry()
    health = CollectorHealth()
    table = ProcessTable(lambda: replicas, clock=clock)
    registry.register(ScrapeStart(table, nvml))
    registry.register(ComputeCollector(table, nvml, lambda: replicas, min_window=min_window, health=health,
                                       clock=clock))
    registry.register(HealthCollector(health))
    return registry


def test_without_nvml_there_are_no_gpu_metrics_and_the_source_says_none() -> None:
    nvml = NvmlSource()  # the real pynvml: this machine has no driver
    families = scrape(build([], nvml))
    assert not nvml.available
    assert not [name for name in families if name.startswith("appliance_gpu_")]
    assert value(families, "appliance_collector_source", collector="compute", source="none") == 1
    assert value(families, "appliance_collector_errors", collector="compute", source="nvml") is None


def test_a_missing_library_is_not_an_error_and_init_is_retried_later() -> None:
    clock = FakeClock()
    attempts = []
    module = fake_pynvml(gpus=1)

    def loader():
        attempts.append(1)
        if len(attempts) == 1:
            raise ImportError("No module named 'pynvml'")
        return module

    nvml = NvmlSource(loader=loader, retry_seconds=300, clock=clock)
    assert nvml.readings() == []
    clock.advance(10)
    nvml.invalidate()
    assert nvml.readings() == [] and len(attempts) == 1  # not retried before retry_seconds
    clock.advance(300)
    nvml.invalidate()
    assert [r.index for r in nvml.readings()] == [0]


@pytest.fixture
def nvml_module(monkeypatch: pytest.MonkeyPatch, idle_tree: EngineTree):
    """A fake pynvml in sys.modules: two GPUs, the idle tree's engine core holding 3 GiB on GPU 1."""
    module = fake_pynvml(gpus=2, processes={1: [(idle_tree.engine_core.pid, 3 * 2**30), (1, 2**30)]})
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_gpu_readings_through_nvml(nvml_module, idle_tree: EngineTree) -> None:
    clock = FakeClock()
    replicas = [gpu_replica("replica-0", idle_tree.pid, (1,)), gpu_replica("replica-1", None, (0,))]
    families = scrape(build(replicas, NvmlSource(clock=clock), clock=clock))
    assert value(families, "appliance_gpu_utilization_ratio", gpu="0") == pytest.approx(0.2)
    assert value(families, "appliance_gpu_utilization_ratio", gpu="1") == pytest.approx(0.3)
    assert value(families, "appliance_gpu_memory_used_bytes", gpu="1") == 2 * 2**30
    assert value(families, "appliance_gpu_memory_total_bytes", gpu="0") == 80 * 2**30
    assert value(families, "appliance_gpu_temperature_celsius", gpu="1") == 61
    assert value(families, "appliance_gpu_power_watts", gpu="0") == pytest.approx(350.0)
    assert value(families, "appliance_gpu_power_watts", gpu="1") is None  # not supported on that board
    assert value(families, "appliance_gpu_power_limit_watts", gpu="1") == 700
    assert value(families, "appliance_gpu_info", gpu="0", name="NVIDIA H100 80GB HBM3") == 1
    # Only the replica's own processes count; pid 1 is not part of any replica.
    assert label_sets(families, "appliance_engine_gpu_memory_bytes") == [{"replica": "replica-0", "gpu": "1"}]
    assert value(families, "appliance_engine_gpu_memory_bytes", replica="replica-0", gpu="1") == 3 * 2**30
    assert value(families, "appliance_replica_gpu_utilization_ratio", replica="replica-0") == pytest.approx(0.3)
    assert value(families, "appliance_replica_gpu_utilization_ratio", replica="replica-1") == pytest.approx(0.2)
    assert value(families, "appliance_collector_source", collector="compute", source="nvml") == 1
    assert not [k for k in families["appliance_collector_errors"].samples]  # "not supported" is no error


def test_gpm_reports_activity_between_consecutive_scrapes(nvml_module) -> None:
    clock = FakeClock()
    registry = build([], NvmlSource(clock=clock, gpm_min_interval=1.0), clock=clock)
    first = scrape(registry)
    assert "appliance_gpu_sm_activity_ratio" not in first  # one sample: no pair yet
    clock.advance(15)
    second = scrape(registry)
    # The fake reports 10 x (sample2 - sample1)% + metric id: consecutive samples differ by 1.
    assert value(second, "appliance_gpu_sm_activity_ratio", gpu="0") == pytest.approx(0.12)
    assert value(second, "appliance_gpu_tensor_activity_ratio", gpu="0") == pytest.approx(0.15)
    assert value(second, "appliance_gpu_dram_bandwidth_utilization_ratio", gpu="0") == pytest.approx(0.20)
    assert value(second, "appliance_gpu_sm_activity_ratio", gpu="1") is None  # GPU 1 has no GPM
    assert value(second, "appliance_collector_source", collector="compute", source="gpm") == 1
    clock.advance(0.1)
    third = scrape(registry)  # too soon for a new pair: the last values again, the previous sample kept
    assert value(third, "appliance_gpu_sm_activity_ratio", gpu="0") == pytest.approx(0.12)
    clock.advance(15)
    fourth = scrape(registry)  # pair = (second's sample, this one): two samples apart since third's was taken
    assert value(fourth, "appliance_gpu_sm_activity_ratio", gpu="0") == pytest.approx(0.22)


def test_a_failing_nvml_call_is_counted_and_the_rest_exported(nvml_module) -> None:
    def broken(handle: int, sensor: int) -> int:
        raise FakeNVMLError(999)  # e.g. GPU is lost

    nvml_module.nvmlDeviceGetTemperature = broken
    families = scrape(build([], NvmlSource()))
    assert "appliance_gpu_temperature_celsius" in families
    assert value(families, "appliance_gpu_temperature_celsius", gpu="0") is None
    assert value(families, "appliance_collector_errors", collector="compute", source="nvml_temperature") >= 1
    assert value(families, "appliance_gpu_utilization_ratio", gpu="0") == pytest.approx(0.2)


def test_peak_bandwidth_from_bus_width_and_memory_clock() -> None:
    assert peak_bandwidth(5120, 2619) == pytest.approx(3.352e12, rel=1e-3)
    assert peak_bandwidth(192, 6251) == pytest.approx(300e9, rel=1e-2)
    assert peak_bandwidth(None, 2619) is None


def test_cpu_replica_time_and_utilisation(busy_tree: EngineTree, idle_tree: EngineTree) -> None:
    replicas = [cpu_replica("busy", busy_tree.pid, cores=(0,)), cpu_replica("idle", idle_tree.pid, cores=(1,))]
    registry = build(replicas, NvmlSource(loader=_absent), min_window=0.3)
    first = scrape(registry)
    assert value(first, "appliance_engine_cpu_seconds_total", replica="busy") > 0
    assert "appliance_engine_cpu_utilization_ratio" in first
    assert value(first, "appliance_engine_cpu_utilization_ratio", replica="busy") is None  # needs a window
    time.sleep(0.6)
    second = scrape(registry)
    busy = value(second, "appliance_engine_cpu_utilization_ratio", replica="busy")
    idle = value(second, "appliance_engine_cpu_utilization_ratio", replica="idle")
    assert 0.02 < busy <= 1.0  # a spinning process on a one-core placement (the host is shared: not ~1)
    assert idle < busy
    assert value(second, "appliance_engine_cpu_seconds_total", replica="busy") > value(
        first, "appliance_engine_cpu_seconds_total", replica="busy")
    assert value(second, "appliance_collector_source", collector="compute", source="cpu_time") == 1


def _absent():
    raise ImportError("no pynvml")

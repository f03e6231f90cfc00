"""Host CPU pressure and per-role CPU saturation of the replicas' processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors.base import CollectorHealth, HealthCollector, ScrapeStart
from appliance.collectors.host import HostCollector, psi_some_seconds, role_capacity
from appliance.collectors.procs import ProcessTable, ReplicaProcs
from tests.collectors.support import EngineTree, cpu_replica, gpu_replica, scrape, value


def build(replicas: list, psi_path: Path, min_window: float = 0.3) -> CollectorRegistry:
    registry = CollectorRegistry()
    health = CollectorHealth()
    table = ProcessTable(lambda: replicas)
    registry.register(ScrapeStart(table))
    registry.register(HostCollector(table, min_window=min_window, psi_path=psi_path, health=health))
    registry.register(HealthCollector(health))
    return registry


def test_psi_parsing(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    path.write_text("some avg10=2.87 avg60=4.20 avg300=9.83 total=139332809\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert psi_some_seconds(path) == pytest.approx(139.332809)
    assert psi_some_seconds(tmp_path / "absent") is None
    (tmp_path / "bad").write_text("garbage\n")
    assert psi_some_seconds(tmp_path / "bad") is None


def test_role_capacity() -> None:
    cpu = ReplicaProcs("r", 1, cores=4, device="cpu")
    gpu = ReplicaProcs("r", 1, cores=16, device="cuda")
    assert role_capacity(cpu, "engine_core", 1) == 4  # the model's OpenMP threads on the pinned cores
    assert role_capacity(cpu, "api_server", 1) == 1
    assert role_capacity(gpu, "engine_core", 1) == 1  # a GIL-bound scheduling loop
    assert role_capacity(gpu, "worker", 2) == 2


def test_host_metrics_without_psi(tmp_path: Path) -> None:
    registry = build([], tmp_path / "absent")
    first = scrape(registry)
    assert "appliance_host_cpu_pressure_stalled_seconds" not in first
    assert value(first, "appliance_host_cpu_cores") >= 1
    assert value(first, "appliance_host_load_per_core", window="1m") >= 0
    assert value(first, "appliance_collector_source", collector="host", source="psi") is None
    time.sleep(0.4)
    second = scrape(registry)
    assert 0 <= value(second, "appliance_host_cpu_utilization_ratio") <= 1
    assert 0 <= value(second, "appliance_gateway_cpu_ratio") <= 1


def test_host_metrics_with_psi(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    path.write_text("some avg10=0 avg60=0 avg300=0 total=2500000\n")
    families = scrape(build([], path))
    assert value(families, "appliance_host_cpu_pressure_stalled_seconds_total") == 2.5
    assert value(families, "appliance_collector_source", collector="host", source="psi") == 1


def test_engine_process_ratios_by_role(busy_tree: EngineTree, idle_tree: EngineTree, tmp_path: Path) -> None:
    replicas = [gpu_replica("busy", busy_tree.pid, (0,)), cpu_replica("idle", idle_tree.pid, cores=(0, 1))]
    registry = build(replicas, tmp_path / "absent")
    first = scrape(registry)
    assert first["appliance_engine_process_cpu_ratio"].samples == []  # needs a window
    time.sleep(0.6)
    second = scrape(registry)
    busy_core = value(second, "appliance_engine_process_cpu_ratio", replica="busy", process="engine_core")
    busy_api = value(second, "appliance_engine_process_cpu_ratio", replica="busy", process="api_server")
    idle_core = value(second, "appliance_engine_process_cpu_ratio", replica="idle", process="engine_core")
    assert 0.02 < busy_core <= 1.0  # spinning, on a shared host
    assert busy_api < busy_core
    assert idle_core < busy_core
    assert value(second, "appliance_engine_process_cpu_ratio", replica="idle", process="other") is not None
    assert value(second, "appliance_collector_source", collector="host", source="process_cpu") == 1

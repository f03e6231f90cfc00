"""The whole set as the gateway registers it: one valid page, the naming contract, no clashes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors import ENGINE_STATS_DIR_ENV, engine_stats_dir, engine_stats_env, register_collectors
from appliance.collectors.engine_plugin import write_stats
from appliance.collectors.settings import CollectorSettings
from appliance.engine.load import EngineLoad
from tests.collectors.support import EngineTree, cpu_replica, scrape, value, write_model

REPO = Path(__file__).resolve().parents[2]
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_celsius", "_watts", "_per_second", "_flops", "_parameters",
                 "_cores", "_per_core", "_info", "_waiting", "_running", "_source")


def build(tmp_path: Path, tree: EngineTree, **settings: object) -> tuple[CollectorRegistry, dict[str, EngineLoad]]:
    replicas = [cpu_replica("replica-0", tree.pid, cores=(0,), kv_gib=1)]
    loads: dict[str, EngineLoad] = {}
    registry = CollectorRegistry()
    options = {"probe_bandwidth": False, "rate_min_window_seconds": 0.2, **settings}
    register_collectors(registry, replicas=lambda: replicas, router_load=lambda: loads,
                        settings=CollectorSettings(**options), model_dir=write_model(tmp_path / "model"),
                        state_dir=tmp_path / "state")
    return registry, loads


def test_the_page_is_valid_and_follows_the_naming_contract(tmp_path: Path, idle_tree: EngineTree) -> None:
    registry, loads = build(tmp_path, idle_tree, peak_flops=1e11, peak_memory_bandwidth_bytes_per_second=1e10)
    write_stats(engine_stats_dir(CollectorSettings(), tmp_path / "state"))  # this pid is no replica's: ignored
    loads["replica-0"] = EngineLoad(0.1, 0, 1, 10, 10, read_at=time.monotonic())
    scrape(registry)
    time.sleep(0.3)
    loads["replica-0"] = EngineLoad(0.1, 0, 1, 20, 20, read_at=time.monotonic())
    families = scrape(registry)
    for name, family in families.items():
        assert name.startswith("appliance_"), name
        assert len(family.documentation) > 20, name
        if family.type == "counter":
            assert all(s.name == f"{name}_total" for s in family.samples), name
        else:
            assert name.endswith(UNIT_SUFFIXES), f"{name}: unit suffix?"
        for sample in family.samples:
            assert set(sample.labels) <= {"replica", "gpu", "name", "kind", "process", "collector", "source",
                                          "window"}, name
            if name.endswith("_ratio") and name not in ("appliance_mbu_ratio", "appliance_mfu_ratio"):
                assert 0 <= sample.value <= 1, (name, sample)
    for metric in ("appliance_mbu_ratio", "appliance_mfu_ratio", "appliance_engine_cpu_utilization_ratio",
                   "appliance_engine_kv_cache_usage_ratio", "appliance_engine_resident_memory_bytes"):
        assert value(families, metric, replica="replica-0") is not None, metric
    assert value(families, "appliance_engine_process_cpu_ratio", replica="replica-0", process="api_server") >= 0
    assert value(families, "appliance_replica_starts_total", replica="replica-0") == 1
    for collector in ("compute", "roofline", "engine", "memory", "host"):
        assert value(families, "appliance_collector_duration_seconds", collector=collector) < 1.0
    assert not families["appliance_collector_errors"].samples


def test_names_do_not_clash_with_the_gateways_own(tmp_path: Path, idle_tree: EngineTree) -> None:
    registry, _ = build(tmp_path, idle_tree)
    ours = set(scrape(registry))
    gateway = set(re.findall(r'"(appliance_[a-z_]+)"', (REPO / "appliance/gateway/observation/metrics.py").read_text()))
    assert gateway and not ours & gateway


def test_disabled_registers_nothing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    register_collectors(registry, replicas=list, router_load=dict, settings=CollectorSettings(enabled=False),
                        model_dir=None, state_dir=tmp_path)
    assert scrape(registry) == {}
    assert engine_stats_env(CollectorSettings(enabled=False), tmp_path) == {}


def test_engine_stats_env(tmp_path: Path) -> None:
    env = engine_stats_env(CollectorSettings(engine_stats_interval_seconds=2), tmp_path)
    assert env[ENGINE_STATS_DIR_ENV] == str((tmp_path / "engine-stats").resolve())
    assert env["APPLIANCE_ENGINE_STATS_INTERVAL_SECONDS"] == "2.0"
    custom = engine_stats_env(CollectorSettings(engine_stats_dir=str(tmp_path / "x")), tmp_path)
    assert custom[ENGINE_STATS_DIR_ENV] == str((tmp_path / "x").resolve())


def test_the_probe_runs_once_at_registration(tmp_path: Path, idle_tree: EngineTree,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.collectors import probes

    calls = []
    original = probes.measure_host_peaks

    def counted(buffer_bytes: int, *, max_buffer_bytes: int | None = None, **_: object) -> probes.HostPeaks:
        calls.append((buffer_bytes, max_buffer_bytes))
        return original(buffer_bytes, max_buffer_bytes=max_buffer_bytes, repeats=1)

    monkeypatch.setattr(probes, "measure_host_peaks", counted)
    registry, _ = build(tmp_path, idle_tree, probe_bandwidth=True, probe_buffer_bytes=2**20,
                        probe_max_buffer_bytes=2**21)
    scrape(registry)
    families = scrape(registry)
    assert calls == [(2**20, 2**21)]  # once, with the configured sizes
    assert value(families, "appliance_peak_memory_bandwidth_bytes_per_second", replica="replica-0") > 1e8
    assert value(families, "appliance_peak_flops", replica="replica-0") > 1e7


def test_no_probe_when_both_peaks_are_configured(tmp_path: Path, idle_tree: EngineTree,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.collectors import probes

    monkeypatch.setattr(probes, "measure_host_peaks", _explode)
    registry, _ = build(tmp_path, idle_tree, probe_bandwidth=True, peak_flops=1.0,
                        peak_memory_bandwidth_bytes_per_second=1.0)
    assert value(scrape(registry), "appliance_peak_flops", replica="replica-0") == 1.0


def test_a_failing_probe_leaves_the_peaks_out(tmp_path: Path, idle_tree: EngineTree,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.collectors import probes

    monkeypatch.setattr(probes, "measure_host_peaks", _explode)
    registry, _ = build(tmp_path, idle_tree, probe_bandwidth=True)
    assert scrape(registry)["appliance_peak_flops"].samples == []


def _explode(*_args: object, **_kwargs: object) -> None:
    raise MemoryError("probe")

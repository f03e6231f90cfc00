"""MBU and MFU: checkpoint facts, KV capacity, peaks (configured, probed, NVML, datasheet), token rates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors.base import CollectorHealth, HealthCollector
from appliance.collectors.nvml import NvmlSource
from appliance.collectors.probes import (
    HostPeaks,
    copy_bandwidth,
    last_level_cache_bytes,
    matmul_flops,
    probe_buffer_size,
)
from appliance.collectors.roofline import (
    RooflineCollector,
    gpu_peak_flops,
    kv_bytes_per_token,
    model_facts,
)
from appliance.collectors.settings import CollectorSettings
from appliance.engine.load import EngineLoad
from tests.collectors.support import FakeClock, cpu_replica, fake_pynvml, gpu_replica, scrape, value, write_model

# The tiny model of write_model: per layer q 64x64, k 32x64, v 32x64, o 64x64, down 64x128 = 20480; 2 layers,
# plus lm_head 100x64 (the embedding is a lookup, scales are not matmul weights).
PARAMETERS = 2 * 20480 + 6400
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 2  # K and V x layers x KV heads x head dim x bf16
PEAKS = HostPeaks(single_core_bandwidth=10e9, all_cores_bandwidth=30e9, flops=100e9, cores=4)


def test_model_facts(tmp_path: Path) -> None:
    facts = model_facts(write_model(tmp_path / "m"))
    assert facts is not None
    assert facts.weight_bytes == sum(p.stat().st_size for p in (tmp_path / "m").glob("*.safetensors"))
    assert facts.parameters == PARAMETERS
    assert not facts.int8
    assert facts.kv_bytes_per_token == KV_PER_TOKEN


def test_model_facts_int8_and_tied(tmp_path: Path) -> None:
    facts = model_facts(write_model(tmp_path / "m", int8=True, tied=True))
    assert facts is not None and facts.int8
    assert facts.parameters == 2 * 20480 + 6400  # tied: the embedding is the output matrix, counted once


def test_no_safetensors_no_facts(tmp_path: Path) -> None:
    assert model_facts(tmp_path) is None


def test_kv_bytes_per_token_from_configs() -> None:
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "torch_dtype": "bfloat16"}
    assert kv_bytes_per_token(config) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(config, dtype_bytes=1) == 2 * 32 * 8 * 128
    assert kv_bytes_per_token({"text_config": config}) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token({"hidden_size": 64}) is None


def test_gpu_peak_flops_table() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", int8=False) == 989e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", int8=True) == 1979e12
    assert gpu_peak_flops("NVIDIA L40S", int8=False) == 362e12
    assert gpu_peak_flops("NVIDIA L4", int8=False) == 121e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", int8=False) == 312e12
    assert gpu_peak_flops("Some Future GPU", int8=False) is None


def test_host_peaks_per_replica() -> None:
    assert PEAKS.bandwidth_for(1) == 10e9  # one core cannot fill the bus
    assert PEAKS.bandwidth_for(4) == 30e9  # ...four are capped by it
    assert PEAKS.flops_for(1) == 25e9
    assert PEAKS.flops_for(8) == 100e9


def test_probes_measure_something_plausible() -> None:
    import numpy as np

    source = np.ones(2**20)
    target = np.zeros_like(source)
    assert 1e8 < copy_bandwidth(source, target, [0], repeats=2) < 1e13
    assert 1e7 < matmul_flops(repeats=1, min_seconds=0.001, max_size=512) < 1e14
    assert last_level_cache_bytes([0]) >= 0


def test_the_copy_buffers_exceed_the_cache_up_to_their_cap() -> None:
    """Twice the last-level cache, at least the configured size, at most the cap (a VM reporting a 480 MiB cache
    made the uncapped probe fault in 2 x 960 MiB at every start)."""
    mib = 2**20
    assert probe_buffer_size(64 * mib, 480 * mib) == 960 * mib  # no cap: as before
    assert probe_buffer_size(64 * mib, 480 * mib, 256 * mib) == 256 * mib
    assert probe_buffer_size(64 * mib, 16 * mib, 256 * mib) == 64 * mib
    assert probe_buffer_size(64 * mib, 100 * mib, 256 * mib) == 200 * mib
    assert probe_buffer_size(512 * mib, 480 * mib, 256 * mib) == 512 * mib  # the cap never shrinks the floor


class Harness:
    def __init__(self, tmp_path: Path, replicas: list, settings: CollectorSettings | None = None,
                 nvml: NvmlSource | None = None, model: bool = True) -> None:
        self.clock = FakeClock()
        self.loads: dict[str, EngineLoad] = {}
        self.registry = CollectorRegistry()
        health = CollectorHealth()
        self.settings = settings or CollectorSettings(rate_min_window_seconds=5.0)
        self.collector = RooflineCollector(
            lambda: replicas, lambda: self.loads, self.settings,
            model_dir=write_model(tmp_path / "model") if model else None,
            nvml=nvml or NvmlSource(loader=_absent), host_peaks=PEAKS, health=health, clock=self.clock)
        self.registry.register(self.collector)
        self.registry.register(HealthCollector(health))

    def read(self, replica: str, *, prompt: float, generation: float, running: float, kv: float = 0.5) -> None:
        self.loads[replica] = EngineLoad(kv_cache_usage=kv, waiting=0, running=running, prompt_tokens_total=prompt,
                                         generation_tokens_total=generation, read_at=self.clock())


def test_mbu_and_mfu_of_a_cpu_replica(tmp_path: Path) -> None:
    h = Harness(tmp_path, [cpu_replica("replica-0", None, cores=(0, 1), kv_gib=1)])
    h.read("replica-0", prompt=1000, generation=500, running=4)
    first = scrape(h.registry)
    assert "appliance_mbu_ratio" in first and value(first, "appliance_mbu_ratio", replica="replica-0") is None
    h.clock.advance(10)
    h.read("replica-0", prompt=3000, generation=1300, running=4, kv=0.25)
    page = scrape(h.registry)
    facts = h.collector.facts()
    step_bytes = facts.weight_bytes + 0.25 * 2**30
    steps_per_second = (800 / 10) / 4
    peak_bandwidth = PEAKS.bandwidth_for(2)
    assert value(page, "appliance_decode_step_bytes", replica="replica-0") == pytest.approx(step_bytes)
    assert value(page, "appliance_mbu_ratio", replica="replica-0") == pytest.approx(
        step_bytes * steps_per_second / peak_bandwidth)
    assert value(page, "appliance_mfu_ratio", replica="replica-0") == pytest.approx(
        2 * PARAMETERS * (2000 + 800) / 10 / PEAKS.flops_for(2))
    assert value(page, "appliance_peak_memory_bandwidth_bytes_per_second", replica="replica-0") == 20e9
    assert value(page, "appliance_peak_flops", replica="replica-0") == 50e9
    assert value(page, "appliance_model_weight_bytes") == facts.weight_bytes
    assert value(page, "appliance_model_parameters") == PARAMETERS
    for source in ("model_dir", "engine_load", "kv_env", "bandwidth_probe", "flops_probe"):
        assert value(page, "appliance_collector_source", collector="roofline", source=source) == 1, source


def test_idle_replica_reads_zero_and_a_restart_starts_a_new_window(tmp_path: Path) -> None:
    h = Harness(tmp_path, [cpu_replica("replica-0", None, kv_gib=1)])
    h.read("replica-0", prompt=100, generation=100, running=0)
    scrape(h.registry)
    h.clock.advance(10)
    h.read("replica-0", prompt=100, generation=100, running=0)
    assert value(scrape(h.registry), "appliance_mbu_ratio", replica="replica-0") == 0
    h.clock.advance(10)
    h.read("replica-0", prompt=5, generation=5, running=1)  # counters went back: the engine restarted
    assert value(scrape(h.registry), "appliance_mbu_ratio", replica="replica-0") is None


def test_stale_engine_readings_give_no_ratios(tmp_path: Path) -> None:
    h = Harness(tmp_path, [cpu_replica("replica-0", None)])
    h.read("replica-0", prompt=100, generation=100, running=1)
    h.clock.advance(60)
    page = scrape(h.registry)
    assert value(page, "appliance_decode_step_bytes", replica="replica-0") is None
    assert value(page, "appliance_peak_flops", replica="replica-0") == 25e9  # peaks do not depend on load


def test_without_kv_capacity_mbu_counts_weights_only(tmp_path: Path) -> None:
    h = Harness(tmp_path, [cpu_replica("replica-0", None)])
    h.read("replica-0", prompt=0, generation=0, running=1)
    page = scrape(h.registry)
    assert value(page, "appliance_decode_step_bytes", replica="replica-0") == h.collector.facts().weight_bytes
    assert not [s for s in page["appliance_collector_source"].samples if s.labels["source"].startswith("kv_")]


def test_configured_peaks_and_kv_capacity_win(tmp_path: Path) -> None:
    settings = CollectorSettings(peak_memory_bandwidth_bytes_per_second=1e9, peak_flops=1e12,
                                 kv_cache_capacity_tokens=1000)
    h = Harness(tmp_path, [cpu_replica("replica-0", None)], settings=settings)
    h.read("replica-0", prompt=0, generation=0, running=1, kv=0.5)
    page = scrape(h.registry)
    assert value(page, "appliance_peak_memory_bandwidth_bytes_per_second", replica="replica-0") == 1e9
    assert value(page, "appliance_peak_flops", replica="replica-0") == 1e12
    assert value(page, "appliance_decode_step_bytes", replica="replica-0") == pytest.approx(
        h.collector.facts().weight_bytes + 0.5 * 1000 * KV_PER_TOKEN)
    for source in ("bandwidth_configured", "flops_configured", "kv_configured"):
        assert value(page, "appliance_collector_source", collector="roofline", source=source) == 1


def test_without_a_model_there_is_no_mbu(tmp_path: Path) -> None:
    h = Harness(tmp_path, [cpu_replica("replica-0", None)], model=False)
    h.read("replica-0", prompt=0, generation=0, running=1)
    page = scrape(h.registry)
    assert not page["appliance_mbu_ratio"].samples
    assert "appliance_model_weight_bytes" not in page


def test_gpu_replica_peaks_from_nvml_and_the_datasheet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=2))
    h = Harness(tmp_path, [gpu_replica("replica-0", None, (0, 1))], nvml=NvmlSource())
    page = scrape(h.registry)
    assert value(page, "appliance_peak_memory_bandwidth_bytes_per_second", replica="replica-0") == pytest.approx(
        2 * 5120 / 8 * 2619e6 * 2)
    assert value(page, "appliance_peak_flops", replica="replica-0") == 2 * 989e12
    assert value(page, "appliance_gpu_memory_bandwidth_utilization_ratio", gpu="1") == pytest.approx(0.41)
    for source in ("nvml", "bandwidth_nvml", "flops_datasheet"):
        assert value(page, "appliance_collector_source", collector="roofline", source=source) == 1


def test_gpu_without_nvml_has_no_peaks(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gpu_replica("replica-0", None, (0,))])
    page = scrape(h.registry)
    assert not page["appliance_peak_flops"].samples
    assert "appliance_gpu_memory_bandwidth_utilization_ratio" not in page


def _absent():
    raise ImportError("no pynvml")


def test_roofline_and_planner_read_the_same_shape(tmp_path: Path) -> None:
    """One reader: the collector's KV bytes per token are the planner's, for auto and fp8 caches alike."""
    from appliance.loadtest.footprint import kv_bytes_per_token as planned
    from appliance.loadtest.plan import load_shape

    config = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
              "intermediate_size": 18944, "vocab_size": 152064, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_shape(tmp_path, None)
    assert kv_bytes_per_token(config) == planned(shape, "auto") == 2 * 28 * 4 * 128 * 4
    assert kv_bytes_per_token(config, dtype_bytes=1) == planned(shape, "fp8")

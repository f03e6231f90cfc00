"""Model bandwidth utilisation (MBU) and model FLOPs utilisation (MFU) per replica: how close decoding is to
the memory bandwidth roof, and the whole workload to the compute roof.

Decode is bandwidth-bound: each step reads every weight once and the KV cache of every running sequence, and
makes one token per running sequence. So, per replica, between two readings of the engine's counters:

- bytes per step = weight bytes at their stored dtype (the checkpoint's *.safetensors sizes) + KV bytes in use
  (the engine's kv_cache_usage x the replica's KV capacity in bytes);
- steps/s = rate(generation tokens) / running sequences (mean of the two readings);
- MBU = bytes per step x steps/s / peak memory bandwidth;
- MFU = 2 x parameters x rate(prompt + generation tokens) / peak FLOP/s (the matmul FLOPs; attention's own
  FLOPs are left out, so MFU reads slightly low at long contexts).

KV capacity: on CPU hosts ``VLLM_CPU_KVCACHE_SPACE`` GiB from the replica's environment (what vLLM allocates);
on GPU hosts ``kv_cache_capacity_tokens`` from the settings x KV bytes per token from the model's config.json
(2 x layers x KV heads x head dim x dtype bytes). Without either, MBU counts the weights only (a lower bound)
and ``appliance_collector_source{collector="roofline"}`` lacks a ``kv_*`` source.

Peaks (configured values win): memory bandwidth from NVML on GPUs (bus width x memory clock x 2, summed over
the replica's GPUs), from the copy probe on CPUs (``min(all cores, one core x the replica's cores)``); FLOP/s
from a small datasheet table on GPUs (dense BF16, or INT8 for an INT8 checkpoint), from the matmul probe on CPUs
(the replica's share of the cores). MBU and MFU are not clamped: a value above 1 means the peak is too low
(a probe taken on a busy host) and should be configured.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.collectors.base import Clock, CollectorHealth, SafeCollector, replica_gauge
from appliance.collectors.nvml import NvmlSource
from appliance.collectors.probes import HostPeaks
from appliance.collectors.procs import replica_cores, replica_device
from appliance.collectors.settings import CollectorSettings
from appliance.model.shape import ShapeError, read_config, shape_from_config

if TYPE_CHECKING:
    from appliance.engine.contract import Replica
    from appliance.engine.load import EngineLoad

log = logging.getLogger(__name__)

SAFETENSORS_INT8 = {"I8", "U8", "F8_E4M3", "F8_E5M2"}

# Dense peak tensor throughput per GPU from NVIDIA datasheets: (name fragment, BF16 FLOP/s, INT8 OP/s). Longer
# fragments first, so "L40S" is matched before "L4" and "A100" before "A10".
GPU_PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 1979e12),
    ("H100 NVL", 835e12, 1671e12),
    ("H100 PCIe", 756e12, 1513e12),
    ("H100", 989e12, 1979e12),
    ("A100", 312e12, 624e12),
    ("L40S", 362e12, 733e12),
    ("L40", 181e12, 362e12),
    ("L4", 121e12, 242e12),
    ("A10", 125e12, 250e12),
)


@dataclass(frozen=True)
class ModelFacts:
    """What the checkpoint says about bytes and FLOPs; read once, it never changes while serving."""

    weight_bytes: int
    parameters: int  # elements of the matrices a forward pass multiplies by (embedding lookups excluded)
    int8: bool  # most matmul weights are stored in 8 bits (use the INT8 peak)
    kv_bytes_per_token: int | None


def model_facts(model_dir: Path, kv_dtype_bytes: int | None = None) -> ModelFacts | None:
    """Weight bytes, parameter count and KV bytes per token of an HF checkpoint with safetensors weights."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, tuple[str, int, int]] = {}
    for path in files:
        tensors.update(_safetensors_shapes(path))
    lm_head = any(name.endswith("lm_head.weight") for name in tensors)
    parameters = int8 = 0
    for name, (dtype, ndim, count) in tensors.items():
        if not _is_matmul_weight(name, ndim, lm_head):
            continue
        parameters += count
        int8 += count if dtype in SAFETENSORS_INT8 else 0
    config = _read_config(model_dir)
    return ModelFacts(
        weight_bytes=sum(p.stat().st_size for p in files),
        parameters=parameters,
        int8=parameters > 0 and int8 * 2 > parameters,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype_bytes),
    )


def _is_matmul_weight(name: str, ndim: int, has_lm_head: bool) -> bool:
    """Matrices a forward pass multiplies by: not norms or biases (1-D), not quantization scales or zero points
    ([out, 1] beside INT8 weights), not the input embedding (a lookup) unless it doubles as the output layer."""
    if ndim < 2 or "scale" in name or "zero_point" in name:
        return False
    return not (has_lm_head and "embed_tokens" in name)


def _safetensors_shapes(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype, dimensions, elements) from a safetensors header, without reading the tensors."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in info["shape"]:
            count *= int(dim)
        shapes[name] = (str(info["dtype"]), len(info["shape"]), count)
    return shapes


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return read_config(model_dir)[0]
    except ShapeError:
        return {}


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int | None = None) -> int | None:
    """2 (K and V) x layers x KV heads x head dim x bytes per element (default the config's torch_dtype), from
    an HF config through the planner's shape reader; None when the config lacks the shape."""
    try:
        per_token = shape_from_config(config).kv_bytes_per_token(dtype_bytes)
    except ShapeError:
        return None
    return per_token or None


def kv_capacity_bytes(replica: Replica, facts: ModelFacts | None, settings: CollectorSettings
                      ) -> tuple[int | None, str]:
    """The replica's KV-cache capacity in bytes and where it came from (``kv_env``, ``kv_configured``)."""
    if replica.kv_cache_space_bytes:
        return replica.kv_cache_space_bytes, "kv_env"
    if settings.kv_cache_capacity_tokens and facts is not None and facts.kv_bytes_per_token:
        return settings.kv_cache_capacity_tokens * facts.kv_bytes_per_token, "kv_configured"
    return None, ""


def gpu_peak_flops(name: str, int8: bool) -> float | None:
    for fragment, bf16, int8_ops in GPU_PEAK_FLOPS:
        if fragment in name:
            return int8_ops if int8 else bf16
    return None


@dataclass
class _Reading:
    at: float
    prompt: float
    generation: float
    running: float


@dataclass(frozen=True)
class TokenRates:
    prompt_per_second: float
    generation_per_second: float
    running: float  # mean running sequences over the window


class TokenRateWindows:
    """Token rates per replica from the engine's counters, over windows at least ``min_window`` long."""

    def __init__(self, min_window: float) -> None:
        self.min_window = min_window
        self._base: dict[str, _Reading] = {}
        self._last: dict[str, TokenRates] = {}

    def update(self, replica: str, load: Any) -> TokenRates | None:
        if load.prompt_tokens_total is None or load.generation_tokens_total is None:
            return None
        now = _Reading(load.read_at, load.prompt_tokens_total, load.generation_tokens_total, load.running or 0.0)
        base = self._base.get(replica)
        if base is None or now.generation < base.generation or now.prompt < base.prompt or now.at < base.at:
            self._base[replica] = now  # first reading, or the engine restarted (counters went back)
            self._last.pop(replica, None)
            return None
        elapsed = now.at - base.at
        if elapsed < self.min_window:
            return self._last.get(replica)
        rates = TokenRates((now.prompt - base.prompt) / elapsed, (now.generation - base.generation) / elapsed,
                           (now.running + base.running) / 2)
        self._base[replica], self._last[replica] = now, rates
        return rates

    def retain(self, replicas: Iterable[str]) -> None:
        keep = set(replicas)
        for name in [n for n in self._base if n not in keep]:
            self._base.pop(name, None)
            self._last.pop(name, None)


class RooflineCollector(SafeCollector):
    name = "roofline"

    def __init__(self, replicas: Callable[[], Sequence[Replica]], router_load: Callable[[], Mapping[str, EngineLoad]],
                 settings: CollectorSettings, *, model_dir: Path | None, nvml: NvmlSource,
                 host_peaks: HostPeaks | None, health: CollectorHealth | None = None,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(health)
        self._replicas = replicas
        self._router_load = router_load
        self._settings = settings
        self._nvml = nvml
        self._host_peaks = host_peaks
        self._clock = clock
        self._rates = TokenRateWindows(settings.rate_min_window_seconds)
        self._facts: ModelFacts | None = None
        self._facts_read = model_dir is None
        self._model_dir = model_dir

    def facts(self) -> ModelFacts | None:
        """The checkpoint's facts, read at the first scrape that needs them and cached for good."""
        if not self._facts_read:
            self._facts_read = True
            assert self._model_dir is not None
            with self.source("model_dir"):
                self._facts = model_facts(self._model_dir, self._settings.kv_cache_dtype_bytes)
        return self._facts

    def families(self) -> Iterable[Metric]:
        sources: set[str] = set()
        page: list[Metric] = []
        with self.source("nvml"):
            gpu = self._gpu_bandwidth_family()
            if gpu is not None:
                sources.add("nvml")
                page.append(gpu)
        facts = self.facts()
        if facts is not None:
            sources.add("model_dir")
            page += _model_families(facts)
        page += self._replica_families(facts, sources)
        self.health.set_sources(self.name, sources)
        return page

    def _gpu_bandwidth_family(self) -> GaugeMetricFamily | None:
        readings = [(r.index, u) for r in self._nvml.readings() if (u := r.memory_utilization) is not None]
        if not readings:
            return None
        family = GaugeMetricFamily(
            "appliance_gpu_memory_bandwidth_utilization_ratio", "NVML memory utilisation: fraction of time (0..1) "
            "device memory was being read or written over NVML's last sample period.", labels=["gpu"])
        for index, utilization in readings:
            family.add_metric([str(index)], utilization)
        return family

    def _replica_families(self, facts: ModelFacts | None, sources: set[str]) -> list[Metric]:
        peak_bw = replica_gauge(
            "appliance_peak_memory_bandwidth_bytes_per_second", "Peak memory bandwidth of a replica's devices in "
            "bytes/s: the MBU denominator (configured, NVML, or the copy probe).")
        peak_flops = replica_gauge(
            "appliance_peak_flops", "Peak FLOP/s (INT8 OP/s for an INT8 checkpoint on GPUs) of a replica's "
            "devices: the MFU denominator (configured, datasheet, or the matmul probe).")
        step_bytes = replica_gauge(
            "appliance_decode_step_bytes", "Bytes one decode step reads on a replica: weights plus the KV cache "
            "in use, in bytes.")
        mbu = replica_gauge(
            "appliance_mbu_ratio", "Model bandwidth utilisation: bytes per decode step x decode steps/s over the "
            "peak memory bandwidth (ratio; above 1 means the configured or probed peak is too low).")
        mfu = replica_gauge(
            "appliance_mfu_ratio", "Model FLOPs utilisation: 2 x parameters x tokens/s (prompt + generated) over "
            "the peak FLOP/s (ratio).")
        loads = self._router_load()
        now = self._clock()
        names = []
        for replica in self._replicas():
            names.append(replica.name)
            bandwidth, flops = self._peaks(replica, facts, sources)
            if bandwidth is not None:
                peak_bw.add_metric([replica.name], bandwidth)
            if flops is not None:
                peak_flops.add_metric([replica.name], flops)
            load = loads.get(replica.name)
            if facts is None or load is None or now - load.read_at > self._settings.engine_load_max_age_seconds:
                continue
            sources.add("engine_load")
            per_step = self._step_bytes(replica, facts, load, sources)
            step_bytes.add_metric([replica.name], per_step)
            rates = self._rates.update(replica.name, load)
            if rates is None:
                continue
            steps = rates.generation_per_second / rates.running if rates.running > 0 else 0.0
            if bandwidth:
                mbu.add_metric([replica.name], per_step * steps / bandwidth)
            if flops:
                tokens = rates.prompt_per_second + rates.generation_per_second
                mfu.add_metric([replica.name], 2 * facts.parameters * tokens / flops)
        self._rates.retain(names)
        return [peak_bw, peak_flops, step_bytes, mbu, mfu]

    def _step_bytes(self, replica: Replica, facts: ModelFacts, load: EngineLoad, sources: set[str]) -> float:
        capacity, kv_source = kv_capacity_bytes(replica, facts, self._settings)
        if capacity is None or load.kv_cache_usage is None:
            return float(facts.weight_bytes)
        sources.add(kv_source)
        return facts.weight_bytes + load.kv_cache_usage * capacity

    def _peaks(self, replica: Replica, facts: ModelFacts | None,
               sources: set[str]) -> tuple[float | None, float | None]:
        """Peak bandwidth and FLOP/s of this replica's devices, and which source gave each."""
        configured_bw = self._settings.peak_memory_bandwidth_bytes_per_second
        configured_flops = self._settings.peak_flops
        bandwidth: float | None = None
        flops: float | None = None
        bw_source = flops_source = ""
        if replica_device(replica) == "cuda":
            gpus = replica.placement.gpus if replica.placement is not None else ()
            readings = {r.index: r for r in self._nvml.readings()}
            peaks = [readings[g].peak_bandwidth_bytes_per_second for g in gpus if g in readings]
            if peaks and all(peaks):
                bandwidth, bw_source = float(sum(p for p in peaks if p is not None)), "bandwidth_nvml"
            per_gpu = [gpu_peak_flops(readings[g].name, bool(facts and facts.int8)) for g in gpus if g in readings]
            if per_gpu and all(per_gpu):
                flops, flops_source = float(sum(f for f in per_gpu if f is not None)), "flops_datasheet"
        elif self._host_peaks is not None:
            cores = replica_cores(replica)
            bandwidth, bw_source = self._host_peaks.bandwidth_for(cores), "bandwidth_probe"
            flops, flops_source = self._host_peaks.flops_for(cores), "flops_probe"
        if configured_bw is not None:
            bandwidth, bw_source = configured_bw, "bandwidth_configured"
        if configured_flops is not None:
            flops, flops_source = configured_flops, "flops_configured"
        if bandwidth is not None:
            sources.add(bw_source)
        if flops is not None:
            sources.add(flops_source)
        return bandwidth, flops


def _model_families(facts: ModelFacts) -> list[Metric]:
    return [
        GaugeMetricFamily("appliance_model_weight_bytes", "Bytes of the served checkpoint's weights at their stored "
                          "dtype (sum of its *.safetensors files), read by every decode step.",
                          value=facts.weight_bytes),
        GaugeMetricFamily("appliance_model_parameters", "Matmul parameters of the served model (embedding lookups "
                          "excluded), the N in MFU's 2 x N FLOPs per token.", value=facts.parameters),
    ]

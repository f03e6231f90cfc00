"""Settings of the gateway's collectors; nested in the appliance's settings as ``collectors``.

Every field has a default that works on a laptop and on a GPU host, so the section is optional. Peaks are the
denominators of MBU and MFU: when the operator knows them (a datasheet, a STREAM run) they win over the probes,
which are quick estimates.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class CollectorSettings(BaseModel):
    """How the collectors read their sources and what they assume where a source cannot say."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Off: none of the appliance's resource collectors are registered.")
    peak_memory_bandwidth_bytes_per_second: float | None = Field(
        None, gt=0,
        description="Peak memory bandwidth of one replica's devices (bytes/s), the MBU denominator. Unset: GPUs "
                    "from NVML (bus width x max memory clock x 2), CPUs from a copy probe (see probe_bandwidth).",
    )
    peak_flops: float | None = Field(
        None, gt=0,
        description="Peak dense FLOP/s (or OP/s for INT8) of one replica's devices, the MFU denominator. Unset: "
                    "CPUs from a matmul probe scaled by the replica's cores, GPUs from a small datasheet table.",
    )
    probe_bandwidth: bool = Field(
        True, description="Measure host memory bandwidth and FLOP/s once at start (a fraction of a second)."
    )
    probe_buffer_bytes: int = Field(
        64 * 2**20, ge=2**20,
        description="Size of each of the copy probe's two buffers; at least twice the last-level cache is used, up "
                    "to probe_max_buffer_bytes.",
    )
    probe_max_buffer_bytes: int = Field(
        256 * 2**20, ge=2**20,
        description="Cap on each copy-probe buffer. Hosts (and VMs) that report a last-level cache of hundreds of "
                    "MiB would otherwise allocate twice that, twice, at start: on one such VM (480 MiB reported) the "
                    "probe took 24-33 s. Above the cap the estimate may include cache bandwidth and read high; "
                    "configure peak_memory_bandwidth_bytes_per_second there.",
    )
    engine_stats_dir: Path | None = Field(
        None, description="Where the engine plugin writes allocator statistics; default <state_dir>/engine-stats."
    )
    engine_stats_interval_seconds: float = Field(
        5.0, gt=0, description="How often each engine process writes its allocator statistics."
    )
    engine_stats_max_age_seconds: float = Field(
        30.0, gt=0, description="Allocator statistics older than this are ignored (a hung or dead process)."
    )
    engine_load_max_age_seconds: float = Field(
        5.0, gt=0, description="Engine KV-cache/queue readings older than this are omitted, not shown as zero."
    )
    rate_min_window_seconds: float = Field(
        5.0, gt=0,
        description="Shortest interval a rate or utilisation is computed over; closer scrapes repeat the last "
                    "value rather than divide tiny, noisy deltas.",
    )
    process_tree_refresh_seconds: float = Field(
        10.0, ge=0, description="How long a replica's process tree (pids and roles) is reused before re-walked."
    )
    kv_cache_capacity_tokens: int | None = Field(
        None, ge=1,
        description="GPU hosts: KV-cache capacity of one replica in tokens (vLLM logs it as 'GPU KV cache size'); "
                    "with the model config it gives the KV bytes read per decode step.",
    )
    kv_cache_dtype_bytes: int | None = Field(
        None, ge=1, le=8,
        description="Bytes per KV-cache element; default 1 when engine.kv_cache_dtype is an fp8 type, else the "
                    "model's torch_dtype (2 for bf16).",
    )

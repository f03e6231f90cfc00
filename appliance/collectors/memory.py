"""Memory per replica: resident memory of its process tree, host memory, and the allocator statistics its
engine processes write through the appliance's vLLM plugin (``engine_plugin``).

Allocator statistics come per allocator ``kind``: ``cuda`` (PyTorch's caching allocator: device memory) and
``malloc`` (glibc: host heap). They are never summed together, since they are different memories. The
fragmentation ratio is free bytes the allocator holds over all bytes it holds: memory that is neither in use
nor available to the rest of the host, the layer the seed's field notes say only a restart gives back.

RSS sums every process of the tree, so pages shared between them (libraries, fork-inherited memory) count
once per process; it is an upper bound of what the replica costs the host.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.collectors.base import Clock, CollectorHealth, SafeCollector, ratio, replica_counter, replica_gauge
from appliance.collectors.procs import ProcessTable, ReplicaProcs

STATS_FILE = re.compile(r"^(\d+)\.json$")
TEMP_FILE = re.compile(r"^\.(\d+)\.json\.tmp$")
KINDS = ("cuda", "malloc")


@dataclass
class AllocatorTotals:
    """One replica's allocator of one kind, summed over its processes."""

    held_bytes: int = 0
    in_use_bytes: int = 0
    free_held_bytes: int = 0
    inactive_split_bytes: int = 0
    alloc_retries: int = 0
    ooms: int = 0

    def add(self, stats: dict[str, Any]) -> None:
        for field_name in self.__dataclass_fields__:
            setattr(self, field_name, getattr(self, field_name) + int(stats.get(field_name, 0) or 0))


class AllocatorStatsReader:
    """Reads ``<dir>/<pid>.json`` for the pids of each replica's tree; cleans up files of dead processes."""

    def __init__(self, directory: Path, *, max_age_seconds: float = 30.0, cleanup_seconds: float = 60.0,
                 clock: Clock = time.monotonic, wall_clock: Clock = time.time) -> None:
        self.directory = directory
        self._max_age = max_age_seconds
        self._cleanup_every = cleanup_seconds
        self._clock = clock
        self._wall = wall_clock
        self._cleaned_at = -float("inf")

    def read(self, snapshot: dict[str, ReplicaProcs]) -> dict[str, dict[str, AllocatorTotals]]:
        """replica -> kind -> totals over the replica's processes whose statistics are fresh."""
        self._maybe_clean_up()
        now = self._wall()
        result: dict[str, dict[str, AllocatorTotals]] = {}
        for name, procs in snapshot.items():
            for proc in procs.procs:
                stats = self._load(proc.pid, proc.create_time, now)
                if stats is None:
                    continue
                per_kind = result.setdefault(name, {})
                for kind in KINDS:
                    if isinstance(stats.get(kind), dict):
                        per_kind.setdefault(kind, AllocatorTotals()).add(stats[kind])
        return result

    def _load(self, pid: int, create_time: float, now: float) -> dict[str, Any] | None:
        try:
            stats = json.loads((self.directory / f"{pid}.json").read_text())
        except (OSError, ValueError):
            return None  # no file (this process has not written yet, or never will), or a foreign file
        if not isinstance(stats, dict) or stats.get("pid") != pid:
            return None
        written = stats.get("create_time")
        if written is not None and abs(float(written) - create_time) > 1.0:
            return None  # an earlier process with the same pid wrote it
        if now - float(stats.get("written_at", 0)) > self._max_age:
            return None  # the writer is hung or gone: old numbers would look like the present
        return stats

    def _maybe_clean_up(self) -> None:
        now = self._clock()
        if now - self._cleaned_at < self._cleanup_every:
            return
        self._cleaned_at = now
        self.clean_up()

    def clean_up(self) -> int:
        """Remove files whose process is gone (engines killed hard do not remove their own); return how many."""
        removed = 0
        try:
            names = [entry.name for entry in self.directory.iterdir()]
        except OSError:
            return 0
        for name in names:
            match = STATS_FILE.match(name) or TEMP_FILE.match(name)
            if match is None or psutil.pid_exists(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
                removed += 1
        return removed


class MemoryCollector(SafeCollector):
    name = "memory"

    def __init__(self, table: ProcessTable, reader: AllocatorStatsReader | None, *,
                 health: CollectorHealth | None = None) -> None:
        super().__init__(health)
        self._table = table
        self._reader = reader

    def families(self) -> Iterable[Metric]:
        sources: set[str] = set()
        page: list[Metric] = []
        with self.source("host_memory"):
            page += _host_families()
            sources.add("host_memory")
        snapshot: dict[str, ReplicaProcs] = {}
        with self.source("rss"):
            snapshot = self._table.snapshot()
            page.append(_rss_family(snapshot))
            if snapshot:
                sources.add("rss")
        if self._reader is not None:
            with self.source("allocator_files"):
                totals = self._reader.read(snapshot)
                page += _allocator_families(totals)
                if totals:
                    sources.add("allocator_files")
        self.health.set_sources(self.name, sources)
        return page


def _host_families() -> list[Metric]:
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    return [
        GaugeMetricFamily("appliance_host_memory_total_bytes", "Physical memory of the host, in bytes.",
                          value=memory.total),
        GaugeMetricFamily("appliance_host_memory_available_bytes", "Memory the host can give to new allocations "
                          "without swapping (MemAvailable), in bytes.", value=memory.available),
        GaugeMetricFamily("appliance_host_swap_used_bytes", "Swap in use on the host, in bytes; engines that swap "
                          "decode far slower.", value=swap.used),
    ]


def _rss_family(snapshot: dict[str, ReplicaProcs]) -> Metric:
    family = replica_gauge(
        "appliance_engine_resident_memory_bytes", "Resident memory (RSS) summed over a replica's process tree, in "
        "bytes; shared pages count once per process.")
    for name, procs in sorted(snapshot.items()):
        family.add_metric([name], procs.rss_bytes)
    return family


def _allocator_families(totals: dict[str, dict[str, AllocatorTotals]]) -> list[Metric]:
    reserved = replica_gauge(
        "appliance_engine_allocator_reserved_bytes", "Bytes a replica's allocators hold (cuda: PyTorch reserved "
        "device memory; malloc: glibc arenas + mmapped chunks), summed over its processes.", "kind")
    allocated = replica_gauge(
        "appliance_engine_allocator_allocated_bytes", "Bytes of the held memory in use by live allocations, "
        "summed over a replica's processes.", "kind")
    free_held = replica_gauge(
        "appliance_engine_allocator_free_held_bytes", "Bytes the allocators hold but have not handed out (free "
        "inside PyTorch's cache or glibc's arenas), summed over a replica's processes.", "kind")
    fragmentation = replica_gauge(
        "appliance_engine_memory_fragmentation_ratio", "Free bytes held by a replica's allocators over the bytes "
        "they hold (0..1); high and rising under steady load means fragmentation.", "kind")
    inactive = replica_gauge(
        "appliance_engine_allocator_inactive_split_bytes", "PyTorch CUDA allocator: free bytes inside split "
        "blocks (usable only by allocations that fit them), summed over a replica's processes.")
    retries = replica_counter(
        "appliance_engine_allocation_retries", "PyTorch CUDA allocations that failed, flushed the cache and were "
        "retried, summed over a replica's live processes (resets when they restart).")
    ooms = replica_counter(
        "appliance_engine_oom", "PyTorch CUDA out-of-memory errors, summed over a replica's live processes.")
    for replica, per_kind in sorted(totals.items()):
        for kind, total in sorted(per_kind.items()):
            reserved.add_metric([replica, kind], total.held_bytes)
            allocated.add_metric([replica, kind], total.in_use_bytes)
            free_held.add_metric([replica, kind], total.free_held_bytes)
            value = ratio(total.free_held_bytes, total.held_bytes)
            if value is not None:
                fragmentation.add_metric([replica, kind], value)
        cuda = per_kind.get("cuda")
        if cuda is not None:
            inactive.add_metric([replica], cuda.inactive_split_bytes)
            retries.add_metric([replica], cuda.alloc_retries)
            ooms.add_metric([replica], cuda.ooms)
    return [reserved, allocated, free_held, fragmentation, inactive, retries, ooms]

"""One-off probes of the host's peak memory bandwidth and FLOP/s: the denominators of MBU and MFU on CPU hosts
when the operator has not configured them.

They are estimates, taken once at start (before the engines load, so they neither disturb nor are disturbed by
serving), in about a second with buffers up to ``collectors.probe_max_buffer_bytes``:

- bandwidth: numpy copies of a buffer much larger than the last-level cache, best of a few, counting the bytes
  read plus the bytes written (as STREAM's "copy" does). Once with one thread, once with one thread pinned to
  each core: a single core cannot saturate the memory bus, so a replica's peak is
  ``min(all cores, one core x its cores)`` (bandwidth grows with cores until the bus is full).
- FLOP/s: float32 matrix products through numpy's BLAS on all cores, best of a few; a replica's peak is its
  share of the cores (compute scales with cores). INT8 (VNNI) or AMX BF16 engines can exceed this float32 peak,
  so their MFU reads high; configure ``peak_flops`` where that matters.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class HostPeaks:
    """What the probes measured; per-replica peaks derive from these."""

    single_core_bandwidth: float  # bytes/s
    all_cores_bandwidth: float  # bytes/s
    flops: float  # float32 FLOP/s on all cores
    cores: int

    def bandwidth_for(self, cores: int) -> float:
        return min(self.all_cores_bandwidth, self.single_core_bandwidth * max(1, cores))

    def flops_for(self, cores: int) -> float:
        return self.flops * min(1.0, max(1, cores) / max(1, self.cores))


def measure_host_peaks(buffer_bytes: int, *, max_buffer_bytes: int | None = None, repeats: int = 3) -> HostPeaks:
    """Probe once: copies on one core and on every core (same buffers), then the matmul."""
    cores = sorted(os.sched_getaffinity(0))
    size = probe_buffer_size(buffer_bytes, last_level_cache_bytes(cores), max_buffer_bytes)
    source = np.ones(max(1, size // 8), dtype=np.float64)  # ones, not empty: fault every page in now
    target = np.zeros_like(source)
    single = copy_bandwidth(source, target, cores[:1], repeats=repeats)
    every = copy_bandwidth(source, target, cores, repeats=repeats) if len(cores) > 1 else single
    del source, target
    return HostPeaks(single, max(single, every), matmul_flops(repeats=repeats), len(cores))


def probe_buffer_size(buffer_bytes: int, cache_bytes: int, max_buffer_bytes: int | None = None) -> int:
    """Each copy buffer's size: twice the last-level cache (so copies reach memory, not the cache), at least
    ``buffer_bytes``, at most ``max_buffer_bytes`` (never below ``buffer_bytes``): a VM here reports a 480 MiB
    cache, and faulting in 2 x 960 MiB took the probe 24-33 s of every start."""
    size = max(buffer_bytes, 2 * cache_bytes)
    return size if max_buffer_bytes is None else max(buffer_bytes, min(size, max_buffer_bytes))


def last_level_cache_bytes(cores: list[int]) -> int:
    """Sum of the distinct last-level caches serving ``cores`` (sysfs); 0 where sysfs does not say."""
    caches: dict[str, int] = {}
    for core in cores:
        levels = sorted(Path(f"/sys/devices/system/cpu/cpu{core}/cache").glob("index*"))
        if not levels:
            continue
        try:
            shared = (levels[-1] / "shared_cpu_list").read_text().strip()
            caches[shared] = _parse_size((levels[-1] / "size").read_text().strip())
        except (OSError, ValueError):
            continue
    return sum(caches.values())


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def copy_bandwidth(source: np.ndarray, target: np.ndarray, cores: list[int], *, repeats: int = 3) -> float:
    """Bytes/s (read + written) of copying ``source`` into ``target`` split across one pinned thread per core."""
    slices = np.array_split(np.arange(source.size), max(1, len(cores)))
    bounds = [(int(s[0]), int(s[-1]) + 1) for s in slices if s.size]
    best = float("inf")
    for _ in range(repeats):
        best = min(best, _timed_copy(source, target, bounds, cores))
    return 2 * source.nbytes / best


def _timed_copy(source: np.ndarray, target: np.ndarray, bounds: list[tuple[int, int]], cores: list[int]) -> float:
    if len(bounds) == 1:
        started = time.perf_counter()
        np.copyto(target, source)
        return time.perf_counter() - started
    barrier = threading.Barrier(len(bounds) + 1)

    def copy(part: int) -> None:
        _pin_thread(cores[part])
        barrier.wait()
        low, high = bounds[part]
        np.copyto(target[low:high], source[low:high])  # numpy releases the GIL for plain copies

    threads = [threading.Thread(target=copy, args=(i,), daemon=True) for i in range(len(bounds))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _pin_thread(core: int) -> None:
    """Pin the calling thread (pid 0 means the calling thread on Linux), so copies do not share a core."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {core})


def matmul_flops(*, repeats: int = 3, min_seconds: float = 0.02, max_size: int = 4096) -> float:
    """Float32 FLOP/s of a square matmul grown until one product takes ``min_seconds`` (timer resolution)."""
    size = 512
    while True:
        a = np.ones((size, size), dtype=np.float32)
        b = np.ones((size, size), dtype=np.float32)
        np.matmul(a, b)  # warm up: BLAS threads start, pages fault in
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            np.matmul(a, b)
            best = min(best, time.perf_counter() - started)
        if best >= min_seconds or size >= max_size:
            return 2 * size**3 / best
        size *= 2

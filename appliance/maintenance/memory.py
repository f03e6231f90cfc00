"""Memory signals that make a replica want a restart: allocator fragmentation and resident-memory growth.

Both come from the same sources as the memory collector (the replica's process tree, and the allocator
statistics the engine plugin writes), read in-process when the maintenance job runs. Growth is measured against
the lowest reading within the look-back since the replica's current process became ready: a starting engine's
few megabytes are not a baseline (against them a loaded model reads as 1000x growth), and a restart resets it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.engine.contract import Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReading:
    root_pid: int
    resident_bytes: int | None
    fragmentation_ratio: float | None  # the worst of the replica's allocators, 0..1
    serving: bool = True  # ready (or draining): its model is loaded and its KV cache allocated


class MemoryWatch:
    """Which replicas' memory crossed a threshold, and why."""

    def __init__(self, read: Callable[[], Mapping[str, MemoryReading]], *, fragmentation_threshold: float | None,
                 growth_threshold: float | None, growth_lookback_seconds: float) -> None:
        self._read = read
        self.fragmentation_threshold = fragmentation_threshold
        self.growth_threshold = growth_threshold
        self.growth_lookback_seconds = growth_lookback_seconds
        self._history: dict[str, tuple[int, deque[tuple[float, int]]]] = {}
        # The last check, kept for the alert webhook: an alert about memory acts only if these agree.
        self.readings: Mapping[str, MemoryReading] | None = None  # None: no reading (yet, or it failed)
        self.over: dict[str, str] = {}  # replica -> why it is over a threshold

    def check(self, now: float) -> dict[str, str]:
        """replica -> reason, for every replica over a threshold now."""
        try:
            readings = self._read()
        except Exception:  # a signal source must never stop the maintenance job
            log.exception("reading memory signals failed")
            self.readings, self.over = None, {}
            return {}
        wanted: dict[str, str] = {}
        for name, reading in readings.items():
            frag = reading.fragmentation_ratio
            if self.fragmentation_threshold is not None and frag is not None and frag > self.fragmentation_threshold:
                wanted[name] = f"fragmentation {frag:.2f} > {self.fragmentation_threshold:.2f}"
                continue
            growth = self._growth(name, reading, now)
            if self.growth_threshold is not None and growth is not None and growth > self.growth_threshold:
                wanted[name] = f"resident memory grew {growth:.0%} (> {self.growth_threshold:.0%})"
        for gone in set(self._history) - set(readings):
            del self._history[gone]
        self.readings, self.over = readings, wanted
        return dict(wanted)

    def _growth(self, name: str, reading: MemoryReading, now: float) -> float | None:
        if not reading.serving:  # starting or restarting: its memory is not yet what it serves with
            self._history.pop(name, None)
            return None
        if reading.resident_bytes is None:
            return None
        pid, samples = self._history.get(name, (reading.root_pid, deque()))
        if pid != reading.root_pid:  # restarted: the old process's memory says nothing about the new one
            samples = deque()
        samples.append((now, reading.resident_bytes))
        while samples and samples[0][0] < now - self.growth_lookback_seconds:
            samples.popleft()
        self._history[name] = (reading.root_pid, samples)
        lowest = min(value for _, value in samples)
        return reading.resident_bytes / lowest - 1 if lowest > 0 else None


def process_memory_reader(replicas: Callable[[], Sequence[Replica]], stats_dir: Path, *,
                          max_age_seconds: float) -> Callable[[], dict[str, MemoryReading]]:
    """Readings from the replicas' process trees and the engine plugin's allocator files."""
    from appliance.collectors.memory import AllocatorStatsReader
    from appliance.collectors.procs import ProcessTable
    from appliance.engine.contract import ReplicaState

    table = ProcessTable(replicas)
    reader = AllocatorStatsReader(stats_dir, max_age_seconds=max_age_seconds)

    def read() -> dict[str, MemoryReading]:
        serving = {r.name for r in replicas() if r.status.state in (ReplicaState.READY, ReplicaState.DRAINING)}
        snapshot = table.snapshot()
        totals = reader.read(snapshot)
        result = {}
        for name, procs in snapshot.items():
            ratios = [t.free_held_bytes / t.held_bytes for t in totals.get(name, {}).values() if t.held_bytes > 0]
            result[name] = MemoryReading(procs.root_pid, procs.rss_bytes, max(ratios) if ratios else None,
                                         serving=name in serving)
        return result

    return read

"""KV-cache occupancy and queue length per replica, and each replica's life cycle.

The engine readings are the ones the router already polls every second from each engine's /metrics (no second
poll of a ~100 KB page per scrape). They are re-exported under the gateway's own names, labelled by replica,
so that a rule or a dashboard can join them with the gateway's view (outstanding requests, limits) without
relabelling the engines' ``vllm:`` series. A reading older than ``max_age`` is omitted, not shown as 0: an
engine that stopped answering has an unknown queue, not an empty one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from appliance.collectors.base import Clock, CollectorHealth, SafeCollector, replica_counter, replica_gauge

if TYPE_CHECKING:
    from appliance.engine.contract import Replica
    from appliance.engine.load import EngineLoad

# (EngineLoad attribute, metric name, help)
LOAD_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("kv_cache_usage", "appliance_engine_kv_cache_usage_ratio",
     "Fraction (0..1) of the replica's KV-cache blocks in use, as its engine last reported."),
    ("waiting", "appliance_engine_requests_waiting",
     "Requests queued inside the replica's engine (not yet scheduled), as it last reported."),
    ("running", "appliance_engine_requests_running",
     "Requests the replica's engine is running (in the continuous batch), as it last reported."),
)


class EngineCollector(SafeCollector):
    name = "engine"

    def __init__(self, replicas: Callable[[], Sequence[Replica]],
                 router_load: Callable[[], Mapping[str, EngineLoad]], *,
                 max_age_seconds: float = 5.0, health: CollectorHealth | None = None,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(health)
        self._replicas = replicas
        self._router_load = router_load
        self._max_age = max_age_seconds
        self._clock = clock

    def families(self) -> Iterable[Metric]:
        sources: set[str] = set()
        page: list[Metric] = []
        replicas = list(self._replicas())
        with self.source("engine_load"):
            loads = self._fresh_loads()
            if loads:
                sources.add("engine_load")
            page += _load_families(loads)
        with self.source("replica_status"):
            page += _lifecycle_families(replicas)
            if replicas:
                sources.add("replica_status")
        self.health.set_sources(self.name, sources)
        return page

    def _fresh_loads(self) -> dict[str, EngineLoad]:
        now = self._clock()
        return {name: load for name, load in self._router_load().items() if now - load.read_at <= self._max_age}


def _load_families(loads: dict[str, EngineLoad]) -> list[Metric]:
    families: list[Metric] = []
    for attribute, metric, doc in LOAD_GAUGES:
        family = replica_gauge(metric, doc)
        for name, load in sorted(loads.items()):
            value = getattr(load, attribute, None)
            if value is not None:
                family.add_metric([name], float(value))
        families.append(family)
    return families


def _lifecycle_families(replicas: list[Replica]) -> list[Metric]:
    starts = replica_counter("appliance_replica_starts", "Engine processes started for the replica (first "
                             "start, restarts after crashes and maintenance restarts).")
    restarts = replica_counter("appliance_replica_restarts", "Restarts of the replica, after a crash or by "
                               "maintenance (drain + restart).")
    crashes = replica_counter("appliance_replica_crashes", "Times the replica's engine exited without being "
                              "asked to.")
    spawn_failures = replica_counter("appliance_replica_spawn_failures", "Times the replica's engine process "
                                     "could not even be started (ENOENT, ENOMEM, ENOSPC on its log...); the "
                                     "supervisor retries with backoff.")
    load = replica_gauge("appliance_replica_model_load_seconds", "Seconds from spawning the replica's engine to "
                         "its first healthy /health at its latest start (model load + warm-up).")
    restarted = replica_gauge("appliance_replica_last_restart_timestamp_seconds", "Unix time of the replica's "
                              "latest restart (absent until it has restarted once).")
    for replica in replicas:
        status, name = replica.status, replica.name
        starts.add_metric([name], status.starts)
        restarts.add_metric([name], status.restarts)
        crashes.add_metric([name], status.crashes)
        spawn_failures.add_metric([name], status.spawn_failures)
        if status.load_seconds is not None:
            load.add_metric([name], status.load_seconds)
        if status.starts > 1 and status.last_start_time is not None:
            restarted.add_metric([name], status.last_start_time)
    return [starts, restarts, crashes, spawn_failures, load, restarted]

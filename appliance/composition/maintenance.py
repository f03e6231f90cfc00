"""Maintenance as the settings describe it: its own section, plus the gateway's drain timeout and port, the routing
poll (a node's engine-side traffic), the collectors' engine statistics (the memory watch), the served model and the
engine key (the warm-up request), the role, the engine host and the lease token (restart leases), and the whole
configuration again for a reload. See ``appliance.composition`` for why this is not in ``appliance.maintenance``."""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from appliance.collectors import engine_stats_dir
from appliance.engine.contract import Replica
from appliance.engine.guard import engine_authorization
from appliance.engine.settings import EngineSettings
from appliance.maintenance.annotations import Annotator
from appliance.maintenance.confirm import AlertConfirmation
from appliance.maintenance.controller import MaintenanceController, http_warmer
from appliance.maintenance.coordination import (
    GatewayLeaseCoordinator,
    LeaseBoard,
    LocalCoordinator,
    RestartCoordinator,
)
from appliance.maintenance.engine_traffic import EngineTraffic
from appliance.maintenance.memory import MemoryWatch, process_memory_reader
from appliance.maintenance.metrics import MaintenanceCollector, MaintenanceMetrics
from appliance.maintenance.progress import ProgressMonitor
from appliance.maintenance.reload import ConfigReloader
from appliance.maintenance.rolling import RestartProcedure, RestartTimeouts, Warmer
from appliance.maintenance.scheduler import MaintenanceScheduler
from appliance.maintenance.service import DataPathView, Maintenance, engine_side_in_flight
from appliance.maintenance.traffic import TrafficSampler
from appliance.maintenance.webhook import AlertActions
from appliance.settings import Settings


def build_maintenance(settings: Settings, *, registry: CollectorRegistry, replicas: Callable[[], Sequence[Replica]],
                      data_path: DataPathView,
                      warm: Warmer | None = None, annotator: Annotator | None = None,
                      memory: MemoryWatch | None = None,
                      stage: Callable[[EngineSettings], None] | None = None,
                      unstage: Callable[[], None] | None = None) -> Maintenance:
    """Every piece of maintenance, wired to the data path through ``data_path``. ``stage``/``unstage``: the fleet's
    ``Reconfigurable`` methods when it can rebuild engine commands (``appliance reload``)."""
    m = settings.maintenance
    metrics = MaintenanceMetrics(registry, known_alerts=m.alert_actions)
    timeouts = RestartTimeouts(drain_seconds=settings.gateway.drain_timeout_seconds,
                               ready_seconds=m.restart_ready_timeout_seconds,
                               min_ready_wait_seconds=m.min_ready_wait_seconds)
    assert settings.served_model_name is not None  # Settings' own validator fills it in when unset
    warm = warm or http_warmer(settings.served_model_name, m.warmup_prompt, m.warmup_max_tokens,
                               headers=engine_authorization(settings.gateway.engine_key))
    annotator = annotator or Annotator(m.grafana_url, m.grafana_token, m.grafana_token_file)
    seen = traffic_seen(settings, replicas, data_path)
    traffic = TrafficSampler(seen.requests_total, seen.queue_length,
                             lookback_seconds=m.traffic_lookback_seconds, max_request_rate=m.max_request_rate,
                             max_queue=m.max_queue)
    progress = ProgressMonitor(lambda: [r.name for r in replicas()], data_path.loads,
                               hung_after_seconds=m.hung_after_seconds, in_flight=data_path.in_flight,
                               relayed_at=data_path.relayed_at)
    procedure = RestartProcedure(timeouts, warm, in_flight=seen.in_flight, refresh_in_flight=seen.refresh)
    controller = MaintenanceController(replicas, procedure, min_ready=m.min_ready_replicas,
                                       metrics=metrics, annotator=annotator, is_hung=progress.is_hung,
                                       is_ejected=data_path.is_ejected, coordinator=restart_coordinator(settings))
    if memory is None and settings.collectors.enabled:
        memory = memory_watch(settings, replicas)
    scheduler = MaintenanceScheduler(m, controller, traffic, progress, memory, refresh_traffic=seen.refresh)
    confirmation = AlertConfirmation(progress.is_hung, memory, fragmentation_ratio=m.alert_confirm_fragmentation_ratio)
    alerts = AlertActions(controller, metrics, whitelist=m.alert_actions, dry_run=m.alert_dry_run,
                          min_interval_seconds=m.alert_action_min_interval_seconds,
                          want_rolling_restart=scheduler.want_rolling_restart, confirmation=confirmation,
                          restarts_per_hour=m.alert_restarts_per_hour, max_per_payload=m.alert_max_per_payload,
                          clock=time.monotonic)

    def next_window() -> float | None:
        upcoming = scheduler.next_window()
        return upcoming.timestamp() if upcoming else None

    registry.register(MaintenanceCollector(progress.names, progress.is_hung, next_window))
    leases = LeaseBoard(replicas, min_ready=m.min_ready_replicas, max_ttl_seconds=m.coordinator_lease_seconds,
                        is_ejected=data_path.is_ejected) if settings.role == "gateway" else None
    return Maintenance(controller, scheduler, alerts, progress, config_reloader(settings, controller, stage, unstage),
                       leases)


@dataclass(frozen=True)
class TrafficSeen:
    """The traffic maintenance gates on and drains for, and how to read it afresh (None: always current)."""

    requests_total: Callable[[], float]
    queue_length: Callable[[], int]
    in_flight: Callable[[str], int]
    refresh: Callable[[], Awaitable[None]] | None = None


def traffic_seen(settings: Settings, replicas: Callable[[], Sequence[Replica]],
                 data_path: DataPathView) -> TrafficSeen:
    """The gateway's own counts; on a node pod its engines' (gateway pods bypass this node's gateway, so only its
    engines see all the traffic), read within the load poller's time limit."""
    if settings.role != "node":
        return TrafficSeen(data_path.requests_total, data_path.queue_length, data_path.in_flight)
    engines = EngineTraffic(replicas, gateway_queue=data_path.queue_length,
                            timeout_seconds=max(1.0, settings.routing.metrics_poll_seconds))
    in_flight = engine_side_in_flight(data_path.in_flight, engines, settings.routing.metrics_stale_seconds)
    return TrafficSeen(engines.requests_total, engines.queue_length, in_flight, engines.refresh)


def memory_watch(settings: Settings, replicas: Callable[[], Sequence[Replica]]) -> MemoryWatch:
    """Fragmentation and memory growth, from the statistics the collectors' engine plugin writes."""
    m, collectors = settings.maintenance, settings.collectors
    reader = process_memory_reader(replicas, engine_stats_dir(collectors, settings.state_dir),
                                   max_age_seconds=collectors.engine_stats_max_age_seconds)
    return MemoryWatch(reader, fragmentation_threshold=m.fragmentation_threshold,
                       growth_threshold=m.memory_growth_threshold,
                       growth_lookback_seconds=m.memory_growth_lookback_seconds)


def restart_coordinator(settings: Settings) -> RestartCoordinator:
    """Role node with ``maintenance.coordinator_url``: leases from that gateway; otherwise one host's own checks
    (settings refuse role node with maintenance enabled and no coordinator)."""
    m = settings.maintenance
    if settings.role != "node" or not m.coordinator_url:
        return LocalCoordinator()
    address = m.coordinator_address
    if address is None and settings.engine.host not in ("0.0.0.0", "::", ""):
        address = settings.engine.host
    holder = f"{socket.gethostname()}/{address or 'pod'}:{settings.gateway.port}"
    # The lease token opens the lease and nothing else: a node pod needs no admin token (docs/security.md).
    token = settings.gateway.lease_token or settings.gateway.admin_token
    return GatewayLeaseCoordinator(m.coordinator_url, token, holder=holder, address=address,
                                   lease_seconds=m.coordinator_lease_seconds,
                                   timeout_seconds=m.coordinator_timeout_seconds)


def config_reloader(settings: Settings, controller: MaintenanceController,
                    stage: Callable[[EngineSettings], None] | None,
                    unstage: Callable[[], None] | None) -> ConfigReloader[Settings]:
    """``appliance reload``: these settings, read again from the file, overrides and environment they came from."""
    source = settings.source
    return ConfigReloader(settings, controller, stage, unstage, load=source.load if source is not None else None)

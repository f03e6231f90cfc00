"""Maintenance wired together: ``build_maintenance`` makes every piece from the settings and what it needs to
know of the data path (requests in flight, the engines' load readings, the queue, the request counter), given
as plain callables so that maintenance never depends on the gateway; ``Maintenance`` starts and stops them with
the app's lifespan."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from appliance.collectors import engine_stats_dir
from appliance.engine.contract import Replica
from appliance.engine.load import EngineLoad
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
from appliance.maintenance.traffic import TrafficSampler
from appliance.maintenance.webhook import AlertActions
from appliance.settings import Settings


@dataclass
class Maintenance:
    controller: MaintenanceController
    scheduler: MaintenanceScheduler
    alerts: AlertActions
    progress: ProgressMonitor
    reloader: ConfigReloader
    leases: LeaseBoard | None = None  # role gateway: the restart leases it grants node pods

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        self.scheduler.stop()
        await self.controller.close()

    def status(self) -> dict[str, Any]:
        leases = {"restart_lease": self.leases.status()} if self.leases is not None else {}
        return {**self.scheduler.status(), **self.controller.status(), **leases}


@dataclass(frozen=True)
class DataPathView:
    """What maintenance reads of the data path."""

    in_flight: Callable[[str], int]  # requests in flight at a replica
    loads: Callable[[], Mapping[str, EngineLoad]]  # the latest engine readings, by replica
    queue_length: Callable[[], int]  # requests waiting in the gateway
    requests_total: Callable[[], float]  # every request answered so far (a counter)
    relayed_at: Callable[[str], float | None] = lambda _name: None  # when bytes from a replica were last relayed
    # the router's own ejection (not softened by its panic mode): an ejected replica is no capacity
    is_ejected: Callable[[str], bool] = lambda _name: False


def build_maintenance(settings: Settings, *, registry: CollectorRegistry, replicas: Callable[[], Sequence[Replica]],
                      data_path: DataPathView,
                      warm: Warmer | None = None, annotator: Annotator | None = None,
                      memory: MemoryWatch | None = None,
                      stage: Callable[[EngineSettings], None] | None = None,
                      unstage: Callable[[], None] | None = None) -> Maintenance:
    """``stage``/``unstage``: the fleet's ``Reconfigurable`` methods when it can rebuild engine commands
    (``appliance reload``)."""
    m = settings.maintenance
    metrics = MaintenanceMetrics(registry, known_alerts=m.alert_actions)
    timeouts = RestartTimeouts(drain_seconds=settings.gateway.drain_timeout_seconds,
                               ready_seconds=m.restart_ready_timeout_seconds,
                               min_ready_wait_seconds=m.min_ready_wait_seconds)
    assert settings.served_model_name is not None  # Settings' own validator fills it in when unset
    warm = warm or http_warmer(settings.served_model_name, m.warmup_prompt, m.warmup_max_tokens)
    annotator = annotator or Annotator(m.grafana_url, m.grafana_token, m.grafana_token_file)
    requests_total, queue_length, refresh_traffic = data_path.requests_total, data_path.queue_length, None
    in_flight, refresh_in_flight = data_path.in_flight, None
    if settings.role == "node":  # gateway pods bypass this node's gateway: its engines see all the traffic
        engines = EngineTraffic(replicas, gateway_queue=data_path.queue_length,  # the load poller's time limit
                                timeout_seconds=max(1.0, settings.routing.metrics_poll_seconds))
        requests_total, queue_length, refresh_traffic = engines.requests_total, engines.queue_length, engines.refresh
        in_flight = engine_side_in_flight(data_path.in_flight, engines, settings.routing.metrics_stale_seconds)
        refresh_in_flight = engines.refresh
    traffic = TrafficSampler(requests_total, queue_length,
                             lookback_seconds=m.traffic_lookback_seconds, max_request_rate=m.max_request_rate,
                             max_queue=m.max_queue)
    progress = ProgressMonitor(lambda: [r.name for r in replicas()], data_path.loads,
                               hung_after_seconds=m.hung_after_seconds, in_flight=data_path.in_flight,
                               relayed_at=data_path.relayed_at)
    procedure = RestartProcedure(timeouts, warm, in_flight=in_flight, refresh_in_flight=refresh_in_flight)
    controller = MaintenanceController(replicas, procedure, min_ready=m.min_ready_replicas,
                                       metrics=metrics, annotator=annotator, is_hung=progress.is_hung,
                                       is_ejected=data_path.is_ejected, coordinator=restart_coordinator(settings))
    if memory is None and settings.collectors.enabled:
        memory = MemoryWatch(process_memory_reader(replicas, engine_stats_dir(settings.collectors, settings.state_dir),
                                                   max_age_seconds=settings.collectors.engine_stats_max_age_seconds),
                             fragmentation_threshold=m.fragmentation_threshold,
                             growth_threshold=m.memory_growth_threshold,
                             growth_lookback_seconds=m.memory_growth_lookback_seconds)
    scheduler = MaintenanceScheduler(m, controller, traffic, progress, memory, refresh_traffic=refresh_traffic)
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
    return Maintenance(controller, scheduler, alerts, progress, ConfigReloader(settings, controller, stage, unstage),
                       leases)


def engine_side_in_flight(own: Callable[[str], int], engines: EngineTraffic,
                          stale_seconds: float) -> Callable[[str], int]:
    """A node's drain before a restart waits for what its engine reports running or waiting too: gateway pods'
    requests go straight to the engine, past this node's router (a reading older than ``stale_seconds`` says
    nothing). Its own router's requests are in the engine's count as well, hence the larger of the two."""

    def in_flight(name: str) -> int:
        engine = engines.in_flight(name, stale_seconds)
        return own(name) if engine is None else max(own(name), engine)

    return in_flight


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
    return GatewayLeaseCoordinator(m.coordinator_url, settings.gateway.admin_token, holder=holder, address=address,
                                   lease_seconds=m.coordinator_lease_seconds,
                                   timeout_seconds=m.coordinator_timeout_seconds)

"""Maintenance wired together: ``Maintenance`` holds every piece and starts and stops them with the app's lifespan;
``DataPathView`` is what maintenance knows of the data path (requests in flight, the engines' load readings, the
queue, the request counter), given as plain callables so that maintenance never depends on the gateway.

The pieces are made by ``appliance.composition.maintenance.build_maintenance``: besides maintenance's own section
they read the gateway's drain timeout, the routing poll, the collectors' statistics and the role, and only the
composition layer reads several sections of the settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.engine.load import EngineLoad
from appliance.maintenance.controller import MaintenanceController
from appliance.maintenance.coordination import LeaseBoard
from appliance.maintenance.engine_traffic import EngineTraffic
from appliance.maintenance.progress import ProgressMonitor
from appliance.maintenance.reload import ConfigReloader
from appliance.maintenance.scheduler import MaintenanceScheduler
from appliance.maintenance.webhook import AlertActions


@dataclass
class Maintenance:
    controller: MaintenanceController
    scheduler: MaintenanceScheduler
    alerts: AlertActions
    progress: ProgressMonitor
    # Of the appliance's settings, whose type this package does not import (appliance.maintenance.reload)
    reloader: ConfigReloader[Any]
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


def engine_side_in_flight(own: Callable[[str], int], engines: EngineTraffic,
                          stale_seconds: float) -> Callable[[str], int]:
    """A node's drain before a restart waits for what its engine reports running or waiting too: gateway pods'
    requests go straight to the engine, past this node's router (a reading older than ``stale_seconds`` says
    nothing). Its own router's requests are in the engine's count as well, hence the larger of the two."""

    def in_flight(name: str) -> int:
        engine = engines.in_flight(name, stale_seconds)
        return own(name) if engine is None else max(own(name), engine)

    return in_flight

"""Restartable replica doubles (from tests.doubles), controllable clocks, a hung replica as the app's own progress
monitor sees one, Alertmanager payloads and the maintenance counters, and a scheduler rig under a controllable clock."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry

from appliance.context import context_of
from appliance.maintenance.controller import MaintenanceController
from appliance.maintenance.memory import MemoryReading, MemoryWatch
from appliance.maintenance.metrics import MaintenanceMetrics
from appliance.maintenance.progress import ProgressMonitor
from appliance.maintenance.rolling import RestartProcedure, RestartTimeouts
from appliance.maintenance.scheduler import MaintenanceScheduler
from appliance.maintenance.settings import MaintenanceSettings
from appliance.maintenance.traffic import TrafficSampler
from tests.doubles import restartable_fleet
from tests.fake_engine import FakeEngine

fleet = restartable_fleet
AUTH = {"authorization": "Bearer t0ken"}  # the admin token of the apps conftest.py builds


class Clock:
    """Wall time (aware datetime) and a monotonic reading that move together, by hand."""

    def __init__(self, start: datetime) -> None:
        self.wall = start
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds

    def set(self, moment: datetime) -> None:
        self.mono += (moment - self.wall).total_seconds()
        self.wall = moment


def judge_hung(client, *names: str) -> None:
    """Make the app's own progress monitor find ``names`` hung the way it does in production: engine readings
    (recorded through the router, as its load poller does) with requests running and a generation counter that
    stands still for the whole hung period; a fake engine behind such a replica reports the same from then on."""
    from appliance.engine.load import EngineLoad

    router = context_of(client.app).gateway.router
    progress = context_of(client.app).maintenance.progress
    for replica in router.replicas():
        engine = FakeEngine.serving(replica.url) if replica.name in names else None
        if engine is not None:  # its own /metrics says the same, or the app's next load poll would contradict it
            engine.running, engine.generation_tokens_total = 1, 7
    now = time.monotonic()
    for at in (now - progress.hung_after_seconds, now):
        for name in names:
            router.update_load(name, EngineLoad(running=1, generation_tokens_total=7, read_at=at))
        progress.check(at)
    assert set(names) <= set(progress.hung())


def alert(name: str, status: str = "firing", replica: str | None = "replica-0", fingerprint: str = "f1",
          starts: str = "2026-12-02T03:00:00Z") -> dict:
    labels = {"alertname": name, "severity": "critical"} | ({"replica": replica} if replica else {})
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": starts, "endsAt": "",
            "generatorURL": "", "fingerprint": fingerprint}


def payload(*alerts: dict) -> dict:
    return {"version": "4", "status": alerts[0]["status"], "receiver": "appliance", "groupKey": "{}:{}",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "truncatedAlerts": 0,
            "alerts": list(alerts)}


def wait_idle(client) -> dict:
    for _ in range(200):
        status = client.get("/admin/status", headers=AUTH).json()
        if not status["maintenance"]["restarting"] and not status["maintenance"]["rolling_restart_in_progress"]:
            return status
        time.sleep(0.02)
    raise AssertionError("maintenance still busy")


def actions(registry, action: str, result: str, trigger: str = "alert") -> float:
    return registry.get_sample_value("appliance_maintenance_actions_total",
                                     {"action": action, "trigger": trigger, "result": result}) or 0


TIMEOUTS = RestartTimeouts(drain_seconds=1, ready_seconds=1, min_ready_wait_seconds=0.2, poll_seconds=0.01)


async def warm(_replica) -> bool:
    return True


class Rig:
    """A scheduler over two stub replicas; traffic and memory set by hand; the clock moves in 15 s checks."""

    def __init__(self, start: datetime, **settings) -> None:
        self.clock = Clock(start)
        self.requests = 0.0
        self.queue = 0
        self.fragmentation = 0.1
        self.replicas = fleet(["http://a", "http://b"])
        self.settings = MaintenanceSettings(enabled=True, window_cron="0 3 * * *", window_duration_seconds=3600,
                                            traffic_lookback_seconds=60, max_request_rate=1.0, max_queue=0,
                                            check_interval_seconds=15, **settings)
        self.registry = CollectorRegistry()
        self.controller = MaintenanceController(lambda: self.replicas, RestartProcedure(TIMEOUTS, warm), min_ready=1,
                                                metrics=MaintenanceMetrics(self.registry))
        traffic = TrafficSampler(lambda: self.requests, lambda: self.queue, lookback_seconds=60,
                                 max_request_rate=1.0, max_queue=0)
        progress = ProgressMonitor(lambda: [r.name for r in self.replicas], dict, hung_after_seconds=60)
        memory = MemoryWatch(lambda: {"replica-1": MemoryReading(42, 10**9, self.fragmentation)},
                             fragmentation_threshold=self.settings.fragmentation_threshold, growth_threshold=None,
                             growth_lookback_seconds=600)
        self.scheduler = MaintenanceScheduler(self.settings, self.controller, traffic, progress, memory,
                                              now=self.clock.now, monotonic=self.clock.monotonic)

    def run(self, minutes: float, *, rate: float) -> list[str]:
        """Check every 15 s for ``minutes`` at ``rate`` requests/s; let a started restart finish."""

        async def go() -> list[str]:
            decisions = []
            for _ in range(int(minutes * 4)):
                decisions.append(await self.scheduler.check())
                while self.controller.busy:
                    await asyncio.sleep(0.01)
                self.clock.advance(15)
                self.requests += rate * 15
            return decisions

        return asyncio.run(go())

    def restarts(self) -> list[int]:
        return [r.status.restarts for r in self.replicas]

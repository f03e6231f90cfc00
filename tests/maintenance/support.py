"""Restartable stub replicas (the gateway's stubs plus a life cycle) and controllable clocks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tests.gateway.stub import StubReplica, StubStatus


@dataclass
class RestartableStatus(StubStatus):
    restarts: int = 0
    last_ready_time: float | None = None
    hold_when_ready: bool = False


@dataclass
class RestartableStub(StubReplica):
    """Drain/undrain like the gateway's stub; ``restart`` takes ``restart_seconds`` and comes back held (drained)
    when maintenance asked for it; ``comes_back=False`` never does."""

    status: RestartableStatus = field(default_factory=RestartableStatus)
    restart_seconds: float = 0.05
    comes_back: bool = True
    events: list = field(default_factory=list)
    fleet: list = field(default_factory=list)  # every stub, to see how many were routable during a restart

    async def restart(self) -> None:
        routable_others = sum(r.routable for r in self.fleet if r is not self)
        self.events.append(("restart", self.name, routable_others, self.status.planned_restart))
        self.routable = False
        self.status.restarts += 1
        if not self.comes_back:
            return

        async def come_back() -> None:
            await asyncio.sleep(self.restart_seconds)
            self.status.last_ready_time = time.time()
            self.routable = not self.status.hold_when_ready
            if not self.status.hold_when_ready:
                self.status.planned_restart = False

        asyncio.get_running_loop().create_task(come_back())

    def drain(self) -> None:
        self.events.append(("drain", self.name))
        super().drain()

    def undrain(self) -> None:
        self.events.append(("undrain", self.name))
        super().undrain()


def fleet(urls: list[str], **kwargs) -> list[RestartableStub]:
    events: list = []
    stubs = [RestartableStub(f"replica-{i}", url, events=events, **kwargs) for i, url in enumerate(urls)]
    for stub in stubs:
        stub.fleet = stubs
    return stubs


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

"""Test doubles: replicas built on ``appliance.engine.contract.Replica``, one for every test that needs a replica
without an engine (routing, admission, maintenance, collectors), and the one fake clock. (An engine to talk to is
tests/fake_engine.py.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from appliance.engine.contract import NotRestartable, ReplicaState, ReplicaStatus
from appliance.engine.placement import Placement


class FakeClock:
    """A clock that stands still until the test moves it, for code that takes ``clock: Callable[[], float]``
    (monotonic seconds): read it by calling it; ``advance`` it, or set ``now``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeReplica:
    """A replica at ``url`` that the test moves in and out of routing by hand (``routable``)."""

    name: str
    url: str = "http://127.0.0.1:1"
    routable: bool = True
    status: ReplicaStatus = field(default_factory=lambda: ReplicaStatus(state=ReplicaState.READY))
    placement: Placement | None = None
    kv_cache_space_bytes: int | None = None
    restartable: bool = False
    drainable: bool = True

    def drain(self) -> None:
        self.routable = False
        self.status.state = ReplicaState.DRAINING

    def undrain(self) -> None:
        self.routable = True
        self.status.state = ReplicaState.READY

    async def restart(self) -> None:
        raise NotRestartable(self.name)


@dataclass
class RestartableReplica(FakeReplica):
    """``restart`` takes ``restart_seconds`` and comes back held (drained) when maintenance asked for it;
    ``comes_back=False`` never does. ``events`` records drains, undrains and restarts of the whole ``fleet``."""

    restartable: bool = True
    restart_seconds: float = 0.05
    comes_back: bool = True
    events: list = field(default_factory=list)
    fleet: list = field(default_factory=list)  # every replica, to see how many were routable during a restart

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


def restartable_fleet(urls: list[str], **kwargs) -> list[RestartableReplica]:
    events: list = []
    replicas = [RestartableReplica(f"replica-{i}", url, events=events, **kwargs) for i, url in enumerate(urls)]
    for replica in replicas:
        replica.fleet = replicas
    return replicas


def cpu_replica(name: str, pid: int | None, cores: tuple[int, ...] = (0,), kv_gib: float | None = None
                ) -> FakeReplica:
    status = ReplicaStatus(state=ReplicaState.READY, pid=pid, starts=1)
    return FakeReplica(name, status=status, placement=Placement("cpu", cores=cores),
                       kv_cache_space_bytes=int(kv_gib * 2**30) if kv_gib else None)


def gpu_replica(name: str, pid: int | None, gpus: tuple[int, ...]) -> FakeReplica:
    status = ReplicaStatus(state=ReplicaState.READY, pid=pid, starts=1)
    return FakeReplica(name, status=status, placement=Placement("cuda", gpus=gpus))

"""Restarting replicas without failing requests: one replica's drain -> restart -> ready -> warm -> undrain, and
the rolling restart that does it to every replica in turn.

Why each step:
- ``planned_restart`` is set before the replica leaves routing: while it is set, the gateway queues requests it
  cannot place (up to their queue timeout) instead of answering 503. That is what keeps a single-replica
  appliance, or one whose other replicas are drained, from failing requests during the restart.
- The replica comes back drained (``hold_when_ready``) and takes traffic only after it answered a warm-up
  request: the first request after a start pays for lazy initialisation, and a client should not.
- A rolling restart never leaves fewer than ``min_ready_replicas`` routable and not ejected (capped at
  replicas - 1, so a single replica can still be restarted): it waits for them up to ``min_ready_wait_seconds``,
  then skips. An ejected replica gets no traffic, or all of it once the router panics: it is no capacity.
- A replica that is not back within ``restart_ready_timeout_seconds`` aborts the rolling restart, so the
  replicas not yet restarted keep serving; it rejoins routing by itself if it becomes healthy later.
- Beyond one host (role node) each replica's restart also needs a lease from the ``RestartCoordinator``
  (appliance/maintenance/coordination.py): one node at a time, and only while the fleet keeps its minimum. A
  lease not granted within ``min_ready_wait_seconds`` skips the rest with ``retry`` set: the schedule tries again
  later in the same window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from appliance.engine.contract import Replica, ReplicaStatus
from appliance.maintenance.coordination import LeaseAnswer, LocalCoordinator, RestartCoordinator, hold_lease

log = logging.getLogger(__name__)

Warmer = Callable[[Replica], Awaitable[bool]]


@dataclass(frozen=True)
class RestartTimeouts:
    drain_seconds: float
    ready_seconds: float
    min_ready_wait_seconds: float = 60.0
    poll_seconds: float = 0.2


@dataclass(frozen=True)
class Outcome:
    result: str  # ok | aborted | skipped | failed
    detail: str
    restarted: tuple[str, ...] = ()
    retry: bool = False  # skipped for a reason that may pass soon (another node holds the restart lease)


class RestartProcedure:
    """Restart one replica so that no request fails because of it."""

    REFRESH_SECONDS = 1.0

    def __init__(self, timeouts: RestartTimeouts, warm: Warmer, *,
                 in_flight: Callable[[str], int] = lambda _name: 0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 refresh_in_flight: Callable[[], Awaitable[None]] | None = None) -> None:
        """``in_flight(name)``: the requests in flight at a replica (its drain waits for 0): the gateway's, and
        on a node pod its engine's own count too, read again by ``refresh_in_flight`` every
        ``REFRESH_SECONDS`` of the drain."""
        self.timeouts = timeouts
        self._warm = warm
        self._in_flight = in_flight
        self.clock = clock
        self.sleep = sleep
        self._refresh_in_flight = refresh_in_flight

    async def run(self, replica: Replica, *, drain_seconds: float | None = None) -> Outcome:
        """``drain_seconds`` overrides the drain timeout (0 for a hung replica: its requests will not finish)."""
        status = replica.status
        status.planned_restart = True
        status.hold_when_ready = True
        done = False
        try:
            replica.drain()
            drain = self.timeouts.drain_seconds if drain_seconds is None else drain_seconds
            left = await self.wait_until(lambda: self._in_flight(replica.name) == 0, drain,
                                         refresh=self._refresh_in_flight)
            if not left:
                log.warning("%s: %d request(s) still in flight after the drain timeout; restarting anyway",
                            replica.name, self._in_flight(replica.name))
            since = time.time()
            await replica.restart()
            deadline = self.clock() + self.timeouts.ready_seconds
            if not await self.wait_until(lambda: _ready_since(status, since), deadline - self.clock()):
                return Outcome("aborted", f"{replica.name} not ready {self.timeouts.ready_seconds:.0f}s after "
                               "its restart")
            while not await self._warm(replica):
                if self.clock() >= deadline:
                    return Outcome("aborted", f"{replica.name} is up but did not answer its warm-up request")
                await self.sleep(1.0)
            status.hold_when_ready = False
            replica.undrain()
            status.planned_restart = False
            done = True
            return Outcome("ok", f"{replica.name} restarted and warmed", (replica.name,))
        finally:
            if not done:  # let it rejoin by itself if it recovers; stop holding requests for it
                status.hold_when_ready = False
                status.planned_restart = False

    async def wait_until(self, condition: Callable[[], bool], seconds: float,
                         refresh: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Poll ``condition`` on this procedure's clock; False when ``seconds`` pass first. ``refresh`` (what the
        condition reads over the network) runs first and then every ``REFRESH_SECONDS``."""
        deadline = self.clock() + seconds
        refreshed = None
        while True:
            if refresh is not None and (refreshed is None or self.clock() - refreshed >= self.REFRESH_SECONDS):
                refreshed = self.clock()
                try:
                    await refresh()
                except Exception:  # noqa: BLE001 - a failed read leaves the last one, which ages out
                    log.exception("reading the engines' request counts failed")
            if condition():
                return True
            if self.clock() >= deadline:
                return False
            await self.sleep(self.timeouts.poll_seconds)


def _ready_since(status: ReplicaStatus, since: float) -> bool:
    """The engine answered /health after ``since`` (it is then held drained, or ready if nobody held it)."""
    return (status.last_ready_time or 0) >= since


class RollingRestart:
    """Every replica, one at a time, in order."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], procedure: RestartProcedure, *, min_ready: int,
                 on_replica: Callable[[Replica, Outcome], None] = lambda _r, _o: None,
                 is_ejected: Callable[[str], bool] = lambda _name: False,
                 coordinator: RestartCoordinator | None = None) -> None:
        self._replicas = replicas
        self.coordinator = coordinator or LocalCoordinator()
        self.procedure = procedure
        self.min_ready = min_ready
        self._on_replica = on_replica
        self._is_ejected = is_ejected
        self.current: str | None = None

    async def run(self) -> Outcome:
        replicas = list(self._replicas())
        needed = min(self.min_ready, len(replicas) - 1)
        restarted: list[str] = []
        for replica in replicas:
            others = [r for r in replicas if r is not replica]

            def others_enough(others: Sequence[Replica] = others) -> bool:
                return self._serving(others) >= needed

            enough = await self.procedure.wait_until(others_enough, self.procedure.timeouts.min_ready_wait_seconds)
            if not enough:
                return Outcome("skipped", f"fewer than {needed} other replica(s) routable and not ejected; "
                               f"{replica.name} and the rest not restarted", tuple(restarted))
            lease = await self._lease(replica)
            if not lease.granted:
                return Outcome("skipped", f"no restart lease for {replica.name}: {lease.detail}",
                               tuple(restarted), retry=True)
            self.current = replica.name
            stop = asyncio.Event()
            keeper = asyncio.create_task(hold_lease(self.coordinator, replica, stop), name="restart-lease")
            try:
                outcome = await self.procedure.run(replica)
            finally:
                self.current = None
                stop.set()
                await asyncio.gather(keeper, return_exceptions=True)
                await self.coordinator.release(replica)
            self._on_replica(replica, outcome)
            if outcome.result != "ok":
                return Outcome("aborted", outcome.detail, tuple(restarted))
            restarted.append(replica.name)
        return Outcome("ok", f"restarted {', '.join(restarted)}", tuple(restarted))

    async def _lease(self, replica: Replica) -> LeaseAnswer:
        """Ask the coordinator until it grants, for up to ``min_ready_wait_seconds``; the last answer."""
        clock, sleep = self.procedure.clock, self.procedure.sleep
        deadline = clock() + self.procedure.timeouts.min_ready_wait_seconds
        while True:
            answer = await self.coordinator.acquire(replica)
            if answer.granted or clock() >= deadline:
                if not answer.granted:
                    log.info("maintenance: %s", answer.detail)
                return answer
            await sleep(self.coordinator.retry_seconds)

    def _serving(self, replicas: Sequence[Replica]) -> int:
        return sum(1 for r in replicas if r.routable and not self._is_ejected(r.name))

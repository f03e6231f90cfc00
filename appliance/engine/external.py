"""Engines the appliance does not run itself (started by an orchestrator, or another host's vLLM): the gateway
routes to them by URL and follows their health, but never starts, restarts or stops them."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from appliance.engine.contract import NotRestartable, ReplicaState, ReplicaStatus
from appliance.engine.health import HEALTH_PROBE_TIMEOUT_SECONDS, Health, HealthFailures, probe_health

log = logging.getLogger(__name__)


class ExternalReplica:
    """Satisfies ``appliance.engine.contract.Replica``; draining only stops the gateway routing to it."""

    HEALTH_INTERVAL_SECONDS = 2.0
    HEALTH_FAILURES_UNHEALTHY = 3
    restartable = False
    drainable = True
    placement = None
    kv_cache_space_bytes = None

    def __init__(self, index: int, url: str, health_timeout_seconds: float = HEALTH_PROBE_TIMEOUT_SECONDS) -> None:
        self.name = f"external-{index}"
        self.url = url.rstrip("/")
        self.health_timeout_seconds = health_timeout_seconds
        self.status = ReplicaStatus(state=ReplicaState.STARTING)
        self._task: asyncio.Task[None] | None = None

    @property
    def routable(self) -> bool:
        return self.status.state is ReplicaState.READY

    def drain(self) -> None:
        if self.status.state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            self.status.state = ReplicaState.DRAINING

    def undrain(self) -> None:
        if self.status.state is ReplicaState.DRAINING:
            self.status.state = ReplicaState.STARTING  # the next green health check makes it ready

    async def restart(self) -> None:
        raise NotRestartable(f"{self.name} ({self.url}) is not run by this appliance")

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._watch(session), name=f"{self.name}-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.status.state = ReplicaState.STOPPED

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        failures = HealthFailures(self.status, self.health_timeout_seconds + self.HEALTH_INTERVAL_SECONDS)
        while True:
            health = await probe_health(session, self.url, self.health_timeout_seconds)
            counted = failures.record(health)
            state = self.status.state
            if health is Health.OK and state in (ReplicaState.STARTING, ReplicaState.UNHEALTHY):
                log.info("%s (%s) is healthy", self.name, self.url)
                self.status.state = ReplicaState.READY
            elif counted >= self.HEALTH_FAILURES_UNHEALTHY and state is ReplicaState.READY:
                log.warning("%s (%s) failed %d health checks", self.name, self.url, counted)
                self.status.state = ReplicaState.UNHEALTHY
            await asyncio.sleep(self.HEALTH_INTERVAL_SECONDS if self.routable else 0.5)


class ExternalFleet:
    """The supervisor's interface over external engines: start/stop only follow health."""

    def __init__(self, urls: list[str], health_timeout_seconds: float = HEALTH_PROBE_TIMEOUT_SECONDS) -> None:
        self.replicas = [ExternalReplica(i, url, health_timeout_seconds) for i, url in enumerate(urls)]
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        for replica in self.replicas:
            replica.start(self._session)

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas))
        if self._session is not None:
            await self._session.close()

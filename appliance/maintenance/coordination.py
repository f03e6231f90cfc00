"""Restarts that span hosts: one node at a time, and never below the fleet's ``min_ready_replicas``.

On one host the controller sees every replica, so its own capacity check is the whole story (``LocalCoordinator``:
it grants every lease). A node pod sees only its own engines: on a one-engine node its local minimum is 0 (capped
at replicas - 1), and every node pod shares one configuration, so without coordination all of them would restart
their only engine at the same window start. So a node's rolling restart asks, before each replica, for a
**restart lease** from a coordinator with a fleet-wide view:

- ``GatewayLeaseCoordinator`` (the node side): asks a gateway (``maintenance.coordinator_url``, lease token) for
  the lease, renews it while the restart runs, and releases it once the replica is back, ready and warmed. Any
  failure to reach the coordinator is a refusal: a node that cannot ask does not restart.
- ``LeaseBoard`` (the gateway side): one holder at a time, and a lease only while the gateway's discovery view
  keeps at least ``min_ready_replicas`` engines routable and not ejected *besides* the ones the holder takes out.
  A lease expires ``ttl`` after its last renewal, so a node that dies holding it frees it; that node's engines are
  then not routable in the gateway's view, so the capacity check still holds for the next holder.

Why a gateway and not a Kubernetes Lease object: the gateway already has the one view that matters (what is
routable, from discovery and health), while a Lease alone would serialise restarts without knowing capacity.
The board lives in one process's memory: exclusivity holds among the nodes that ask the same gateway process
(docs/maintenance.md says how to point every node at one). Were the board lost (that gateway restarted) while a
node holds a lease, the capacity check still refuses any lease that would take the fleet below the minimum.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from appliance.engine.contract import Replica
from appliance.maintenance.errors import BelowMinReady, MaintenanceBusy, MaintenanceError

log = logging.getLogger(__name__)

LEASE_PATH = "/maintenance/lease"  # the lease token's (or the admin token's) route; /admin/maintenance/lease: admin


@dataclass(frozen=True)
class LeaseAnswer:
    granted: bool
    detail: str


class RestartCoordinator(Protocol):
    """Who may take a replica out of the fleet for a restart, now."""

    #: how often a refused holder asks again while it waits (seconds)
    retry_seconds: float
    #: how often a holder renews its lease while the restart runs (seconds)
    renew_seconds: float

    async def peek(self) -> LeaseAnswer:
        """Whether asking now could succeed (nobody else holds the lease); cheap, grants nothing. The schedule
        waits on it rather than starting (and recording) a rolling restart that would only wait and skip."""
        ...

    async def acquire(self, replica: Replica) -> LeaseAnswer: ...

    async def renew(self, replica: Replica) -> bool: ...

    async def release(self, replica: Replica) -> None: ...

    async def close(self) -> None: ...


class LocalCoordinator:
    """One host: the controller's own capacity check sees the whole fleet, so every lease is granted."""

    retry_seconds = 1.0
    renew_seconds = 3600.0

    async def peek(self) -> LeaseAnswer:
        return LeaseAnswer(True, "local")

    async def acquire(self, replica: Replica) -> LeaseAnswer:
        return LeaseAnswer(True, "local: the controller's own capacity check covers the fleet")

    async def renew(self, replica: Replica) -> bool:
        return True

    async def release(self, replica: Replica) -> None:
        return None

    async def close(self) -> None:
        return None


class LeaseHeld(MaintenanceBusy):
    code = "restart_lease_held"


class EnginesNotInView(MaintenanceError):
    """The coordinator does not see the engines a holder names: it cannot judge what their restart takes away
    (typically ``maintenance.coordinator_address`` does not match the address discovery returns)."""

    code = "engines_not_in_view"


class NotCoordinator(MaintenanceError):
    code = "not_a_coordinator"
    result = "refused"


@dataclass
class Lease:
    holder: str
    engines: frozenset[str]
    expires_at: float  # on the board's clock
    granted_at: float


class LeaseBoard:
    """The gateway's side: grants one restart lease at a time, only with enough capacity elsewhere."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], *, min_ready: int, max_ttl_seconds: float,
                 is_ejected: Callable[[str], bool] = lambda _name: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._replicas = replicas
        self.min_ready = min_ready
        self.max_ttl_seconds = max_ttl_seconds
        self._is_ejected = is_ejected
        self._clock = clock
        self.lease: Lease | None = None
        self.granted = 0  # leases granted (not renewals), for status and tests

    def acquire(self, holder: str, engines: frozenset[str], ttl_seconds: float) -> Lease:
        """Grant or renew ``holder``'s lease over ``engines``; LeaseHeld, EnginesNotInView or BelowMinReady."""
        now = self._clock()
        ttl = min(ttl_seconds, self.max_ttl_seconds)
        current = self.live()
        if current is not None and current.holder != holder:
            raise LeaseHeld(f"restart lease held by {current.holder} ({', '.join(sorted(current.engines))}) for "
                            f"{current.expires_at - now:.0f}s more; one node restarts at a time")
        if current is not None and current.engines == engines:
            current.expires_at = now + ttl  # a renewal: its engines are already out, nothing more to check
            return current
        replicas = list(self._replicas())
        known = {r.name for r in replicas}
        if not engines & known:
            raise EnginesNotInView(f"no engine named {', '.join(sorted(engines))} in this gateway's discovery view "
                                   f"({', '.join(sorted(known)) or 'empty'}): set maintenance.coordinator_address "
                                   "to the node's address as discovery returns it")
        left = sum(1 for r in replicas if r.name not in engines and r.routable and not self._is_ejected(r.name))
        if left < self.min_ready:
            raise BelowMinReady(f"restart of {', '.join(sorted(engines))} refused: it would leave {left} engine(s) "
                                f"routable elsewhere in the fleet and maintenance.min_ready_replicas needs "
                                f"{self.min_ready}")
        self.lease = Lease(holder, engines, now + ttl, now)
        self.granted += 1
        log.info("maintenance: restart lease granted to %s for %s (%d engine(s) routable elsewhere)", holder,
                 ", ".join(sorted(engines)), left)
        return self.lease

    def release(self, holder: str) -> bool:
        current = self.live()
        if current is None or current.holder != holder:
            return False
        log.info("maintenance: restart lease released by %s", holder)
        self.lease = None
        return True

    def live(self) -> Lease | None:
        if self.lease is not None and self.lease.expires_at <= self._clock():
            log.warning("maintenance: restart lease of %s expired without release", self.lease.holder)
            self.lease = None
        return self.lease

    def status(self) -> dict[str, Any]:
        current = self.live()
        return {"holder": current.holder if current else None,
                "engines": sorted(current.engines) if current else [],
                "expires_in_seconds": round(current.expires_at - self._clock(), 1) if current else None,
                "granted": self.granted, "min_ready_replicas": self.min_ready}


def port_of(replica: Replica) -> int:
    parts = urlsplit(replica.url)
    return parts.port or (443 if parts.scheme == "https" else 80)


class GatewayLeaseCoordinator:
    """The node's side: asks a gateway's LeaseBoard (``GET/POST/DELETE /maintenance/lease``, with the lease token, or
    the admin token where no lease token is set)."""

    retry_seconds = 2.0

    def __init__(self, url: str, token: str | None, *, holder: str, address: str | None, lease_seconds: float,
                 timeout_seconds: float) -> None:
        """``address``: this node's engines' address as the gateway's discovery knows it; None: the gateway
        takes the address it sees the request come from (the pod IP on Kubernetes)."""
        self.url = url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.holder = holder
        self.address = address
        self.lease_seconds = lease_seconds
        self.renew_seconds = lease_seconds / 3
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def peek(self) -> LeaseAnswer:
        try:
            async with self._client().get(f"{self.url}{LEASE_PATH}") as response:
                payload = await response.json(content_type=None)
                if response.status != 200 or not isinstance(payload, dict):
                    return LeaseAnswer(False, f"coordinator {self.url} answered {response.status}")
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return LeaseAnswer(False, f"coordinator {self.url} unreachable: {type(exc).__name__}: {exc}")
        holder = payload.get("holder")
        if holder not in (None, self.holder):
            return LeaseAnswer(False, f"restart lease held by {holder}")
        return LeaseAnswer(True, "restart lease free")

    async def acquire(self, replica: Replica) -> LeaseAnswer:
        body = {"holder": self.holder, "address": self.address, "ports": [port_of(replica)],
                "ttl_seconds": self.lease_seconds}
        try:
            async with self._client().post(f"{self.url}{LEASE_PATH}", json=body) as response:
                payload = await response.json(content_type=None)
                if response.status == 200:
                    return LeaseAnswer(True, f"lease from {self.url}: {payload.get('engines')}")
                message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
                return LeaseAnswer(False, f"coordinator {self.url} answered {response.status}: {message or payload}")
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return LeaseAnswer(False, f"coordinator {self.url} unreachable: {type(exc).__name__}: {exc}")

    async def renew(self, replica: Replica) -> bool:
        answer = await self.acquire(replica)
        if not answer.granted:
            log.warning("maintenance: renewing the restart lease failed: %s", answer.detail)
        return answer.granted

    async def release(self, replica: Replica) -> None:
        try:
            async with self._client().delete(f"{self.url}{LEASE_PATH}", params={"holder": self.holder}) as response:
                await response.read()
                if response.status != 200:
                    log.warning("maintenance: releasing the restart lease answered %d", response.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("maintenance: releasing the restart lease failed (it expires by itself): %s", exc)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def hold_lease(coordinator: RestartCoordinator, replica: Replica, stop: asyncio.Event) -> None:
    """Renew ``replica``'s lease every ``renew_seconds`` until ``stop`` is set (the restart's keep-alive)."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), coordinator.renew_seconds)
            return
        except TimeoutError:
            await coordinator.renew(replica)

"""What a replica is to everyone who does not own it: the gateway, maintenance, the collectors and /admin.

Three kinds of replica satisfy this contract: engines the appliance starts itself (``SupervisedReplica``),
engines at fixed URLs that someone else runs (``ExternalReplica``), and engines found by discovery. Code outside
``appliance.engine`` depends on these Protocols only, never on a concrete class, and asks a replica what it can
do (``restartable``, ``drainable``) instead of probing it with ``hasattr``.

The gateway's own bookkeeping (requests in flight, ejections) is not part of a replica: the router keeps it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from appliance.engine.placement import Placement

if TYPE_CHECKING:
    from appliance.engine.settings import EngineSettings


class ReplicaState(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings of a shared contract
    STARTING = "starting"  # process spawned (or address found), /health not yet green
    READY = "ready"  # serving; the gateway routes here
    UNHEALTHY = "unhealthy"  # process alive but /health failing; not routed
    DRAINING = "draining"  # alive, finishing in-flight requests; not routed
    BACKOFF = "backoff"  # crashed or failed to spawn; waiting before the next start
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class ReplicaStatus:
    """What is known about a replica's life now. Counters stay zero for replicas the appliance does not run."""

    state: ReplicaState = ReplicaState.STOPPED
    pid: int | None = None
    starts: int = 0
    restarts: int = 0
    crashes: int = 0
    spawn_failures: int = 0  # the process could not even be started (ENOENT, ENOMEM, ...)
    last_exit_code: int | None = None
    last_error: str | None = None  # the last crash or spawn failure, in a line
    last_start_time: float | None = None  # unix time
    last_ready_time: float | None = None
    load_seconds: float | None = None  # spawn to first green /health
    planned_restart: bool = False  # a maintenance restart: requests may wait for it instead of failing
    hold_when_ready: bool = False  # maintenance: come back drained (to be warmed), not straight into routing
    consecutive_crashes: int = field(default=0, repr=False)
    # time.monotonic() when the gateway last received response bytes from this engine (the data path writes it):
    # first-hand evidence that it works, which a /health answer late under load does not outweigh (health.py)
    last_progress: float | None = field(default=None, repr=False)


class NotRestartable(Exception):
    """Asked to restart a replica this appliance does not run."""


class Replica(Protocol):
    """One engine the gateway can route to."""

    # Read-only properties, not attributes: an implementation may compute them (SupervisedReplica does), and a
    # Protocol attribute would demand that they be settable.
    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str:
        """Base URL of its OpenAI-compatible server, without a trailing slash."""
        ...

    @property
    def status(self) -> ReplicaStatus: ...

    @property
    def placement(self) -> Placement | None:
        """Devices it runs on; None when the appliance does not place it."""
        ...

    @property
    def restartable(self) -> bool:
        """restart() works (the appliance runs the process)."""
        ...

    @property
    def drainable(self) -> bool:
        """drain()/undrain() take it out of and back into routing."""
        ...

    @property
    def kv_cache_space_bytes(self) -> int | None:
        """KV-cache space the engine was given, when the appliance set it (CPU)."""
        ...

    @property
    def routable(self) -> bool: ...

    def drain(self) -> None: ...

    def undrain(self) -> None: ...

    async def restart(self) -> None:
        """Stop and start the engine again; raises NotRestartable when ``restartable`` is False."""
        ...


class Fleet(Protocol):
    """A set of replicas whose life is managed together: started with the app, stopped after the drain."""

    @property
    def replicas(self) -> Sequence[Replica]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class Reconfigurable(Protocol):
    """A fleet that can rebuild its replicas' engine command lines from new settings (``appliance reload``)."""

    def stage(self, engine: EngineSettings) -> None:
        """Build every replica's engine command and environment from a new engine section (what a reload rolls);
        each replica uses them from its next start on (the rolling restart that follows, or a crash restart), never
        mid-life."""
        ...

    def unstage(self) -> None:
        """Undo the last ``stage`` (a reload whose roll stopped): a replica not yet started on it keeps its spec; one
        that started on it goes back to the spec it had before, from its next start on."""
        ...

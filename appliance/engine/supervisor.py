"""The engine supervisor: N replicas on disjoint devices, started, watched and stopped together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from appliance.engine.command import engine_argv, engine_env, engine_memory_argv, launcher_command
from appliance.engine.contract import ReplicaState
from appliance.engine.identity import EngineUser
from appliance.engine.placement import Placement, detect_device, plan_placements
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from appliance.engine.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetPlan:
    """What a fleet's replicas are built from besides the engine section, fixed for the fleet's life: the model, the
    name it is served as, each replica's device slice, where logs go, and the environment other parts add (the
    collectors' engine plugin: where to write its statistics). A reload rolls a new engine section onto the same
    plan (``Supervisor.stage``)."""

    model: Path
    served_model_name: str
    placements: tuple[Placement, ...]
    state_dir: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def place(cls, model: Path, served_model_name: str, *, replicas: int, device: str, engine: EngineSettings,
              state_dir: Path, extra_env: Mapping[str, str] | None = None) -> FleetPlan:
        """The plan of ``replicas`` replicas, each on its own slice of ``device`` (``auto``: cuda when NVML sees a
        GPU) as wide as the engine section's tensor-parallel size. The values come from whoever composes the
        settings (appliance.composition.fleet): this package reads its own sections only."""
        placements = plan_placements(replicas, detect_device(device), tensor_parallel_size=engine.tensor_parallel_size)
        return cls(model, served_model_name, tuple(placements), state_dir, dict(extra_env or {}))

    def specs(self, engine: EngineSettings) -> list[ReplicaSpec]:
        """One spec per replica: its port, its device slice, its command line and its log file."""
        specs = []
        user = engine_user(engine)
        for index, placement in enumerate(self.placements):
            port = engine.base_port + index
            argv = engine_argv(self.model, self.served_model_name, port, engine, host=engine.host)
            argv += engine_memory_argv(placement, engine)
            specs.append(
                ReplicaSpec(
                    index=index,
                    port=port,
                    command=launcher_command(argv),
                    env={**engine_env(placement, engine), **self.extra_env},
                    placement=placement,
                    log_path=self.state_dir / "logs" / f"engine-{index}.log",
                    start_timeout_seconds=engine.start_timeout_seconds,
                    start_silence_timeout_seconds=engine.start_silence_timeout_seconds,
                    stop_timeout_seconds=float(engine.shutdown_timeout_seconds),
                    host=connect_host(engine.host),
                    log_max_bytes=engine.log_max_bytes,
                    log_backups=engine.log_backups,
                    log_stdout=engine.log_stdout,
                    health_timeout_seconds=engine.health_timeout_seconds,
                    user=user,
                )
            )
        return specs


def engine_user(engine: EngineSettings) -> EngineUser | None:
    """The user the engines run as: ``engine.user``, unless that is the appliance's own (nothing to switch)."""
    if engine.user is None:
        return None
    user = EngineUser.lookup(engine.user)
    return None if user.is_current else user


def connect_host(bind_host: str) -> str:
    """The address to reach an engine bound to ``bind_host``: loopback for a wildcard bind, else the address
    itself (an engine bound to 127.0.0.2 or a pod IP does not answer on 127.0.0.1)."""
    if bind_host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


class Supervisor:
    """Owns the replicas. The gateway asks it which replicas exist and in which state they are."""

    def __init__(self, specs: list[ReplicaSpec], *, backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 plan: FleetPlan | None = None):
        """``plan``: what ``stage`` rebuilds the specs from (None: a fleet of hand-made specs, which cannot)."""
        self.replicas = [SupervisedReplica(s, backoff_initial=backoff_initial, backoff_max=backoff_max) for s in specs]
        self._plan = plan
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_plan(cls, plan: FleetPlan, engine: EngineSettings) -> Supervisor:
        """The replicas of ``plan`` on the engine section's commands and crash backoff; ``stage`` can rebuild them."""
        return cls(
            plan.specs(engine),
            backoff_initial=engine.restart_backoff_initial_seconds,
            backoff_max=engine.restart_backoff_max_seconds,
            plan=plan,
        )

    async def start(self) -> None:
        """Spawn every replica; returns at once, replicas turn ready in the background."""
        self._session = aiohttp.ClientSession()
        for replica in self.replicas:
            replica.start(self._session)

    async def stop(self) -> None:
        """Stop all replicas in parallel; after this no engine process of ours exists."""
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def stage(self, engine: EngineSettings) -> None:
        """``Reconfigurable``: new specs from a new engine section for every replica, on the plan the fleet was built
        on (model, devices, logs, the environment other parts add), used from each replica's next start on. Ports
        must not change (the reload refuses that before it gets here)."""
        if self._plan is None:
            raise ValueError("this fleet was built from specs, not settings: there is nothing to rebuild them from")
        specs = self._plan.specs(engine)
        if [s.port for s in specs] != [r.spec.port for r in self.replicas]:
            raise ValueError("a reload cannot change the replicas' ports or count")
        for replica, spec in zip(self.replicas, specs, strict=True):
            replica.stage(spec)

    def unstage(self) -> None:
        """``Reconfigurable``: undo the last ``stage`` on every replica."""
        for replica in self.replicas:
            replica.unstage()

    def ready(self) -> list[SupervisedReplica]:
        return [r for r in self.replicas if r.status.state is ReplicaState.READY]

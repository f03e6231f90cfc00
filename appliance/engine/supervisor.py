"""The engine supervisor: N replicas on disjoint devices, started, watched and stopped together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from appliance.engine.command import engine_argv, engine_env, engine_memory_argv, launcher_command
from appliance.engine.contract import ReplicaState
from appliance.engine.placement import detect_device, plan_placements
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from appliance.settings import Settings

log = logging.getLogger(__name__)


def build_specs(settings: Settings, model: Path, extra_env: Mapping[str, str] | None = None) -> list[ReplicaSpec]:
    """One spec per replica: its port, its device slice, its command line and its log file. ``extra_env`` is
    what other parts need in every engine's environment (the collectors' engine plugin: where to write its
    statistics); the composition root supplies it."""
    device = detect_device(settings.device)
    placements = plan_placements(
        settings.replicas, device, tensor_parallel_size=settings.engine.tensor_parallel_size
    )
    assert settings.served_model_name is not None  # Settings' own validator fills it in when unset
    specs = []
    for index, placement in enumerate(placements):
        port = settings.engine_base_port + index
        argv = engine_argv(model, settings.served_model_name, port, settings.engine, host=settings.engine_host)
        argv += engine_memory_argv(placement, settings.engine)
        specs.append(
            ReplicaSpec(
                index=index,
                port=port,
                command=launcher_command(argv),
                env={**engine_env(placement, settings.engine), **(extra_env or {})},
                placement=placement,
                log_path=settings.state_dir / "logs" / f"engine-{index}.log",
                start_timeout_seconds=settings.engine.start_timeout_seconds,
                stop_timeout_seconds=float(settings.engine.shutdown_timeout_seconds),
                host=connect_host(settings.engine_host),
                log_max_bytes=settings.engine_log_max_bytes,
                log_backups=settings.engine_log_backups,
                log_stdout=settings.engine_log_stdout,
            )
        )
    return specs


def connect_host(bind_host: str) -> str:
    """The address to reach an engine bound to ``bind_host``: loopback for a wildcard bind, else the address
    itself (an engine bound to 127.0.0.2 or a pod IP does not answer on 127.0.0.1)."""
    if bind_host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


class Supervisor:
    """Owns the replicas. The gateway asks it which replicas exist and in which state they are."""

    def __init__(self, specs: list[ReplicaSpec], *, backoff_initial: float = 1.0, backoff_max: float = 60.0):
        self.replicas = [SupervisedReplica(s, backoff_initial=backoff_initial, backoff_max=backoff_max) for s in specs]
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_settings(cls, settings: Settings, extra_env: Mapping[str, str] | None = None) -> Supervisor:
        if settings.model is None:
            raise ValueError("no model configured: set `model` (or run `appliance up` for the demo model)")
        return cls(
            build_specs(settings, settings.model, extra_env),
            backoff_initial=settings.restart_backoff_initial_seconds,
            backoff_max=settings.restart_backoff_max_seconds,
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

    def stage(self, settings: Settings) -> None:
        """``Reconfigurable``: new specs from ``settings`` for every replica, used from its next start on. Ports,
        placements and the replica count must not change (the reload refuses those before it gets here)."""
        if settings.model is None:
            raise ValueError("no model configured")
        specs = build_specs(settings, settings.model)
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

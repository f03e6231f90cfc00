"""``appliance serve``: the gateway and its engines in one process, with a drain on SIGTERM.

Shutdown order matters to clients: first turn not-ready and refuse new requests with 503 (load balancers move
away), then let in-flight requests, streams and requests queued in the gateway finish up to
``drain_timeout_seconds``, then end the streams still running with an error event (not a silent cut), then stop
the engines, then exit 0. A second signal skips the wait.

The ``role`` setting picks the fleet (see docs/kubernetes.md): ``all`` (the default, one host) and ``node`` run
their own engines (supervisor); ``gateway`` runs none and follows the engines behind ``discovery.name``. A node's
engines also serve other pods' gateways, whose requests its own router never sees, so a node's drain also waits
until its engines report nothing running or waiting, and never ends before one discovery interval has passed
(the gateways' time to notice the node left DNS).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from appliance.admin_client import TOKEN_FILE
from appliance.admin_token import ensure_admin_token
from appliance.app import create_app
from appliance.collectors import engine_stats_dir, engine_stats_env
from appliance.composition.fleet import build_dns_fleet, build_supervisor
from appliance.context import context_of
from appliance.engine.capabilities import clear_ambient, missing_for_engine_user
from appliance.engine.contract import Fleet
from appliance.engine.external import ExternalFleet
from appliance.engine.guard import ENGINE_KEY_ENV
from appliance.engine.supervisor import engine_user
from appliance.gateway.core import Gateway
from appliance.gateway.intake.connections import GuardedHttpToolsProtocol
from appliance.gateway.workers.decider import Decider
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.gateway.workers.passthrough import DECIDER_KEEP_ALIVE_SECONDS
from appliance.gateway.workers.pool import WorkerPool, listening_socket
from appliance.secret_files import SECRET_PAIRS
from appliance.settings import ConfigError, Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT drains before it stops accepting."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float, *,
                 pending: Callable[[FastAPI], int] | None = None, settle_seconds: float = 0.0,
                 workers: WorkerPool | None = None) -> None:
        """``workers``: the gateway's worker processes (``gateway.workers`` above 1), drained and stopped with it."""
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._workers = workers
        self._pending = pending or in_flight
        self._settle_seconds = settle_seconds
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler we do not re-raise the signal after shutdown: a drained exit is exit 0.
        loop = self._loop
        if self._draining or loop is None:
            log.warning("second signal %s: stopping without waiting for in-flight requests", sig)
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self._draining = True
        context_of(self._app).live.draining = True
        if self._workers is not None:
            self._workers.drain()
        log.info("signal %s: draining %d request(s) (%s; up to %.0fs); not ready, new requests get 503", sig,
                 self._pending(self._app), in_flight_parts(self._app), self._drain_timeout)
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        started = time.monotonic()
        deadline = started + self._drain_timeout
        settled = min(started + self._settle_seconds, deadline)
        while ((pending := self._pending(self._app)) or time.monotonic() < settled) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if pending:
            log.warning("drain timeout: %d requests still in flight or queued; stopping anyway", pending)
            if self._workers is not None:
                self._workers.cut()
            cut = await context_of(self._app).gateway.upstream.cut_streams()
            if cut:
                log.warning("drain timeout: cut %d stream(s) with a shutting_down error event", cut)
        else:
            log.info("drained: no request in flight")
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self._workers is not None and self.started:
            await self._workers.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._workers is not None:  # first: no worker relays a stream when the engines stop
            await self._workers.stop()
        await super().shutdown(sockets=sockets)


def in_flight(app: FastAPI) -> int:
    """Requests the drain waits for: every request the gateway has forwarded and not answered in full. That is
    more than the slots the router counts plus the queue: a stream whose replica broke holds no slot while its
    continuation waits for another replica, and its client is owed the rest. The slots and the queue still count
    on their own, should a slot be held outside a forwarded request."""
    gateway = context_of(app).gateway
    return max(gateway.upstream.open_requests(), gateway.router.in_flight() + gateway.admission.queue_length)


def in_flight_parts(app: FastAPI) -> str:
    """What the count is made of, for the drain's log line: a difference between the parts is worth seeing."""
    gateway = context_of(app).gateway
    return (f"{gateway.upstream.open_requests()} open: {gateway.router.in_flight()} at replicas, "
            f"{gateway.admission.queue_length} queued")


def node_pending(app: FastAPI) -> int:
    """Requests this node still serves: its own gateway's, plus what its engines report running or waiting
    (other gateways' requests). An engine whose reading is stale is not serving anything we can wait for."""
    router = context_of(app).gateway.router
    now = time.monotonic()
    engine_side = 0.0
    for load in router.loads().values():
        if now - load.read_at <= router.routing.metrics_stale_seconds:
            engine_side += (load.running or 0.0) + (load.waiting or 0.0)
    return in_flight(app) + math.ceil(engine_side)


def engine_extra_env(settings: Settings) -> dict[str, str]:
    """What every supervised engine's environment carries for the other parts: the collectors' engine plugin
    learns where to write its allocator statistics, and vLLM the key it requires (VLLM_API_KEY: an environment
    variable is readable by the engine's own user only, a command-line flag by every user in /proc/<pid>/cmdline)."""
    key = settings.gateway.engine_key
    return {**engine_stats_env(settings.collectors, settings.state_dir), **({ENGINE_KEY_ENV: key} if key else {})}


def runs_own_engines(settings: Settings) -> bool:
    """Whether this process starts engines (roles all and node, no engine_urls): only those get the engine key
    from it, and only those can be run as ``engine.user``."""
    return settings.role != "gateway" and not settings.discovery.engine_urls


def with_engine_key(settings: Settings) -> Settings:
    """The engine key the gateway sends and the engines require: the configured one, else, for engines this
    appliance runs and nobody else calls, a new one for this run, kept in memory only (the gateway and its engines
    are its only holders). A node pod's engines are called by gateway pods, which cannot know a generated key."""
    if settings.gateway.engine_key or not runs_own_engines(settings):
        return settings
    if settings.role == "node":
        log.warning("no gateway.engine_key: this node's engines answer anyone who reaches them; give node and "
                    "gateway pods the same gateway.engine_key_file (docs/kubernetes.md)")
        return settings
    return settings.replaced({"gateway.engine_key": secrets.token_urlsafe(32)})


def with_node_admin_token(settings: Settings) -> Settings:
    """A node pod holds no gateway's admin token (its engines share its user, docs/security.md): its own /admin
    (`appliance status` in the pod) gets a token of its own, generated into the state dir as `appliance up` does,
    which opens this node's engines only."""
    if settings.role != "node" or settings.gateway.admin_token is not None:
        return settings
    return settings.replaced({"gateway.admin_token": ensure_admin_token(settings.state_dir)})


def secret_paths(settings: Settings) -> list[Path]:
    """Every file holding a secret of the appliance's (the engine key aside: the engines hold it anyway)."""
    gateway = settings.gateway
    paths = [getattr(gateway, pair.file) for pair in SECRET_PAIRS if pair.value != "engine_key"]
    paths += [tenant.api_keys_file for tenant in settings.tenants]
    paths += [settings.maintenance.grafana_token_file, settings.state_dir / TOKEN_FILE]
    return [path for path in paths if path is not None and path.exists()]


def check_engine_user(settings: Settings) -> None:
    """With ``engine.user``: refuse to start where the engines would not be kept from the secrets after all, the
    appliance unable to run them as that user, or a secret file readable by it. Prepares what the engines write
    (the collectors' statistics folder: sticky and writable by all, as /tmp)."""
    user = engine_user(settings.engine)
    if user is None or not runs_own_engines(settings):
        return
    missing = missing_for_engine_user()
    if missing:
        raise ConfigError(f"engine.user {user.name}: this appliance (uid {os.geteuid()}) lacks {', '.join(missing)} "
                          "to start and stop processes as another user; run it as root or with those capabilities "
                          "(the image's entrypoint does), or unset engine.user")
    readable = user.readable(secret_paths(settings))
    if readable:
        raise ConfigError(f"engine.user {user.name} can read {', '.join(map(str, readable))}: make each secret file "
                          f"readable by the appliance's user only (chmod 0600, or 0440 with a group {user.name} is "
                          "not in)")
    searchable(settings.state_dir)  # the engines reach the models and the statistics folder in it, list nothing
    model = settings.model / "config.json" if settings.model is not None else None
    if model is not None and model.exists() and not user.readable([model]):
        raise ConfigError(f"engine.user {user.name} cannot read the model ({model}): make it readable by that user "
                          "(files o+r, folders o+rx)")
    if settings.collectors.enabled:
        stats = engine_stats_dir(settings.collectors, settings.state_dir)
        stats.mkdir(parents=True, exist_ok=True)
        stats.chmod(0o1733)  # engines create their own files; only the appliance lists them


def searchable(folder: Path) -> None:
    """``folder`` (the appliance's own) passable by other users, not listable: a state volume an earlier image
    created 0700 would keep the engine user from the models under it."""
    folder.mkdir(parents=True, exist_ok=True)
    mode = folder.stat()
    if mode.st_uid == os.geteuid() and not mode.st_mode & 0o001:
        folder.chmod(stat.S_IMODE(mode.st_mode) | 0o001)


def build_fleet(settings: Settings, registry: CollectorRegistry) -> Fleet:
    """The engines this appliance routes to: found by DNS (gateway role), at ``engine_urls``, or its own."""
    if settings.role == "gateway":
        return build_dns_fleet(settings, registry)
    if settings.discovery.engine_urls:
        return ExternalFleet(settings.discovery.engine_urls, settings.engine.health_timeout_seconds)
    return build_supervisor(settings, engine_extra_env(settings))


def server_options(settings: Settings, *, local: bool = False) -> dict[str, Any]:
    """uvicorn's options that come from the settings: the connection level of the intake (header timeout and
    size, the connection cap, closing after an answer given before the body ended; see
    appliance/gateway/intake/connections.py). uvicorn's own ``limit_concurrency`` is not used: it answers plain text
    without Retry-After. ``local``: the decider's own server, whose one client is its workers (the clients'
    connections were counted there), so no per-client cap."""
    intake = settings.intake
    return {"http": GuardedHttpToolsProtocol.configured(
        header_timeout=intake.header_timeout_seconds, max_header_bytes=intake.max_header_bytes,
        max_connections=intake.max_connections,
        max_connections_per_client=None if local else intake.max_connections_per_client)}


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; return the process exit code."""
    clear_ambient()  # what the entrypoint gave this process to run its engines as engine.user, no child inherits
    settings = with_node_admin_token(with_engine_key(settings))
    check_engine_user(settings)
    workers = settings.gateway.workers > 1
    registry = MergedRegistry() if workers else CollectorRegistry()
    fleet = build_fleet(settings, registry)
    app = create_app(settings, fleet=fleet, registry=registry)
    if workers:
        assert isinstance(registry, MergedRegistry)
        return serve_with_workers(settings, app, registry)
    config = uvicorn.Config(
        app, host=settings.gateway.host, port=settings.gateway.port, log_level=settings.log_level, lifespan="on",
        timeout_graceful_shutdown=5, access_log=False, **server_options(settings),
    )
    if settings.role == "node":
        server = DrainingServer(config, app, settings.gateway.drain_timeout_seconds, pending=node_pending,
                                settle_seconds=settings.discovery.interval_seconds)
    else:
        server = DrainingServer(config, app, settings.gateway.drain_timeout_seconds)
    server.run()
    return 0 if server.started else 1


def serve_with_workers(settings: Settings, app: FastAPI, registry: MergedRegistry) -> int:
    """The gateway as a decider and ``gateway.workers`` workers (appliance.gateway.workers): the clients' port is
    bound here and inherited by the workers, which accept on it; this process serves the rest of the appliance on
    a Unix socket the workers pass every other route to, and answers the workers' decisions on another."""
    listener = listening_socket(settings.gateway.host, settings.gateway.port)
    folder = Path(tempfile.mkdtemp(prefix="appliance-gateway-"))  # 0700, and short: a socket's path is at most 107
    server = workers_server(settings, app, registry, listener, folder)
    try:
        server.run()
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if server.started else 1


def workers_server(settings: Settings, app: FastAPI, registry: MergedRegistry, listener: socket.socket,
                   folder: Path) -> DrainingServer:
    """The decider's server (on ``folder``/http.sock) with its workers' pool, which accept on ``listener``."""
    ctx = context_of(app)
    gateway = ctx.gateway
    assert isinstance(gateway, Gateway) and gateway.reconciliation is not None
    decider = Decider(gateway.admission, gateway.quotas, gateway.reconciliation, gateway.records, registry,
                      kv_events=gateway.kv_events)
    decider.reload(ctx.live.settings)
    ctx.live.reloaded.append(decider.reload)
    pool = WorkerPool(settings.gateway.workers, decider, folder / "decider.sock", folder / "http.sock", listener)
    config = uvicorn.Config(app, uds=str(folder / "http.sock"), log_level=settings.log_level, lifespan="on",
                            timeout_graceful_shutdown=5, timeout_keep_alive=DECIDER_KEEP_ALIVE_SECONDS,
                            access_log=False, **server_options(settings, local=True))

    def pending(served: FastAPI) -> int:
        """``in_flight``, with the workers' open requests next to this process's own (batch lines)."""
        return max(gateway.upstream.open_requests() + decider.open_requests(),
                   gateway.router.in_flight() + gateway.admission.queue_length)

    return DrainingServer(config, app, settings.gateway.drain_timeout_seconds, pending=pending, workers=pool)

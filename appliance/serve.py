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
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.collectors import engine_stats_env
from appliance.composition.fleet import build_dns_fleet, build_supervisor
from appliance.context import context_of
from appliance.engine.contract import Fleet
from appliance.engine.external import ExternalFleet
from appliance.gateway.intake.connections import GuardedHttpToolsProtocol
from appliance.settings import Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT drains before it stops accepting."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float, *,
                 pending: Callable[[FastAPI], int] | None = None, settle_seconds: float = 0.0) -> None:
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._pending = pending or in_flight
        self._settle_seconds = settle_seconds
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

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
            cut = await context_of(self._app).gateway.upstream.cut_streams()
            if cut:
                log.warning("drain timeout: cut %d stream(s) with a shutting_down error event", cut)
        else:
            log.info("drained: no request in flight")
        self.should_exit = True


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
    learns where to write its allocator statistics."""
    return engine_stats_env(settings.collectors, settings.state_dir)


def build_fleet(settings: Settings, registry: CollectorRegistry) -> Fleet:
    """The engines this appliance routes to: found by DNS (gateway role), at ``engine_urls``, or its own."""
    if settings.role == "gateway":
        return build_dns_fleet(settings, registry)
    if settings.discovery.engine_urls:
        return ExternalFleet(settings.discovery.engine_urls, settings.engine.health_timeout_seconds)
    return build_supervisor(settings, engine_extra_env(settings))


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options that come from the settings: the connection level of the intake (header timeout and
    size, the connection cap, closing after an answer given before the body ended; see
    appliance/gateway/intake/connections.py). uvicorn's own ``limit_concurrency`` is not used: it answers plain text
    without Retry-After."""
    intake = settings.intake
    return {"http": GuardedHttpToolsProtocol.configured(
        header_timeout=intake.header_timeout_seconds, max_header_bytes=intake.max_header_bytes,
        max_connections=intake.max_connections)}


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; return the process exit code."""
    registry = CollectorRegistry()
    fleet = build_fleet(settings, registry)
    app = create_app(settings, fleet=fleet, registry=registry)
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

"""``create_app()``: the gateway as a FastAPI application; all state lives on ``app.state``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from appliance.engine.supervisor import Supervisor
from appliance.gateway.errors import install_error_handlers
from appliance.gateway.limits import BodySizeLimit
from appliance.gateway.proxy import Upstream
from appliance.gateway.router import Routable, Router
from appliance.gateway.routes import health, openai
from appliance.settings import Settings


def create_app(
    settings: Settings,
    *,
    supervisor: Supervisor | None = None,
    replicas: Callable[[], Sequence[Routable]] | None = None,
) -> FastAPI:
    """Build the gateway. With a supervisor it owns the engines' life; ``replicas`` alone serves a fixed set
    (tests with stub upstreams, or engines run by someone else)."""
    if replicas is None:
        if supervisor is None:
            raise ValueError("create_app needs a supervisor or a replicas provider")
        replicas = lambda: supervisor.replicas  # noqa: E731

    router = Router(replicas)
    upstream = Upstream(router, timeout_seconds=settings.request_timeout_seconds)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await upstream.open()
        if supervisor is not None:
            await supervisor.start()
        try:
            yield
        finally:
            if supervisor is not None:
                await supervisor.stop()
            await upstream.close()

    app = FastAPI(title="appliance gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.supervisor = supervisor
    app.state.replicas = replicas
    app.state.router = router
    app.state.upstream = upstream
    app.state.draining = False
    app.state.started_at = time.time()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.include_router(openai.router)
    app.include_router(health.router)
    return app

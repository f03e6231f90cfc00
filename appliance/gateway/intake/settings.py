"""The ``intake`` section: connection caps, body size and time, the body-buffer budget."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IntakeSettings(BaseModel):
    """Hostile input is refused before any work (``limits.py`` and ``connections.py`` beside this file): the API
    key is checked before the body is read; these bound what a client may hold before that."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_seconds: float = Field(
        10.0, gt=0, description="A request's line and headers must arrive within this many seconds (from the "
        "connection's start, or a kept-alive connection's next request's first byte); else 408 and close."
    )
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="The whole body must arrive within this many seconds after the headers (a total, "
        "so a body that trickles in a byte at a time is cut too); else 408 and close."
    )
    max_header_bytes: int = Field(
        65536, ge=1024, description="Largest request line plus headers, in bytes; beyond it: 431 and close."
    )
    max_connections: int = Field(
        1024, ge=1, description="Open client connections the gateway serves at once; a request on a connection "
        "beyond it: 503 with Retry-After, and the connection is closed."
    )
    max_connections_per_client: int = Field(
        256, ge=1, description="Open connections one client address may hold at once (before authentication, like "
        "max_connections); a request on one beyond it: 503 with Retry-After, and the connection is closed. Behind "
        "a proxy or load balancer every client has its address: raise it to max_connections there."
    )
    body_budget_bytes: int = Field(
        67_108_864, ge=1024, description="Request body bytes being received at once, all clients together (a "
        "body counts from its Content-Length, or as it arrives, until it has all arrived); a body that does not "
        "fit: 503 with Retry-After. At least max_request_bytes."
    )

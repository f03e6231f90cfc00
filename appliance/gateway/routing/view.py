"""What filters and scorers may ask the router about a replica: a narrow, typed view of its bookkeeping."""

from __future__ import annotations

from typing import Protocol

from appliance.engine.load import EngineLoad


class RoutingView(Protocol):
    def in_flight(self, name: str) -> int:
        """Requests the gateway has in flight at the replica: exact, the gateway's own count."""
        ...

    def limit_of(self, name: str) -> int:
        """The replica's admission (concurrency) limit."""
        ...

    def is_ejected(self, name: str) -> bool: ...

    def engine_load(self, name: str) -> EngineLoad | None:
        """The engine's own reading, or None when it is unknown: never read, older than metrics_stale_seconds,
        or contradicted by the gateway's own in-flight count (the engine's gauges lag)."""
        ...

"""Which replica gets the next request: the ready one with the fewest outstanding requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from appliance.gateway.errors import APIError


class Routable(Protocol):
    """What the router needs of a replica; the supervisor's Replica satisfies it, and so do test doubles."""

    name: str
    url: str

    @property
    def routable(self) -> bool: ...

    @property
    def status(self): ...  # has an ``outstanding`` int


class Router:
    """Least-outstanding-requests routing over the replicas the supervisor reports as ready.

    Outstanding counts are the gateway's own (exact, no polling lag); ties go to the lowest index so that a
    quiet fleet concentrates load and keeps caches warm.
    """

    def __init__(self, replicas: Callable[[], Sequence[Routable]]) -> None:
        self._replicas = replicas

    def acquire(self, exclude: set[str] = frozenset()) -> Routable:
        candidates = [r for r in self._replicas() if r.routable and r.name not in exclude]
        if not candidates:
            raise APIError(503, "no ready replica; retry shortly", code="no_ready_replica",
                           headers={"Retry-After": "5"})
        chosen = min(candidates, key=lambda r: r.status.outstanding)
        chosen.status.outstanding += 1
        return chosen

    @staticmethod
    def release(replica: Routable) -> None:
        replica.status.outstanding -= 1

    def any_ready(self) -> bool:
        return any(r.routable for r in self._replicas())

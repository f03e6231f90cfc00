"""Filters: which replicas may take a request at all. Each is a predicate; a replica must pass every one."""

from __future__ import annotations

from collections.abc import Callable, Collection

from appliance.engine.contract import Replica
from appliance.gateway.routing.view import RoutingView

Filter = Callable[[Replica, RoutingView, Collection[str]], bool]


def ready(replica: Replica, _view: RoutingView, _exclude: Collection[str]) -> bool:
    """Routable: ready, not draining, not held by maintenance."""
    return replica.routable


def not_excluded(replica: Replica, _view: RoutingView, exclude: Collection[str]) -> bool:
    """Not one this request already failed on (retries go elsewhere)."""
    return replica.name not in exclude


def not_ejected(replica: Replica, view: RoutingView, _exclude: Collection[str]) -> bool:
    return not view.is_ejected(replica.name)


def under_limit(replica: Replica, view: RoutingView, _exclude: Collection[str]) -> bool:
    """Below its adaptive concurrency limit (admission control)."""
    return view.in_flight(replica.name) < view.limit_of(replica.name)


ELIGIBLE: tuple[Filter, ...] = (ready, not_excluded, not_ejected)
WITH_ROOM: tuple[Filter, ...] = (*ELIGIBLE, under_limit)


def passing(replicas: Collection[Replica], view: RoutingView, exclude: Collection[str],
            filters: tuple[Filter, ...] = WITH_ROOM) -> list[Replica]:
    return [r for r in replicas if all(keep(r, view, exclude) for keep in filters)]

"""Filters: which replicas may take a request at all. Each is a predicate; a replica must pass every one.

``BalanceBound`` is the one stateful filter: it narrows the candidates of prefix-routed requests to those within
their share of the recent decisions, and never to none.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence

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


def sift(replicas: Collection[Replica], view: RoutingView, exclude: Collection[str],
         filters: tuple[Filter, ...] = WITH_ROOM) -> tuple[list[Replica], list[tuple[str, str]]]:
    """``passing``, and for each replica left out the name of the first filter that removed it: what the
    request record shows. One plain loop, no slower than ``passing`` (it runs on every routing decision)."""
    kept: list[Replica] = []
    removed: list[tuple[str, str]] = []
    for replica in replicas:
        for keep in filters:
            if not keep(replica, view, exclude):
                removed.append((replica.name, filter_name(keep)))
                break
        else:
            kept.append(replica)
    return kept, removed


def filter_name(keep: Filter) -> str:
    """The name a removal is shown under: the filter function's own name (``ready``, ``under_limit``...)."""
    return getattr(keep, "__name__", type(keep).__name__)


class BalanceBound:
    """A bound on each replica's share of the recent decisions: a replica that would then have taken more than
    ceil(factor x (taken + 1) / candidates) of the last ``window`` decisions, counting only the candidates', is
    left out (unless that would leave none; it never does when the factor is >= 1).

    Why a window of decisions and not the in-flight bound alone: in-flight counts bound only what runs at once,
    and at low concurrency (mean in flight ~1) ceil(load_factor x mean) (1.25 then) lets one replica take nearly
    everything, which is how prefix affinity kept 159 of 200 requests on the replica that was up first.
    Counting decisions holds at any concurrency and any request rate (consistent hashing with bounded loads,
    Mirrokni et al., with the load measured over a recent window). The window restarts whenever the set of
    routable replicas changes: counts from before describe a fleet that no longer exists, and a replica that
    (re)joins then gets its share from its first request on, instead of only after the window has forgotten the
    time it was away.
    """

    def __init__(self, window: int, factor: float) -> None:
        self.window = window
        self.factor = factor
        self._recent: deque[str] = deque()
        self._counts: Counter[str] = Counter()
        self._members: frozenset[str] = frozenset()
        self.held_back = 0  # decisions where a candidate was left out for its share

    def observe(self, replicas: Collection[Replica]) -> None:
        members = frozenset(r.name for r in replicas if r.routable)
        if members != self._members:
            self._members = members
            self._recent.clear()
            self._counts.clear()

    def prune(self) -> None:
        """Drop the replicas with no decision left in the window (one gone from the fleet ages out of it)."""
        for name in [name for name, count in self._counts.items() if count <= 0]:
            del self._counts[name]

    def __len__(self) -> int:
        return len(self._counts)

    def taken(self, name: str) -> int:
        """Decisions in the window that went to ``name``."""
        return self._counts[name]

    def within(self, candidates: Sequence[Replica]) -> list[Replica]:
        """The candidates within their share (all of them when none would be)."""
        if self.window <= 0 or len(candidates) < 2:
            return list(candidates)
        counts = [self._counts[r.name] for r in candidates]
        bound = math.ceil(self.factor * (sum(counts) + 1) / len(candidates))
        kept = [r for r, n in zip(candidates, counts, strict=True) if n + 1 <= bound]
        if not kept:
            return list(candidates)
        self.held_back += len(kept) < len(candidates)
        return kept

    def chosen(self, name: str) -> None:
        if self.window <= 0:
            return
        self._recent.append(name)
        self._counts[name] += 1
        if len(self._recent) > self.window:
            self._counts[self._recent.popleft()] -= 1

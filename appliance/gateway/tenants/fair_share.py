"""Fair share between tenants: who waits least-served goes next, and how much of a replica one tenant may hold.

Two policies, kept apart from admission's queue so each is tested alone:

- ``VirtualClock``: the order. Each tenant has a virtual time, the cost it was served divided by its weight (a
  fixed cost per dispatched request, plus the tokens the engine reports when the proxy charges them). The waiting
  tenant with the lowest virtual time goes next, so over a long run a tenant of weight 2 is served twice what a
  tenant of weight 1 is while both wait. A tenant that comes back after being idle starts at the current minimum
  of its priority (a floor that only rises), not where it left off: time spent idle is not credit to spend later
  in a burst, and capacity a tenant used while alone is not held against it.
- ``fair_allocation``: the bound. A replica's limit is shared max-min fairly, by weight, among the tenants that
  want it: a tenant that wants less than its share keeps what it wants, the rest is split among the others. So a
  tenant alone gets all capacity, two that both flood get half each (by weight), and the aggressor still gets the
  capacity a light tenant leaves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DISPATCH_COST = 16.0
"""What one dispatched request costs in virtual tokens before (or without) the engine's usage: a floor per request
(its scheduling, its prefill's fixed part), so that fair share works even when no usage is charged, and a flood of
tiny requests is not free."""


class VirtualClock:
    """Per-tenant virtual time (served cost / weight), with a per-priority floor for tenants coming back."""

    def __init__(self) -> None:
        self._time: dict[str, float] = {}
        self._floor: dict[int, float] = {}

    def of(self, tenant: str) -> float:
        return self._time.get(tenant, 0.0)

    def activate(self, tenant: str, priority: int, active_peers: Mapping[str, int]) -> None:
        """``tenant`` had nothing queued or in flight and now has: it starts no earlier than the lowest virtual time
        among the tenants of its priority that are active (``active_peers``: name -> priority), or, when none is,
        than the floor they left."""
        self._raise_floor(priority, active_peers, besides=tenant)
        self._time[tenant] = max(self.of(tenant), self._floor.get(priority, 0.0))

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """``tenant`` was served ``cost`` virtual tokens (a dispatch, or tokens the engine reported)."""
        self._time[tenant] = self.of(tenant) + max(0.0, cost) / weight

    def _raise_floor(self, priority: int, active_peers: Mapping[str, int], *, besides: str) -> None:
        peers = [self.of(name) for name, level in active_peers.items() if level == priority and name != besides]
        if peers:
            self._floor[priority] = max(self._floor.get(priority, 0.0), min(peers))


def fair_allocation(capacity: float, weights: Mapping[str, float], demands: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity``: tenants whose demand is under their weighted share get their
    demand, the capacity left is split again among the rest by weight (``math.inf``: takes all it can get)."""
    allocation: dict[str, float] = {}
    left, wanting = float(capacity), set(weights)
    while wanting:
        total = sum(weights[name] for name in wanting)
        content = {name for name in wanting if demands.get(name, math.inf) <= left * weights[name] / total}
        if not content:
            allocation.update({name: left * weights[name] / total for name in wanting})
            break
        for name in content:
            allocation[name] = float(demands[name])
            left -= demands[name]
        wanting -= content
    return allocation


def share_bound(capacity: int, tenant: str, weight: float, others: Mapping[str, tuple[float, float]]) -> int:
    """How many requests ``tenant`` may hold on a replica of ``capacity``: its max-min fair share (it wanting all),
    given the other active tenants' (weight, demand); at least 1, all of it when alone."""
    weights = {name: w for name, (w, _) in others.items()}
    demands = {name: d for name, (_, d) in others.items()}
    weights[tenant], demands[tenant] = weight, math.inf
    share = fair_allocation(capacity, weights, demands)[tenant]
    return max(1, math.ceil(share - 1e-9))

"""Slot ownership: every admitted request holds one ``Lease`` on one replica's slot, released exactly once.

The router counts requests in flight per replica; admission control, the drain, the hung detector and readiness
all trust that count. A count that is never given back wedges the gateway for good: the replica looks full while
its engine is idle, every request waits out the queue and gets 429. The count used to be given back by hand on
each path (``finally`` blocks in the relay, the body reader, the queue), and a client that left at the wrong
moment fell between them: a stream whose response was built but never served (the client left as its upstream
answered, and the response was dropped unserved) kept its slot forever.

So the slot is an object with one owner at a time (the request's exchange, then the streaming response that
serves it), ``release`` is idempotent (the first outcome wins, later calls are no-ops), and a lease that is
dropped without being released is released when it is garbage-collected and counted as reclaimed: a number that
must stay 0 and that an alert watches. ``SlotAudit`` checks the invariant from outside, on every engine poll:
the router's count against the live leases (orphaned slots are returned) and against what each engine reports
running + waiting (a lasting surplus is drift: a metric, an alert, and readiness stops saying 200 when it leaves
no room anywhere).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from appliance.engine.contract import Replica
from appliance.gateway.routing.router import Outcome, Router

log = logging.getLogger(__name__)

ReleaseFn = Callable[[Replica, Outcome, "float | None"], None]


@dataclass
class _Held:
    """What the garbage-collection backstop needs, kept apart from the lease so it does not keep the lease alive."""

    released: bool = False


class Lease:
    """One request's hold on one slot of ``replica``. ``release`` gives it back once; later calls do nothing.
    ``first_token`` says, once, that the engine's first token came back (the request left its prefill): admission
    counts a tenant's requests still in prefill at a replica (``admission.over_share_prefills``)."""

    __slots__ = ("replica", "_held", "_release", "_on_first_token", "_finalizer", "__weakref__")

    def __init__(self, replica: Replica, release: ReleaseFn, on_reclaimed: Callable[[Replica], None],
                 on_first_token: Callable[[], None] | None = None) -> None:
        self.replica = replica
        self._held = _Held()
        self._release = release
        self._on_first_token = on_first_token
        self._finalizer = weakref.finalize(self, _reclaim, self._held, replica, release, on_reclaimed)

    def first_token(self) -> bool:
        """The engine's first token for this request came back: said once, and only while the lease is held;
        False otherwise."""
        notify, self._on_first_token = self._on_first_token, None
        if notify is None or self._held.released:
            return False
        notify()
        return True

    @property
    def released(self) -> bool:
        return self._held.released

    def release(self, outcome: Outcome, ttft_seconds: float | None = None) -> bool:
        """Give the slot back with ``outcome`` (what the replica is judged on); False if it was already given back."""
        if self._held.released:
            return False
        self._held.released = True
        self._finalizer.detach()
        self._release(self.replica, outcome, ttft_seconds)
        return True

    def __repr__(self) -> str:
        return f"Lease({self.replica.name}, {'released' if self.released else 'held'})"


def _reclaim(held: _Held, replica: Replica, release: ReleaseFn, on_reclaimed: Callable[[Replica], None]) -> None:
    """A lease nobody released was garbage-collected: its request is gone, so its slot is returned (a bug
    somewhere, hence the log line and the counter)."""
    if held.released:
        return
    held.released = True
    log.error("a lease on %s was dropped without being released; its slot is returned", replica.name)
    on_reclaimed(replica)
    release(replica, Outcome.ABORTED, None)


@dataclass
class LeaseLedger:
    """The leases alive now, per replica: the one source the router's count is audited against."""

    held: Counter[str] = field(default_factory=Counter)
    reclaimed: Counter[str] = field(default_factory=Counter)  # dropped unreleased, returned by the GC backstop

    def taken(self, replica: Replica) -> None:
        self.held[replica.name] += 1

    def given_back(self, replica: Replica) -> None:
        self.held[replica.name] -= 1
        if self.held[replica.name] <= 0:
            del self.held[replica.name]

    def on_reclaimed(self, replica: Replica) -> None:
        self.reclaimed[replica.name] += 1

    def retain(self, names: Collection[str]) -> None:
        """Forget the counts of replicas gone from the fleet (leases still held there stay counted)."""
        for name in [name for name in self.reclaimed if name not in names]:
            del self.reclaimed[name]


@dataclass
class DriftState:
    """One replica's standing against its engine's own count."""

    surplus: int = 0  # the gateway's in-flight count minus the engine's running + waiting, at the last fresh reading
    since: float | None = None  # monotonic: when the surplus began (None: no surplus)
    drifted: bool = False  # the surplus has lasted drift_seconds


class SlotAudit:
    """The slot invariant, checked on every engine poll.

    - Orphans: the router counts more requests at a replica than there are live leases on it. No request holds
      those slots, so they are returned at once (``orphans_returned``); with leases this should never happen.
    - Drift: the engine's fresh reading shows fewer requests running + waiting than the gateway has in flight
      there, for ``drift_seconds`` in a row. Short surpluses are normal (a request between the gateway and the
      engine's scheduler, a stream's tail still being relayed; vLLM's CPU gauges lag on a loaded host), a lasting
      one is not. Drift is reported (metric, alert), and a replica that is full and drifted counts as no room for
      readiness: the gateway must not say ready while nothing can be admitted and the engines are idle.
    """

    def __init__(self, router: Router, ledger: LeaseLedger, *, drift_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.ledger = ledger
        self.drift_seconds = drift_seconds
        self._clock = clock
        self.drift: dict[str, DriftState] = {}
        self.orphans_returned: Counter[str] = Counter()

    def check(self) -> None:
        now = self._clock()
        for replica in self.router.replicas():
            self._return_orphans(replica)
            self._observe_drift(replica.name, now)

    def _return_orphans(self, replica: Replica) -> None:
        orphans = self.router.in_flight(replica.name) - self.ledger.held[replica.name]
        if orphans <= 0:
            return
        log.error("%s: %d slot(s) counted in flight with no request holding them; returning them", replica.name,
                  orphans)
        self.orphans_returned[replica.name] += orphans
        for _ in range(orphans):
            self.router.release(replica, Outcome.ABORTED)

    def _observe_drift(self, name: str, now: float) -> None:
        state = self.drift.setdefault(name, DriftState())
        load = self.router.loads().get(name)
        if load is None or now - load.read_at > self.router.routing.metrics_stale_seconds:
            return  # no fresh reading: nothing to compare with, keep what we knew
        engine = round((load.running or 0.0) + (load.waiting or 0.0))
        state.surplus = max(0, self.router.in_flight(name) - engine)
        if state.surplus == 0:
            state.since, state.drifted = None, False
            return
        if state.since is None:
            state.since = now
        if not state.drifted and now - state.since >= self.drift_seconds:
            state.drifted = True
            log.error("%s: the gateway has %d more request(s) in flight than the engine reports running or waiting, "
                      "for %.0fs (slot drift)", name, state.surplus, now - state.since)

    def retain(self, names: Collection[str]) -> None:
        """Forget the standing of replicas gone from the fleet, and the ledger's counts of them."""
        for table in (self.drift, self.orphans_returned):
            for name in [name for name in table if name not in names]:
                del table[name]
        self.ledger.retain(names)

    def drifted(self, name: str) -> bool:
        state = self.drift.get(name)
        return state is not None and state.drifted

    def wedged(self) -> bool:
        """No eligible replica can take a request, and each is full only by the gateway's drifted count."""
        eligible = self.router.eligible()
        return bool(eligible) and all(
            self.router.in_flight(r.name) >= self.router.limit_of(r.name) and self.drifted(r.name) for r in eligible
        )

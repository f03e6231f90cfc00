"""Per-replica state is bounded by the live fleet: on Kubernetes every new pod is a new address, so state kept per
replica name (the router's counts and readings, ejection, adaptive limits, fair share's recent levels, the slot
audit, the prefix index, the balance window) must be dropped when its replica leaves, or it grows for ever.

A seeded storm of replica sets coming and going: each round a drawn fleet (some addresses stay, some leave, new
ones join), requests routed with prompts that fill the prefix index, failures that eject, engine readings, leases
held across a change and released after it; then the engine poll. After every poll the state holds the live
replicas only, plus a replica that left with a request still in flight (until it ends) or with an ejection
period still running (an address that flaps back stays ejected)."""

from __future__ import annotations

import random

from appliance.engine.load import EngineLoad
from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from tests.doubles import FakeClock, FakeReplica

SEED = 20260317
ROUNDS = 300
PROMPT = "You are a helpful assistant. Answer briefly and precisely, citing nothing you cannot name. "


def names_of(state) -> set[str]:
    return set(state)


def test_state_is_bounded_by_the_live_replicas_through_a_storm_of_fleet_changes():
    rng = random.Random(SEED)
    clock = FakeClock()
    fleet: list[FakeReplica] = []
    limits = ConcurrencyLimits(lambda: AIMDLimit(4, 1, 8, 0.5))
    router = Router(lambda: fleet, RoutingSettings(), limit_for=limits.limit_of, clock=clock)
    admission = Admission(router, limits, max_queue=16, queue_timeout_seconds=1, clock=clock)
    held = []  # leases kept across a fleet change
    addresses = ejections = indexed = 0
    seen: set[str] = set()
    for _ in range(ROUNDS):
        kept = [r for r in fleet if rng.random() < 0.6]
        joining = rng.randint(0 if kept else 1, 3)
        fleet[:] = kept + [FakeReplica(f"10.42.{(addresses + i) // 250}.{(addresses + i) % 250}:8100")
                           for i in range(joining)]
        addresses += joining
        seen |= {r.name for r in fleet}
        for replica in fleet:  # the load poller's readings (the engines' cache sizes reach the prefix index)
            router.observe_reading(replica.name, EngineLoad(read_at=clock(), running=1, waiting=0,
                                                            kv_capacity_tokens=4096))
        for n in range(rng.randint(1, 12)):
            lease = admission.try_lease(frozenset(), RoutingRequest(PROMPT * (1 + n % 3)))
            if lease is None:
                continue
            router.note_relayed(lease.replica)
            if rng.random() < 0.15:
                held.append(lease)
            else:
                lease.release(rng.choice([Outcome.SUCCESS, Outcome.FAILURE, Outcome.FAILURE]), 0.1)
        for lease in [lease for lease in held if rng.random() < 0.4]:
            held.remove(lease)
            lease.release(Outcome.FAILURE)
        clock.advance(1.0)
        ejections += sum(1 for h in router.ejector.health.values() if h.ejected)
        indexed = max(indexed, len(router.policy.prefix.index) if router.policy.prefix else 0)
        admission.on_poll()
        assert_bounded(router, admission, limits, fleet, held, clock())
    assert len(seen) > 5 * max(len(fleet), 1)  # the storm went through many more replicas than it ends with
    assert ejections and indexed  # it exercised ejection and the prefix index
    for lease in held:
        lease.release(Outcome.SUCCESS)
    clock.advance(router.routing.eject_max_seconds + 1)
    admission.on_poll()
    assert_bounded(router, admission, limits, fleet, [], clock())


def assert_bounded(router: Router, admission: Admission, limits: ConcurrencyLimits, fleet: list[FakeReplica],
                   held: list, now: float) -> None:
    live = {r.name for r in fleet}
    in_flight = {lease.replica.name for lease in held}
    ejecting = {name for name, health in router.ejector.health.items()
                if health.ejected_until is not None and health.ejected_until > now}
    assert names_of(router.outstanding) <= live | in_flight
    assert names_of(router._busy_since) <= live | in_flight
    assert names_of(router.load) <= live and names_of(router._relayed_at) <= live
    assert names_of(router.ejector.health) <= live | ejecting
    assert names_of(limits._limits) <= live
    assert {replica for _, replica in admission._recent} <= live
    assert names_of(admission.audit.drift) <= live and names_of(admission.audit.orphans_returned) <= live
    assert names_of(admission.ledger.reclaimed) <= live
    prefix = router.policy.prefix
    assert prefix is not None
    assert prefix.index.replicas() <= live and names_of(prefix._lives) <= live
    balance = router.policy.balance  # type: ignore[attr-defined]
    assert len(balance) <= balance.window

"""Slot leases and the slot audit (appliance.gateway.slots), alone and under generated sequences of admission
events: whatever order requests are admitted, queued, handed a slot, cancelled, timed out, released twice or
dropped in, the router's count equals the live leases after every step and returns to 0."""

from __future__ import annotations

import asyncio
import contextlib
import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.load import EngineLoad
from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.http.errors import APIError
from tests.doubles import FakeReplica


def make(limit: int = 2, replicas: int = 2, timeout: float = 0.05, drift_seconds: float = 30.0,
         clock=None) -> Admission:
    fleet = [FakeReplica(f"replica-{i}", f"http://r{i}") for i in range(replicas)]
    limits = ConcurrencyLimits(lambda: AIMDLimit(limit, 1, limit, target_seconds=1.0))
    router = Router(lambda: fleet, limit_for=limits.limit_of, **({"clock": clock} if clock else {}))
    admission = Admission(router, limits, max_queue=8, queue_timeout_seconds=timeout, drift_seconds=drift_seconds)
    if clock is not None:
        admission.audit._clock = clock
    return admission


def test_a_lease_is_released_once_whatever_calls_it_again():
    admission = make()
    lease = admission.try_lease(frozenset(), None)
    assert lease.release(Outcome.SUCCESS) is True
    assert lease.release(Outcome.FAILURE) is False  # the first outcome stands: no second slot, no failure
    assert admission.router.in_flight() == 0 and not admission.ledger.held
    assert admission.router.health_of(lease.replica.name).consecutive_failures == 0


def test_a_lease_dropped_unreleased_is_returned_and_counted():
    admission = make()
    lease = admission.try_lease(frozenset(), None)
    name = lease.replica.name
    del lease
    gc.collect()
    assert admission.router.in_flight() == 0 and not admission.ledger.held
    assert admission.ledger.reclaimed[name] == 1


def test_the_audit_returns_slots_no_lease_holds():
    admission = make()
    held = admission.try_lease(frozenset(), None)
    admission.router.try_acquire()  # a slot taken behind admission's back: no lease will ever give it back
    assert admission.router.in_flight() == 2
    admission.audit.check()
    assert admission.router.in_flight() == 1 and sum(admission.audit.orphans_returned.values()) == 1
    held.release(Outcome.SUCCESS)
    assert admission.router.in_flight() == 0


def test_a_lasting_surplus_over_the_engine_is_drift_and_wedges_readiness_only_when_full():
    now = [1000.0]
    admission = make(limit=1, replicas=1, drift_seconds=30, clock=lambda: now[0])
    router = admission.router
    lease = admission.try_lease(frozenset(), None)

    def engine_reports(running: float) -> None:
        router.update_load("replica-0", EngineLoad(running=running, waiting=0.0, read_at=now[0]))
        admission.audit.check()

    engine_reports(1.0)
    assert admission.audit.drift["replica-0"].surplus == 0
    engine_reports(0.0)  # the engine says idle while the gateway counts one in flight
    assert admission.audit.drift["replica-0"].surplus == 1 and not admission.audit.drifted("replica-0")
    now[0] += 31
    engine_reports(0.0)
    assert admission.audit.drifted("replica-0") and admission.audit.wedged()
    engine_reports(1.0)  # the engine catches up: no drift
    assert not admission.audit.drifted("replica-0") and not admission.audit.wedged()
    lease.release(Outcome.SUCCESS)


def test_stale_engine_readings_are_not_evidence_of_drift():
    now = [1000.0]
    admission = make(limit=1, replicas=1, drift_seconds=1, clock=lambda: now[0])
    lease = admission.try_lease(frozenset(), None)
    admission.router.update_load("replica-0", EngineLoad(running=0.0, waiting=0.0, read_at=now[0]))
    admission.audit.check()
    now[0] += 600  # the reading is old: nothing to compare with
    admission.audit.check()
    assert not admission.audit.drifted("replica-0")
    lease.release(Outcome.SUCCESS)


OPS = st.lists(st.tuples(st.sampled_from(["acquire", "acquire_excluding", "release", "release_twice", "drop",
                                           "cancel_waiter", "wait", "fail_replica"]),
                         st.integers(0, 7)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_generated_admission_sequences_keep_the_count_equal_to_the_live_leases(ops):
    async def scenario() -> None:
        admission = make(limit=2, replicas=2, timeout=0.02)
        router = admission.router
        leases = []
        waiters: list[asyncio.Task] = []

        def check(settled: bool = False) -> None:
            """The router's count is the ledger's, always; the leases the test sees are all of them once every
            waiter has run (before that, a lease handed to a queued request sits in its future for a moment)."""
            live = [lease for lease in leases if not lease.released]
            for name in ("replica-0", "replica-1"):
                held = sum(1 for lease in live if lease.replica.name == name)
                assert router.in_flight(name) == admission.ledger.held[name], (name, ops)
                assert (held == admission.ledger.held[name]) if settled else (held <= admission.ledger.held[name])
                assert router.in_flight(name) <= 2

        async def take(exclude: frozenset[str]) -> None:
            with contextlib.suppress(APIError):  # queue full or timed out: 429, holding nothing
                leases.append(await admission.acquire(exclude))

        for op, n in ops:
            if op in ("acquire", "acquire_excluding"):
                waiters.append(asyncio.ensure_future(take(frozenset({f"replica-{n % 2}"})
                                                          if op == "acquire_excluding" else frozenset())))
            elif op.startswith("release") and leases:
                lease = leases[n % len(leases)]
                lease.release(Outcome.SUCCESS)
                if op == "release_twice":
                    lease.release(Outcome.FAILURE)
            elif op == "drop" and leases:
                leases.pop(n % len(leases)).release(Outcome.ABORTED)
            elif op == "cancel_waiter" and waiters:
                waiters[n % len(waiters)].cancel()
            elif op == "fail_replica" and leases:
                leases[n % len(leases)].release(Outcome.FAILURE)
            await asyncio.sleep(0 if n % 3 else 0.005)
            check()
        await asyncio.gather(*waiters, return_exceptions=True)
        check(settled=True)
        for lease in leases:
            lease.release(Outcome.SUCCESS)
        admission.audit.check()
        assert router.in_flight() == 0 and not admission.ledger.held and admission.queue_length == 0
        assert not admission.ledger.reclaimed and not admission.audit.orphans_returned

    asyncio.run(scenario())

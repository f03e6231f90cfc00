"""The breakers per shape: when the input is blamed (it fails on enough replicas that fail nothing else), what an
open and a half-open breaker do, and that memory stays bounded."""

from __future__ import annotations

import random

from appliance.gateway.breaker.circuit import Breaker
from appliance.gateway.breaker.settings import BreakerSettings
from tests.doubles import FakeClock

P, Q, X = b"p" * 16, b"q" * 16, b"x" * 16


def breaker(clock: FakeClock, **settings) -> Breaker:
    return Breaker(BreakerSettings(**settings), clock)


def serving(b: Breaker, *replicas: str) -> None:
    for replica in replicas:
        b.served(replica, None)


def test_a_shape_that_fails_on_two_healthy_replicas_is_the_inputs_fault_and_is_refused():
    clock = FakeClock()
    b = breaker(clock, cooldown_seconds=30)
    serving(b, "r0", "r1")
    b.failed(P, "r0")
    assert not b.at_fault(P, "r0") and b.admit(P).refused_for is None  # one replica: it may be the engine
    b.failed(P, "r1")
    assert b.at_fault(P, "r0") and b.at_fault(P, "r1")
    assert b.admit(P).refused_for == 30 and b.refusals == 1 and b.open_count() == 1
    assert b.admit(Q).refused_for is None  # another shape is not refused


def test_a_replica_that_served_recently_is_healthy_whatever_else_failed_there():
    """A burst of different poisons meets a busy replica between two of its successes."""
    clock = FakeClock()
    b = breaker(clock)
    serving(b, "r0", "r1")
    for other in (X, Q):
        b.failed(other, "r0")
        b.failed(other, "r1")
    b.failed(P, "r0")
    b.failed(P, "r1")
    assert b.open_count() == 3 and b.at_fault(P, "r0")


def test_a_replica_that_never_served_is_not_known_to_work():
    """A fleet whose engines fail from their first request (a bad deploy) is not a poison."""
    clock = FakeClock()
    b = breaker(clock)
    b.failed(P, "r0")
    b.failed(P, "r1")
    assert b.open_count() == 0 and not b.at_fault(P, "r0")


def test_failing_twice_on_one_replica_blames_nothing():
    clock = FakeClock()
    b = breaker(clock)
    serving(b, "r0", "r1")
    b.failed(P, "r0")
    clock.advance(1)
    b.failed(P, "r0")
    assert not b.at_fault(P, "r0") and b.open_count() == 0


def test_an_outage_is_not_blamed_on_its_inputs():
    """Replicas that served nothing within the window and failed other requests since they last served one are
    not otherwise healthy: their failures count as theirs. Only the first shape they meet cannot be told from a
    poison."""
    clock = FakeClock()
    b = breaker(clock, window_seconds=60)
    serving(b, "r0", "r1")
    clock.advance(61)  # from here the engines fail everything
    b.failed(X, "r0")
    b.failed(X, "r1")
    assert b.open_count() == 1  # the first shape: nothing else failed yet
    b.failed(P, "r0")
    b.failed(P, "r1")
    assert b.open_count() == 1 and not b.at_fault(P, "r0") and not b.at_fault(P, "r1")
    clock.advance(61)  # the other failures are forgotten after the window
    b.failed(Q, "r0")
    b.failed(Q, "r1")
    assert b.at_fault(Q, "r0")


def test_an_idle_replica_is_healthy_one_that_failed_other_requests_is_not():
    clock = FakeClock()
    b = breaker(clock)
    serving(b, "r1", "r2")
    clock.advance(120)
    serving(b, "r0")
    b.failed(X, "r2")  # r2 failed another request and has served none, recently or since
    b.failed(P, "r0")
    b.failed(P, "r2")
    assert b.open_count() == 0
    b.failed(P, "r1")  # r1 served long ago and failed nothing else since: idle, healthy
    assert b.at_fault(P, "r0") and b.at_fault(P, "r1") and not b.at_fault(P, "r2")
    b.served("r2", None)  # r2 serves again: its failure of P is the input's too
    assert b.at_fault(P, "r2")


def test_three_replicas_needed_when_configured():
    clock = FakeClock()
    b = breaker(clock, replicas=3)
    serving(b, "r0", "r1", "r2")
    b.failed(P, "r0")
    b.failed(P, "r1")
    assert b.open_count() == 0
    b.failed(P, "r2")
    assert b.open_count() == 1


def test_a_shape_served_before_its_breaker_opened_is_forgotten():
    clock = FakeClock()
    b = breaker(clock)
    serving(b, "r0", "r1")
    b.failed(P, "r0")
    b.served("r1", P)  # it works elsewhere: r0's failure was r0's
    assert len(b) == 0
    b.failed(P, "r1")
    assert b.open_count() == 0


def test_failures_older_than_the_window_are_forgotten():
    clock = FakeClock()
    b = breaker(clock, window_seconds=10)
    serving(b, "r0")
    b.failed(P, "r0")
    clock.advance(11)
    serving(b, "r0", "r1")
    b.failed(P, "r1")
    assert b.open_count() == 0


def test_half_open_lets_one_trial_through_which_reopens_or_closes():
    clock = FakeClock()
    b = breaker(clock, cooldown_seconds=30)
    serving(b, "r0", "r1")
    b.failed(P, "r0")
    b.failed(P, "r1")
    clock.advance(31)
    trial = b.admit(P)
    assert trial.trial and trial.refused_for is None
    assert b.admit(P).refused_for is not None  # while the trial runs
    b.failed(P, "r0")  # the trial fails: open again, at once
    assert b.admit(P).refused_for == 30 and b.opened == 2
    clock.advance(31)
    assert b.admit(P).trial
    b.trial_ended(P)  # it ended without a verdict (the client left): the next one tries
    assert b.admit(P).trial
    b.served("r1", P)  # the trial succeeds: the shape is forgotten
    assert len(b) == 0 and b.admit(P).refused_for is None


def test_an_open_breaker_is_forgotten_a_cooldown_after_it_half_opened():
    clock = FakeClock()
    b = breaker(clock, cooldown_seconds=30)
    serving(b, "r0", "r1")
    b.failed(P, "r0")
    b.failed(P, "r1")
    clock.advance(61)
    assert b.admit(P).refused_for is None and len(b) == 0


def test_memory_is_bounded_under_a_storm_of_shapes():
    """Whatever the order of failures, refusals and services, no more than max_shapes are kept."""
    clock = FakeClock()
    b = breaker(clock, max_shapes=50, window_seconds=5, cooldown_seconds=3)
    rng = random.Random(20261205)
    replicas = [f"r{i}" for i in range(3)]
    for _ in range(20_000):
        shape = rng.randrange(400).to_bytes(16, "big")
        action = rng.random()
        if action < 0.4:
            b.failed(shape, rng.choice(replicas))
        elif action < 0.7:
            b.admit(shape)
        else:
            b.served(rng.choice(replicas), shape if rng.random() < 0.2 else None)
        clock.advance(rng.uniform(0, 0.05))
        assert len(b) <= 50
    assert b.evicted > 0 and b.opened > 0 and b.refusals > 0

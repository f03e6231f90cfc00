"""Tenant quotas: the token bucket (refill, debt, Retry-After) with a fake clock, a property over any sequence of
charges and refills, and the gateway's 429 answer over a stub upstream (the gateway's own logic)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from appliance.context import context_of
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import REQUESTS, TOKENS, Cost, Quotas, Refusal, Reservation, TokenBucket
from tests.doubles import FakeClock


def test_a_bucket_starts_full_refills_continuously_and_never_above_capacity():
    clock = FakeClock()
    bucket = TokenBucket(60, clock)  # one a second
    assert bucket.level == 60 and bucket.capacity == 60
    bucket.charge(30)
    assert bucket.level == 30
    clock.now += 10
    assert bucket.level == pytest.approx(40)
    clock.now += 3600
    assert bucket.level == 60  # clamped at one minute's worth


def test_a_charge_may_put_the_bucket_in_debt_and_the_debt_is_paid_by_time():
    clock = FakeClock()
    bucket = TokenBucket(120, clock)  # two a second
    bucket.charge(200)
    assert bucket.level == -80
    assert bucket.seconds_until(0) == pytest.approx(40)
    assert not bucket.take(1)
    clock.now += 40
    assert bucket.level == pytest.approx(0)
    clock.now += 0.5
    assert bucket.take(1)


def test_a_refund_never_lifts_the_level_above_capacity():
    clock = FakeClock()
    bucket = TokenBucket(100, clock)
    bucket.charge(10)
    bucket.charge(-50)  # the estimate was high: the engine reported less
    assert bucket.level == 100


def test_a_new_rate_keeps_the_level():
    clock = FakeClock()
    bucket = TokenBucket(600, clock)
    bucket.charge(700)
    bucket.set_rate(60)
    assert bucket.level == -100 and bucket.capacity == 60  # a tenant in debt stays in debt
    bucket.charge(-1000)
    assert bucket.level == 60  # and the new capacity bounds it


OPS = st.lists(st.tuples(st.floats(min_value=0, max_value=120, allow_nan=False),
                         st.integers(min_value=-500, max_value=2000)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(per_minute=st.integers(min_value=1, max_value=100_000), ops=OPS)
def test_level_is_capacity_minus_charged_plus_refilled_clamped(per_minute, ops):
    """Over any sequence of waits and charges (refunds included), the level never exceeds capacity and equals the
    reference: capacity - charged + refilled, clamped at capacity each time it refills or is refunded."""
    clock = FakeClock()
    bucket = TokenBucket(per_minute, clock)
    expected = float(per_minute)
    for wait, charge in ops:
        clock.now += wait
        expected = min(per_minute, expected + wait * per_minute / 60)
        bucket.charge(charge)
        expected = min(per_minute, expected - charge)
        assert bucket.level <= bucket.capacity
        assert bucket.level == pytest.approx(expected, rel=1e-9, abs=1e-6)


def tenant(name: str = "team-a", **quotas) -> Tenant:
    return Tenant(name, **quotas)


def cost(tokens: int, requests: int = 1) -> Cost:
    return Cost(tokens, 0, requests)


def test_a_reservation_takes_the_worst_case_of_both_limits_or_nothing():
    clock = FakeClock()
    quotas = Quotas([tenant(tokens_per_minute=1000, requests_per_minute=2)], clock)
    assert isinstance(quotas.reserve(tenant(), cost(100)), Reservation)
    assert quotas.get("team-a").tokens.level == 900
    assert isinstance(quotas.reserve(tenant(), cost(100)), Reservation)
    refused = quotas.reserve(tenant(), cost(100))  # the third request in the same instant
    assert isinstance(refused, Refusal) and refused.limit == REQUESTS and refused.per_minute == 2
    assert refused.retry_after == 30  # half a minute to refill one request of two per minute
    assert quotas.get("team-a").tokens.level == 800  # a refused request takes nothing
    assert "team-a" in refused.message and "2 requests per minute" in refused.message


def test_a_reservation_waits_until_the_bucket_holds_it_in_whole_seconds_at_least_one():
    clock = FakeClock()
    quotas = Quotas([tenant(tokens_per_minute=60)], clock)
    held = quotas.reserve(tenant(), cost(10))
    held.settle(100)  # the engine reported far more than the worst case estimated
    assert quotas.get("team-a").tokens.level == -40
    refused = quotas.reserve(tenant(), cost(10))
    assert refused.limit == TOKENS and refused.retry_after == 50  # until 10 tokens are back
    clock.now += 49.5
    assert quotas.reserve(tenant(), cost(10)).retry_after == 1  # rounded up, never 0
    clock.now += 0.5
    assert isinstance(quotas.reserve(tenant(), cost(10)), Reservation)


def test_a_reservation_larger_than_a_minutes_worth_is_refused_for_good():
    quotas = Quotas([tenant(tokens_per_minute=100, requests_per_minute=4)], FakeClock())
    refused = quotas.reserve(tenant(), cost(101))
    assert refused.never and refused.limit == TOKENS and refused.needed == 101
    assert "lower max_tokens or n" in refused.message
    assert quotas.reserve(tenant(), cost(1, requests=5)).never
    assert quotas.get("team-a").tokens.level == 100


def test_settle_and_refund_count_once():
    quotas = Quotas([tenant(tokens_per_minute=100, requests_per_minute=10)], FakeClock())
    held = quotas.reserve(tenant(), cost(50, requests=3))
    held.settle(20)
    held.settle(20)
    held.refund()  # settled already: nothing more
    assert quotas.get("team-a").tokens.level == 80 and quotas.get("team-a").requests.level == 7
    other = quotas.reserve(tenant(), cost(50, requests=3))
    other.refund()
    other.refund()
    assert quotas.get("team-a").tokens.level == 80 and quotas.get("team-a").requests.level == 7


def test_tenants_without_quota_are_never_refused():
    quotas = Quotas([tenant("free")], FakeClock())
    for _ in range(1000):
        assert quotas.reserve(tenant("free"), cost(10_000)) is None
    assert quotas.ratios() == []


def test_update_keeps_levels_drops_removed_tenants_and_starts_new_ones_full():
    clock = FakeClock()
    quotas = Quotas([tenant("a", tokens_per_minute=100), tenant("b", requests_per_minute=10)], clock)
    quotas.charge(tenant("a"), 250)  # a is in debt
    quotas.reserve(tenant("b"), cost(1))
    quotas.update([tenant("a", tokens_per_minute=200, requests_per_minute=5), tenant("c", tokens_per_minute=50)])
    assert quotas.get("a").tokens.level == -150 and quotas.get("a").tokens.capacity == 200
    assert quotas.get("a").requests.level == 5  # a new limit starts full
    assert quotas.get("b") is None
    assert quotas.get("c").tokens.level == 50
    assert quotas.ratios() == [("a", TOKENS, -0.75), ("a", REQUESTS, 1.0), ("c", TOKENS, 1.0)]


def test_a_reservation_settles_into_its_bucket_across_a_reload():
    clock = FakeClock()
    quotas = Quotas([tenant("a", tokens_per_minute=100)], clock)
    held = quotas.reserve(tenant("a"), cost(80))
    quotas.update([tenant("a", tokens_per_minute=200)])  # a new rate: same bucket, same level
    held.settle(30)
    assert quotas.get("a").tokens.level == 70


def test_a_tenant_removed_and_added_back_keeps_its_debt():
    """Removing a tenant and adding it back by two reloads must not hand it a fresh, full bucket."""
    clock = FakeClock()
    quotas = Quotas([tenant("a", tokens_per_minute=60, requests_per_minute=2)], clock)
    quotas.charge(tenant("a"), 600)  # ten minutes' worth: deep in debt
    assert quotas.reserve(tenant("a"), cost(1)).limit == TOKENS
    quotas.update([])
    assert quotas.get("a") is None and quotas.ratios() == []  # gone from the metrics and the checks
    clock.advance(30)
    quotas.update([tenant("a", tokens_per_minute=60, requests_per_minute=2)])
    assert quotas.get("a").tokens.level == pytest.approx(-510)  # the debt, less what 30 s refilled
    assert quotas.reserve(tenant("a"), cost(1)).limit == TOKENS


def test_a_limit_unset_and_set_again_keeps_its_level():
    clock = FakeClock()
    quotas = Quotas([tenant("a", tokens_per_minute=60)], clock)
    quotas.charge(tenant("a"), 120)
    quotas.update([tenant("a", requests_per_minute=5)])  # the token limit is unset...
    quotas.update([tenant("a", tokens_per_minute=60)])  # ...and set again
    assert quotas.get("a").tokens.level == -60


def test_a_removed_tenant_is_forgotten_once_its_bucket_has_refilled():
    """What is kept of removed tenants shrinks: a full bucket is what a new one would be anyway."""
    clock = FakeClock()
    quotas = Quotas([tenant(f"t{i}", tokens_per_minute=60) for i in range(50)], clock)
    for i in range(50):
        quotas.charge(tenant(f"t{i}"), 30)
    quotas.update([])
    assert len(quotas._idle) == 50
    clock.advance(31)
    quotas.update([])
    assert quotas._idle == {}


# -- the reservation storm ------------------------------------------------------------------------------------------

STORM_CASES = 200
STORM_SEED = 20260611


def end_reservation(rng: random.Random, held: Any, reserved: int) -> tuple[int, int]:
    """End a storm's open reservation as a request ends, drawn by ``rng``: settled to its usage, over its worst
    case, refunded, settled then refunded, or settled twice. Returns (tokens used, requests given back)."""
    how = rng.choice(["settle", "over", "refund", "abandon", "twice"])
    if how == "refund":
        held.refund()
        return 0, held.requests
    spent = rng.randint(0, reserved) if how != "over" else reserved + rng.randint(1, 50)
    held.settle(spent)
    if how == "abandon":
        held.refund()  # the end that came second changes nothing
    elif how == "twice":
        held.settle(rng.randint(0, reserved))
    return spent, 0


def test_a_storm_of_reservations_returns_the_bucket_to_its_baseline():
    """Seeded storm: per case, requests reserve their worst case in a random order, and each then ends in one of
    the ways a request ends (settled to its usage, usage above the worst case, refunded: it reached no engine,
    abandoned: settled and refunded again, settled twice), interleaved at random, the clock standing still so that
    nothing refills. Invariants, after every step: the level is the baseline less what is reserved now and what
    the ended requests used (nothing charged twice, nothing forgotten), and never above the capacity; a refusal
    takes nothing. After all ended and the clock ran a minute, the bucket is back at its baseline."""
    rng = random.Random(STORM_SEED)
    for case in range(STORM_CASES):
        clock = FakeClock()
        capacity = rng.choice([500, 2_000, 20_000])
        quotas = Quotas([tenant(tokens_per_minute=capacity, requests_per_minute=rng.choice([10, 100]))], clock)
        bucket, requests = quotas.get("team-a").tokens, quotas.get("team-a").requests
        baseline = bucket.level
        open_: list[tuple[Reservation, int]] = []
        used = requests_taken = 0.0
        for _step in range(rng.randint(5, 60)):
            if open_ and rng.random() < 0.5:
                spent, given_back = end_reservation(rng, *open_.pop(rng.randrange(len(open_))))
                used += spent
                requests_taken -= given_back
            else:
                wanted = Cost(rng.randint(1, 50), rng.randint(0, capacity // 4), rng.randint(1, 4))
                before = (bucket.level, requests.level)
                held = quotas.reserve(tenant(), wanted)
                if isinstance(held, Reservation):
                    open_.append((held, wanted.tokens))
                    requests_taken += wanted.requests
                else:
                    assert (bucket.level, requests.level) == before, case  # a refusal takes nothing
            outstanding = sum(reserved for _, reserved in open_)
            assert bucket.level == pytest.approx(baseline - outstanding - used), case
            assert bucket.level <= bucket.capacity and requests.level <= requests.capacity
            assert requests.level == pytest.approx(requests.capacity - requests_taken), case
        for held, _reserved in open_:
            held.refund()
        assert bucket.level == pytest.approx(baseline - used), case  # only what was used stays charged
        clock.advance(60 + used * 60 / capacity)
        assert bucket.level == baseline and requests.level == requests.capacity, case


# -- the gateway's answer --------------------------------------------------------------------------------------------

TENANTS = [{"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 1},
           {"name": "team-b", "api_keys": ["key-b"], "tokens_per_minute": 1000}]


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for metric in registry.collect() for s in metric.samples
            if s.name == name}


@pytest.mark.parametrize("stream", [False, True])
def test_a_spent_quota_is_a_429_with_retry_after_and_an_openai_error(make_client, stubs, stream):
    client = make_client(tenants=TENANTS)
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "stream": stream}
    first = client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert first.status_code == 200
    received = sum(len(stub.received) for stub in stubs)
    refused = client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "team-a" in error["message"] and "1 requests per minute" in error["message"]
    assert "key-a" not in json.dumps(refused.json())
    assert sum(len(stub.received) for stub in stubs) == received  # refused before it reached an engine
    # the other tenant is not affected
    other = client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-b"})
    assert other.status_code == 200
    registry = context_of(client.app).registry
    limited = samples(registry, "appliance_tenant_rate_limited_total")
    assert limited[(("limit", "requests"), ("tenant", "team-a"))] == 1
    assert limited[(("limit", "tokens"), ("tenant", "team-b"))] == 0
    answered = samples(registry, "appliance_tenant_requests_total")
    assert answered[(("code", "429"), ("tenant", "team-a"))] == 1
    assert answered[(("code", "200"), ("tenant", "team-a"))] == 1
    assert answered[(("code", "429"), ("tenant", "team-b"))] == 0
    fleet = samples(registry, "appliance_requests_total")
    assert fleet[(("code", "429"), ("route", "completions"))] == 1
    ratios = samples(registry, "appliance_tenant_quota_remaining_ratio")
    assert ratios[(("limit", "requests"), ("tenant", "team-a"))] < 0.05
    assert (("limit", "tokens"), ("tenant", "team-a")) not in ratios  # only the quotas a tenant has
    assert ratios[(("limit", "tokens"), ("tenant", "team-b"))] < 1

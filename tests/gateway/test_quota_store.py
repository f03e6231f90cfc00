"""The shared quota store against a real redis-server (tests/gateway/redis_server.py: its own loopback port and
directory, no persistence, killed at teardown): the Lua buckets give the in-process buckets' answers (the same
cases run against both stores), a seeded storm across two store clients returns the level to capacity, two
gateways sharing the store hold a tenant to one quota, and an unreachable store fails open or closed as
configured, then recovers without a restart.

Time: the store refills by its own clock (Redis ``TIME``); these tests give the store a clock instead
(``SharedQuotas(clock=...)``, the script's ``now``): a fake one that stands still for the bucket cases and the
storm, and one that runs 60 times real time for the quota across two gateways, so that a real second is one
minute of quota."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from appliance.context import context_of
from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.quota import REQUESTS, TOKENS, Cost, Quotas, Refusal
from appliance.gateway.tenants.quota_store import KEY_SLACK_SECONDS, SharedQuotas, StoreUnavailable, connect
from appliance.gateway.tenants.settings import QuotaStoreSettings
from tests.doubles import FakeClock
from tests.gateway.live import wait_until
from tests.gateway.redis_server import RedisServer
from tests.gateway.test_quota import end_reservation
from tests.gateway.upstream.support import chain, exchange


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    """A server of the test's own, for the tests that stop it."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


_prefixes = iter(range(1_000_000))


def prefix() -> str:
    """Keys of their own for each test (one server serves the module)."""
    return f"test:{next(_prefixes)}:{time.monotonic_ns()}"


def store_settings(url: str, key_prefix: str | None = None, **more: Any) -> QuotaStoreSettings:
    return QuotaStoreSettings(kind="redis", url=url, key_prefix=key_prefix or prefix(), **more)


def shared(url: str, clock: Callable[[], float] | None, key_prefix: str | None = None, **more: Any) -> SharedQuotas:
    settings = store_settings(url, key_prefix, **more)
    return SharedQuotas(Redis.from_url(url), settings, CollectorRegistry(), clock=clock)


def tenant(name: str = "team-a", **quotas: int) -> Tenant:
    return Tenant(name, **quotas)


def cost(tokens: int, requests: int = 1) -> Cost:
    return Cost(tokens, 0, requests)


# -- the same bucket cases against both stores ----------------------------------------------------------------------


class MemoryBuckets:
    """``tenants.quota.Quotas``, behind the calls the shared store answers."""

    def __init__(self, tenants: list[Tenant], clock: FakeClock) -> None:
        self.quotas = Quotas(tenants, clock)

    def configure(self, tenants: list[Tenant]) -> None:
        self.quotas.update(tenants)

    async def reserve(self, who: Tenant, wanted: Cost) -> Any:
        return self.quotas.reserve(who, wanted)

    async def charge(self, who: Tenant, tokens: float) -> None:
        self.quotas.charge(who, tokens)

    async def level(self, who: Tenant, limit: str) -> float:
        quota = self.quotas.get(who.name)
        assert quota is not None
        bucket = quota.tokens if limit == TOKENS else quota.requests
        assert bucket is not None
        return bucket.level

    async def close(self) -> None:
        pass


class RedisBuckets:
    """``quota_store.SharedQuotas`` on the test's redis-server; rates come with each call, as from a gateway."""

    def __init__(self, url: str, clock: FakeClock) -> None:
        self.store = shared(url, clock)

    def configure(self, tenants: list[Tenant]) -> None:
        pass  # nothing to tell the store: every call carries its tenant's rates

    async def reserve(self, who: Tenant, wanted: Cost) -> Any:
        return await self.store.reserve(who, wanted)

    async def charge(self, who: Tenant, tokens: float) -> None:
        self.store.charge(who, tokens)
        assert await self.store.drain(5) == 0  # in the store before the case goes on

    async def level(self, who: Tenant, limit: str) -> float:
        assert await self.store.drain(5) == 0  # settles are background tasks: the level once they are in
        return (await self.store.levels(who))[limit]

    async def close(self) -> None:
        await self.store.close()


Case = Callable[[Any, FakeClock], Awaitable[None]]


def both(case: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run the case against the in-process buckets and the shared store alike, starting with ``tenants``."""

    @pytest.mark.parametrize("kind", ["memory", "redis"])
    def test(kind: str, request: pytest.FixtureRequest) -> None:
        async def run() -> None:
            clock = FakeClock()
            tenants = getattr(case, "tenants", [])
            buckets: Any = (MemoryBuckets(tenants, clock) if kind == "memory"
                            else RedisBuckets(request.getfixturevalue("redis_server").url, clock))
            try:
                await case(buckets, clock)
            finally:
                await buckets.close()
        asyncio.run(run())

    test.__name__ = case.__name__
    test.__doc__ = case.__doc__
    return test


def given_tenants(*tenants: Tenant) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    def mark(case: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        case.tenants = list(tenants)  # type: ignore[attr-defined]
        return case
    return mark


@both
@given_tenants(tenant(tokens_per_minute=1000, requests_per_minute=2))
async def test_a_reservation_takes_the_worst_case_of_both_limits_or_nothing(buckets: Any, clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=1000, requests_per_minute=2)
    assert not isinstance(await buckets.reserve(who, cost(100)), Refusal)
    assert await buckets.level(who, TOKENS) == 900
    assert not isinstance(await buckets.reserve(who, cost(100)), Refusal)
    refused = await buckets.reserve(who, cost(100))  # the third request in the same instant
    assert isinstance(refused, Refusal) and refused.limit == REQUESTS and refused.per_minute == 2
    assert refused.retry_after == 30  # half a minute to refill one request of two per minute
    assert await buckets.level(who, TOKENS) == 800  # a refused request takes nothing
    assert "team-a" in refused.message and "2 requests per minute" in refused.message


@both
@given_tenants(tenant(tokens_per_minute=60))
async def test_a_reservation_waits_until_the_bucket_holds_it_in_whole_seconds_at_least_one(
        buckets: Any, clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=60)
    held = await buckets.reserve(who, cost(10))
    held.settle(100)  # the engine reported far more than the worst case estimated
    assert await buckets.level(who, TOKENS) == -40
    refused = await buckets.reserve(who, cost(10))
    assert refused.limit == TOKENS and refused.retry_after == 50  # until 10 tokens are back
    clock.now += 49.5
    assert (await buckets.reserve(who, cost(10))).retry_after == 1  # rounded up, never 0
    clock.now += 0.5
    assert not isinstance(await buckets.reserve(who, cost(10)), Refusal)


@both
@given_tenants(tenant(tokens_per_minute=100, requests_per_minute=4))
async def test_a_reservation_larger_than_a_minutes_worth_is_refused_for_good(buckets: Any, clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=100, requests_per_minute=4)
    refused = await buckets.reserve(who, cost(101))
    assert refused.never and refused.limit == TOKENS and refused.needed == 101
    assert "lower max_tokens or n" in refused.message
    assert (await buckets.reserve(who, cost(1, requests=5))).never
    assert await buckets.level(who, TOKENS) == 100


@both
@given_tenants(tenant(tokens_per_minute=100, requests_per_minute=10))
async def test_settle_and_refund_count_once(buckets: Any, clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=100, requests_per_minute=10)
    held = await buckets.reserve(who, cost(50, requests=3))
    held.settle(20)
    held.settle(20)
    held.refund()  # settled already: nothing more
    assert await buckets.level(who, TOKENS) == 80 and await buckets.level(who, REQUESTS) == 7
    other = await buckets.reserve(who, cost(50, requests=3))
    other.refund()
    other.refund()
    assert await buckets.level(who, TOKENS) == 80 and await buckets.level(who, REQUESTS) == 7


@both
@given_tenants(tenant("free"))
async def test_tenants_without_quota_are_never_refused(buckets: Any, clock: FakeClock) -> None:
    for _ in range(100):
        assert await buckets.reserve(tenant("free"), cost(10_000)) is None


@both
@given_tenants(tenant(tokens_per_minute=120))
async def test_a_charge_may_put_the_bucket_in_debt_and_the_debt_is_paid_by_time(buckets: Any,
                                                                                 clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=120)  # two a second
    await buckets.charge(who, 200)
    assert await buckets.level(who, TOKENS) == -80
    assert (await buckets.reserve(who, cost(1))).retry_after == 41
    clock.now += 40
    assert await buckets.level(who, TOKENS) == pytest.approx(0)
    clock.now += 0.5
    assert not isinstance(await buckets.reserve(who, cost(1)), Refusal)
    await buckets.charge(who, -1000)  # a refund never lifts the level above capacity
    assert await buckets.level(who, TOKENS) == 120


@both
@given_tenants(tenant(tokens_per_minute=600))
async def test_a_new_rate_keeps_the_level(buckets: Any, clock: FakeClock) -> None:
    await buckets.charge(tenant(tokens_per_minute=600), 700)
    buckets.configure([tenant(tokens_per_minute=60)])
    slow = tenant(tokens_per_minute=60)
    assert await buckets.level(slow, TOKENS) == -100  # a tenant in debt stays in debt
    await buckets.charge(slow, -1000)
    assert await buckets.level(slow, TOKENS) == 60  # and the new capacity bounds it


@both
@given_tenants(tenant(tokens_per_minute=100))
async def test_a_reservation_settles_into_its_bucket_across_a_reload(buckets: Any, clock: FakeClock) -> None:
    held = await buckets.reserve(tenant(tokens_per_minute=100), cost(80))
    buckets.configure([tenant(tokens_per_minute=200)])  # a new rate: same bucket, same level
    held.settle(30)
    assert await buckets.level(tenant(tokens_per_minute=200), TOKENS) == 70


@both
@given_tenants(tenant(tokens_per_minute=60, requests_per_minute=2))
async def test_a_tenant_removed_and_added_back_keeps_its_debt(buckets: Any, clock: FakeClock) -> None:
    who = tenant(tokens_per_minute=60, requests_per_minute=2)
    await buckets.charge(who, 600)  # ten minutes' worth: deep in debt
    assert (await buckets.reserve(who, cost(1))).limit == TOKENS
    buckets.configure([])
    clock.advance(30)
    buckets.configure([who])
    assert await buckets.level(who, TOKENS) == pytest.approx(-510)  # the debt, less what 30 s refilled
    assert (await buckets.reserve(who, cost(1))).limit == TOKENS


# -- the store's own -----------------------------------------------------------------------------------------------


def test_one_key_a_tenant_under_the_prefix_expiring_once_its_buckets_are_full(redis_server: RedisServer) -> None:
    async def run() -> None:
        clock = FakeClock()
        store = shared(redis_server.url, clock)
        who = tenant(tokens_per_minute=60, requests_per_minute=6)
        try:
            held = await store.reserve(who, cost(30))  # tokens full in 30 s, requests in 10 s
            assert not isinstance(held, Refusal)
            keys = [key.decode() async for key in store.client.scan_iter(match=f"{store.settings.key_prefix}:*")]
            assert keys == [store.key("team-a")]
            ttl = await store.client.ttl(store.key("team-a"))
            assert 30 + KEY_SLACK_SECONDS - 1 <= ttl <= 30 + KEY_SLACK_SECONDS + 1
            held.settle(0)
            assert await store.drain(5) == 0
            assert await store.client.ttl(store.key("team-a")) <= 10 + KEY_SLACK_SECONDS + 1  # shorter once repaid
            await store.client.delete(store.key("team-a"))  # expired: a fresh bucket, full, as it would be by then
            assert await store.levels(who) == {TOKENS: 60, REQUESTS: 6}
        finally:
            await store.close()
    asyncio.run(run())


def test_without_a_clock_of_its_own_the_store_refills_by_its_time(redis_server: RedisServer) -> None:
    async def run() -> None:
        one, other = shared(redis_server.url, None), None
        try:
            other = shared(redis_server.url, None, key_prefix=one.settings.key_prefix)
            who = tenant(tokens_per_minute=6000)  # 100 a second
            await one.reserve(who, cost(3000))
            level = (await other.levels(who))[TOKENS]
            assert 3000 <= level < 3100  # what the other took, less a few ms of refill by the store's clock
            await asyncio.sleep(0.2)
            assert (await one.levels(who))[TOKENS] >= level + 15
        finally:
            await one.close()
            if other is not None:
                await other.close()
    asyncio.run(run())


STORM_CASES = 40
STORM_SEED = 20261205


def test_a_storm_across_two_gateways_stores_returns_the_bucket_to_capacity(redis_server: RedisServer) -> None:
    """Seeded storm: per case, two store clients (two gateways) share one tenant's buckets; requests reserve
    through either, and each ends as requests end (settled to its usage, over its worst case, refunded, settled
    and refunded, settled twice), with continuous charges between, the clock standing still. After every step:
    the level is capacity less what is reserved and what was used, never above capacity; a refusal takes nothing.
    Once all ended and a minute and the debt's time have passed, both buckets are full again."""
    rng = random.Random(STORM_SEED)

    async def run() -> None:
        for case in range(STORM_CASES):
            clock = FakeClock()
            stores = [shared(redis_server.url, clock)]
            stores.append(shared(redis_server.url, clock, key_prefix=stores[0].settings.key_prefix))
            capacity = rng.choice([500, 2_000, 20_000])
            who = tenant(tokens_per_minute=capacity, requests_per_minute=rng.choice([10, 100]))
            open_: list[tuple[Any, int]] = []
            used = 0.0
            requests_taken = 0
            try:
                for _step in range(rng.randint(5, 40)):
                    roll = rng.random()
                    if open_ and roll < 0.45:
                        spent, given_back = end_reservation(rng, *open_.pop(rng.randrange(len(open_))))
                        used += spent
                        requests_taken -= given_back
                    elif roll < 0.55:
                        charged = rng.randint(1, 40)  # a leaving client's tokens, charged as they are made
                        rng.choice(stores).charge(who, charged)
                        used += charged
                    else:
                        wanted = Cost(rng.randint(1, 50), rng.randint(0, capacity // 4), rng.randint(1, 4))
                        held = await rng.choice(stores).reserve(who, wanted)
                        if not isinstance(held, Refusal):
                            open_.append((held, wanted.tokens))
                            requests_taken += wanted.requests
                    for store in stores:
                        assert await store.drain(5) == 0
                    levels = await stores[rng.randrange(2)].levels(who)
                    outstanding = sum(reserved for _, reserved in open_)
                    assert levels[TOKENS] == pytest.approx(capacity - outstanding - used), case
                    assert levels[TOKENS] <= capacity and levels[REQUESTS] <= who.requests_per_minute
                    assert levels[REQUESTS] == pytest.approx(who.requests_per_minute - requests_taken), case
                for held, _reserved in open_:
                    held.refund()
                for store in stores:
                    await store.drain(5)
                assert (await stores[0].levels(who))[TOKENS] == pytest.approx(capacity - used), case
                clock.advance(60 + used * 60 / capacity)
                assert await stores[1].levels(who) == {TOKENS: capacity, REQUESTS: who.requests_per_minute}, case
            finally:
                for store in stores:
                    await store.close()
    asyncio.run(run())


def test_a_store_that_stops_answering_is_counted_and_said_once_each_way(own_redis: RedisServer,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        store = shared(own_redis.url, None, probe_seconds=0.05)
        who = tenant(tokens_per_minute=1000)
        try:
            held = await store.reserve(who, cost(100))
            own_redis.kill()
            held.settle(10)  # its settle cannot reach the store: counted
            assert await store.drain(5) == 0
            for _ in range(3):
                with pytest.raises(StoreUnavailable):
                    await store.reserve(who, cost(1))
            assert not store.reachable and store.state()["reachable"] is False
            assert store.up._value.get() == 0
            assert store.errors.labels("settle")._value.get() == 1
            assert store.errors.labels("reserve")._value.get() == 3
            own_redis.start()
            await asyncio.sleep(0.06)
            assert not isinstance(await store.reserve(who, cost(1)), Refusal)
            assert store.reachable and store.up._value.get() == 1
        finally:
            await store.close()
    asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if r.name.endswith("quota_store")]
    assert len(said) == 2, said  # one line down, one line back: not one a request
    assert "unreachable" in said[0] and "reachable again" in said[1]


def owed(store: SharedQuotas) -> float:
    return next(iter(store.owed.collect())).samples[0].value


def test_what_is_charged_while_the_store_does_not_answer_is_written_once_it_does(own_redis: RedisServer) -> None:
    """A request admitted unchecked (failure: open) is owed, not forgiven: once the store answers again the
    buckets hold what they would have had it answered all along, the settle that timed out counted once."""
    async def run() -> None:
        clock = FakeClock(1000.0)  # no refill while the test runs
        store = shared(own_redis.url, clock, probe_seconds=0.05, timeout_seconds=0.2)
        who = tenant(tokens_per_minute=1000, requests_per_minute=10)
        try:
            held = await store.reserve(who, cost(100))
            assert not isinstance(held, Refusal) and held is not None
            own_redis.pause()
            held.settle(10)  # times out: the store runs it when it can, so it is not owed (it would count twice)
            assert await store.drain(5) == 0
            assert not store.reachable and owed(store) == 0
            unchecked = store.admit_unchecked(who, cost(50))
            unchecked.settle(50)  # the store is known down: 50 tokens and a request are owed
            assert await store.drain(5) == 0
            assert owed(store) == 50
            own_redis.resume()
            await asyncio.sleep(0.06)
            await store.levels(who)  # it answers: what is owed is written
            assert await store.drain(5) == 0
            assert await store.levels(who) == {TOKENS: 1000 - 100 + 90 - 50, REQUESTS: 10 - 1 - 1}
            assert owed(store) == 0
        finally:
            own_redis.resume()
            await store.close()
    asyncio.run(run())


def test_the_password_comes_from_its_file_and_a_wrong_one_is_an_unreachable_store(tmp_path) -> None:
    server = RedisServer(tmp_path / "redis", "--requirepass", "s3cret-store").start()
    (tmp_path / "password").write_text("s3cret-store\n")
    (tmp_path / "wrong").write_text("guess\n")

    async def run() -> None:
        right = QuotaStoreSettings(kind="redis", url=server.url, password_file=tmp_path / "password")
        assert right.password == "s3cret-store" and "s3cret" not in right.redacted_url
        store = SharedQuotas(connect(right), right, CollectorRegistry())
        wrong = QuotaStoreSettings(kind="redis", url=server.url, password_file=tmp_path / "wrong")
        refused = SharedQuotas(connect(wrong), wrong, CollectorRegistry())
        try:
            assert not isinstance(await store.reserve(tenant(tokens_per_minute=100), cost(10)), Refusal)
            with pytest.raises(StoreUnavailable):
                await refused.reserve(tenant(tokens_per_minute=100), cost(10))
            assert refused.errors.labels("reserve")._value.get() == 1
        finally:
            await store.close()
            await refused.close()
    try:
        asyncio.run(run())
    finally:
        server.kill()


def test_a_request_cancelled_while_the_store_answers_gives_back_what_it_took(redis_server: RedisServer) -> None:
    """The gateway shutting down cancels a request whose reservation the store has just taken: once the answer
    comes, it is refunded (nothing else would ever settle it)."""
    who = tenant(tokens_per_minute=1000, requests_per_minute=10)

    async def run() -> None:
        store = shared(redis_server.url, FakeClock())
        answered, release = asyncio.Event(), asyncio.Event()
        reserve = store.reserve

        async def slow(tenant: Tenant, wanted: Cost) -> Any:
            held = await reserve(tenant, wanted)
            answered.set()
            await release.wait()
            return held

        store.reserve = slow  # type: ignore[method-assign]
        accounting = TenantAccounting(CollectorRegistry(), slo_ttft_seconds=1.0)
        admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
        metering = Metering(accounting, Quotas([]), admission, max_model_len=1000, shared=store)
        ex = exchange({"prompt": "hello", "max_tokens": 90})
        ex.tenant = who
        pending = chain(ex, metering.start(ex)).arrived()
        assert pending is not None
        arriving = asyncio.ensure_future(pending)
        await answered.wait()
        assert (await store.levels(who))[TOKENS] < 1000  # taken
        arriving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await arriving
        release.set()
        await asyncio.sleep(0.01)
        assert await store.drain(5) == 0
        assert await store.levels(who) == {TOKENS: 1000, REQUESTS: 10}
        await store.close()
    asyncio.run(run())


def test_settings_keep_the_password_out_of_the_url(tmp_path) -> None:
    with pytest.raises(ValueError, match="password_file"):
        QuotaStoreSettings(kind="redis", url="redis://:hunter2@store:6379/0")
    with pytest.raises(ValueError, match="redis://"):
        QuotaStoreSettings(kind="redis", url="http://store:6379")
    with pytest.raises(ValueError, match="does not exist"):
        QuotaStoreSettings(kind="redis", password_file=tmp_path / "missing")
    assert QuotaStoreSettings().kind == "memory"  # one gateway: the embedded buckets


# -- gateways sharing the store -------------------------------------------------------------------------------------


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for metric in registry.collect() for s in metric.samples
            if s.name == name}


def accepted_tokens(*clients: Any) -> float:
    """The tokens the tenant was charged through every gateway (what the engines reported and the estimates)."""
    total = 0.0
    for client in clients:
        tokens = samples(context_of(client.app).registry, "appliance_tenant_tokens_total")
        total += sum(v for labels, v in tokens.items() if dict(labels).get("tenant") == "team-a")
    return total


TENANT = {"name": "team-a", "api_keys": ["key-a"]}
KEY = {"authorization": "Bearer key-a"}
BODY = {"model": "demo", "prompt": "hello", "max_tokens": 8}


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_two_gateways_grant_one_quota_only_through_the_shared_store(make_client, redis_server, kind):
    """Without the store each gateway grants the whole quota (two gateways: twice); with it, once."""
    store = {"kind": kind, "url": redis_server.url, "key_prefix": prefix()}
    tenants = [{**TENANT, "requests_per_minute": 3}]
    gateways = [make_client(tenants=tenants, quota_store=store) for _ in range(2)]
    answers = [gateways[i % 2].post("/v1/completions", json=BODY, headers=KEY).status_code for i in range(12)]
    assert answers.count(200) == (6 if kind == "memory" else 3), answers
    assert set(answers) == {200, 429}


SPEED = 60.0  # the store's clock runs this much faster than real time: a real second is one minute of quota
QUOTA = 300  # tokens per minute


def test_two_gateways_sharing_the_store_stay_within_the_quota_per_minute(make_client, redis_server):
    """Both gateways take the tenant's requests as fast as they come, alternately; its accepted tokens through
    both together, over minutes after the first (the first holds the bucket's initial minute's worth), stay
    within 1.1x of its quota and use most of it."""
    store = {"kind": "redis", "url": redis_server.url, "key_prefix": prefix()}
    gateways = [make_client(tenants=[{**TENANT, "tokens_per_minute": QUOTA}], quota_store=store) for _ in range(2)]
    start = time.monotonic()
    fast = lambda: 1000.0 + (time.monotonic() - start) * SPEED  # noqa: E731
    for client in gateways:
        shared_store = context_of(client.app).gateway.quota_store
        assert shared_store is not None
        shared_store.clock = fast

    def send_for(seconds: float) -> dict[int, int]:
        codes: dict[int, int] = {}
        until = time.monotonic() + seconds
        i = 0
        while time.monotonic() < until:
            code = gateways[i % 2].post("/v1/completions", json=BODY, headers=KEY).status_code
            codes[code] = codes.get(code, 0) + 1
            i += 1
        return codes

    send_for(1.0)  # the first minute: the bucket's initial burst, and then the refill
    before, began = accepted_tokens(*gateways), fast()
    codes = send_for(3.0)
    minutes = (fast() - began) / 60
    time.sleep(0.1)  # the last settles
    per_minute = (accepted_tokens(*gateways) - before) / minutes
    assert codes.get(429, 0) > codes.get(200, 0) > 10, codes  # the quota, not the client, was the bound
    assert 0.7 * QUOTA <= per_minute <= 1.1 * QUOTA, (per_minute, codes)


@pytest.mark.parametrize("failure", ["open", "closed"])
def test_an_unreachable_store_fails_as_configured_and_recovers_without_a_restart(make_client, own_redis, failure):
    store = {"kind": "redis", "url": own_redis.url, "key_prefix": prefix(), "failure": failure,
             "probe_seconds": 0.05, "retry_after_seconds": 7}
    client = make_client(tenants=[{**TENANT, "tokens_per_minute": 10_000}], quota_store=store)
    registry = context_of(client.app).registry
    assert client.post("/v1/completions", json=BODY, headers=KEY).status_code == 200
    assert client.get("/health/serving").json()["quota_store"] == {"kind": "redis", "reachable": True,
                                                                   "failure": failure, "down_since": None}
    own_redis.kill()
    answer = client.post("/v1/completions", json=BODY, headers=KEY)
    if failure == "open":
        assert answer.status_code == 200  # admitted without its quota checked
    else:
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        error = answer.json()["error"]
        assert error["code"] == "quota_store_unavailable" and "quota store" in error["message"]
    assert samples(registry, "appliance_quota_store_unchecked_requests_total")[(("direction", failure),)] == 1
    assert samples(registry, "appliance_quota_store_up")[()] == 0
    assert samples(registry, "appliance_quota_store_errors_total")[(("operation", "reserve"),)] >= 1
    health = client.get("/health/serving")
    assert health.status_code == 200 and health.json()["quota_store"]["reachable"] is False
    own_redis.start()
    time.sleep(0.06)
    assert client.post("/v1/completions", json=BODY, headers=KEY).status_code == 200
    assert samples(registry, "appliance_quota_store_up")[()] == 1
    assert client.get("/health/serving").json()["quota_store"]["reachable"] is True
    assert samples(registry, "appliance_quota_store_unchecked_requests_total")[(("direction", failure),)] == 1


def test_a_request_admitted_unchecked_is_charged_once_the_store_answers(make_client, own_redis):
    """failure: open lets a request through while the store does not answer; what it used is written to the
    store when it answers again: the tenant's buckets hold what the gateway charged it, nothing forgiven."""
    store = {"kind": "redis", "url": own_redis.url, "key_prefix": prefix(), "failure": "open",
             "probe_seconds": 0.05, "timeout_seconds": 0.2}
    who = {**TENANT, "tokens_per_minute": 10_000, "requests_per_minute": 100}
    client = make_client(tenants=[who], quota_store=store)
    shared_store = context_of(client.app).gateway.quota_store
    assert shared_store is not None
    shared_store.clock = FakeClock(1000.0)  # no refill: the levels say what was charged
    assert client.post("/v1/completions", json=BODY, headers=KEY).status_code == 200

    def reachable() -> bool:
        return client.get("/health/serving").json()["quota_store"]["reachable"]
    own_redis.pause()
    try:
        assert wait_until(lambda: not reachable(), 5), "the PING never found the store gone"  # a reserve is not sent
        assert client.post("/v1/completions", json=BODY, headers=KEY).status_code == 200  # unchecked
        assert samples(context_of(client.app).registry, "appliance_quota_store_unchecked_requests_total")[
            (("direction", "open"),)] == 1
    finally:
        own_redis.resume()
    assert wait_until(reachable, 5), "the store never showed as back"
    time.sleep(0.1)  # what was owed is written by a task of its own

    async def levels() -> dict[str, float]:
        return await shared(own_redis.url, FakeClock(1000.0), store["key_prefix"]).levels(Tenant(**{
            "name": "team-a", "tokens_per_minute": 10_000, "requests_per_minute": 100}))
    now = asyncio.run(levels())
    assert now[REQUESTS] == 100 - 2
    assert now[TOKENS] == 10_000 - accepted_tokens(client) > 10_000 - 2 * 8 - 2 * 100, now


def test_the_store_state_stays_true_without_requests(make_client, own_redis):
    """The gateway's periodic PING: a store that goes away while no request comes still shows, and comes back."""
    store = {"kind": "redis", "url": own_redis.url, "key_prefix": prefix(), "probe_seconds": 0.05}
    client = make_client(tenants=[{**TENANT, "tokens_per_minute": 10_000}], quota_store=store)
    registry = context_of(client.app).registry

    def state() -> bool:
        return client.get("/health/serving").json()["quota_store"]["reachable"]

    own_redis.kill()
    assert wait_until(lambda: not state(), 5)
    assert samples(registry, "appliance_quota_store_up")[()] == 0
    assert samples(registry, "appliance_quota_store_errors_total")[(("operation", "ping"),)] >= 1
    own_redis.start()
    assert wait_until(state, 5)
    assert samples(registry, "appliance_quota_store_up")[()] == 1


def test_appliance_status_says_where_the_quotas_live_and_whether_the_store_answers():
    from appliance.admin_client import format_quota_store

    assert format_quota_store({"kind": "memory"}) == []
    assert format_quota_store({"kind": "redis", "reachable": True}) == ["quota store: redis, reachable"]
    down = format_quota_store({"kind": "redis", "reachable": False, "failure": "closed", "down_since": 1.7e9})
    assert len(down) == 1 and "UNREACHABLE since 20" in down[0] and "fail closed" in down[0]

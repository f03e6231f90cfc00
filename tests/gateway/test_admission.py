"""Admission control: AIMD limits and the bounded, timed gateway queue."""

import asyncio

import pytest

from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.http.errors import APIError
from tests.doubles import FakeReplica


def test_aimd_grows_under_target_and_cuts_once_per_window():
    limit = AIMDLimit(initial=4, minimum=1, maximum=8, target_seconds=0.5)
    for _ in range(20):
        limit.on_sample(0.1)
    assert limit.limit > 4
    before = limit.value
    limit.on_sample(2.0)
    assert limit.value == pytest.approx(before * 0.9)
    limit.on_sample(2.0)  # same burst: not cut again
    assert limit.value == pytest.approx(before * 0.9)
    for _ in range(200):
        limit.on_sample(0.1)
    assert limit.limit == 8  # never above the ceiling
    for _ in range(2000):
        limit.on_sample(None, failed=True)
    assert limit.limit == 1  # never below the floor


def make(limit: int = 1, max_queue: int = 2, timeout: float = 0.2):
    replicas = [FakeReplica("replica-0", "http://r0")]
    limits = ConcurrencyLimits(lambda: AIMDLimit(limit, 1, limit, target_seconds=1.0))
    router = Router(lambda: replicas, limit_for=limits.limit_of)
    return Admission(router, limits, max_queue=max_queue, queue_timeout_seconds=timeout), replicas


def test_queued_request_gets_the_freed_slot_in_order():
    async def scenario():
        admission, (replica,) = make()
        first = await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.01)
        assert admission.queue_length == 1 and not waiter.done()
        first.release(Outcome.SUCCESS, 0.1)
        assert (await waiter).replica is replica
        assert admission.router.in_flight(replica.name) == 1

    asyncio.run(scenario())


def test_full_queue_and_queue_timeout_are_429_with_retry_after():
    async def scenario():
        admission, (replica,) = make(max_queue=1, timeout=0.1)
        held = await admission.acquire()
        waiting = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:
            await admission.acquire()
        assert full.value.status == 429 and full.value.headers["Retry-After"]
        with pytest.raises(APIError) as timed_out:
            await waiting
        assert timed_out.value.status == 429
        assert admission.rejected == {"queue_full": 1, "queue_timeout": 1}
        assert admission.router.in_flight(replica.name) == 1  # nothing leaked
        held.release(Outcome.SUCCESS)
        assert admission.router.in_flight(replica.name) == 0

    asyncio.run(scenario())


def test_no_ready_replica_is_503_not_a_queue():
    async def scenario():
        admission, (replica,) = make()
        replica.routable = False
        with pytest.raises(APIError) as exc:
            await admission.acquire()
        assert exc.value.status == 503

    asyncio.run(scenario())


def test_cancelled_waiter_gives_back_its_slot():
    async def scenario():
        admission, (replica,) = make()
        first = await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        first.release(Outcome.SUCCESS)
        assert admission.router.in_flight(replica.name) == 0

    asyncio.run(scenario())


def test_requests_wait_for_a_replica_in_planned_restart():
    async def scenario():
        admission, (replica,) = make(timeout=2)
        replica.routable = False
        replica.status.planned_restart = True  # the only replica is being restarted by maintenance
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        replica.routable = True
        replica.status.planned_restart = False
        admission.dispatch()  # what the engine-load poller does every interval
        assert (await waiter).replica is replica

    asyncio.run(scenario())


def test_queued_retry_never_gets_the_replica_it_is_leaving():
    """A retry excludes the replica that just failed, in the queue too: freed capacity there goes to others."""
    async def scenario():
        replicas = [FakeReplica("replica-0", "http://r0"), FakeReplica("replica-1", "http://r1")]
        limits = ConcurrencyLimits(lambda: AIMDLimit(1, 1, 1, target_seconds=1.0))
        admission = Admission(Router(lambda: replicas, limit_for=limits.limit_of), limits, max_queue=4,
                              queue_timeout_seconds=2)
        first, second = await admission.acquire(), await admission.acquire()
        retry = asyncio.create_task(admission.acquire(frozenset({"replica-0"})))
        await asyncio.sleep(0.01)
        first.release(Outcome.FAILURE)  # replica-0 frees up: not for the retry that left it
        await asyncio.sleep(0.01)
        assert not retry.done()
        second.release(Outcome.SUCCESS, 0.1)
        assert (await retry).replica.name == "replica-1"

    asyncio.run(scenario())

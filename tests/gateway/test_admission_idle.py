"""Background work (batch lines) on idle capacity only: admission's ``idle_room`` and ``acquire_idle`` give it a
slot only while no request waits in the queue and below each replica's limit less the headroom kept for
interactive requests, never queue it, and tell the batch runner (``on_wait``) the moment a request has to wait."""

import asyncio

import pytest

from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.directory import Tenant
from appliance.http.errors import APIError
from tests.doubles import FakeReplica


def make(limit: int = 4, headroom: float = 0.25, replicas: int = 2):
    fleet = [FakeReplica(f"replica-{i}", f"http://r{i}") for i in range(replicas)]
    limits = ConcurrencyLimits(lambda: AIMDLimit(limit, 1, limit, target_seconds=1.0))
    router = Router(lambda: fleet, limit_for=limits.limit_of)
    return Admission(router, limits, max_queue=8, queue_timeout_seconds=1.0, idle_headroom=headroom), fleet


def test_idle_room_is_the_room_below_each_limit_less_the_headroom():
    admission, fleet = make(limit=4, headroom=0.25)  # each replica: background work while fewer than 3 in flight
    assert admission.idle_room() == 6
    held = [admission.acquire_idle(frozenset(), None) for _ in range(6)]
    assert sorted(admission.router.in_flight(r.name) for r in fleet) == [3, 3]
    assert admission.idle_room() == 0
    with pytest.raises(APIError) as refused:
        admission.acquire_idle(frozenset(), None)
    assert (refused.value.status, refused.value.code) == (429, "no_idle_capacity")
    interactive = admission.try_lease(frozenset(), None)
    assert interactive is not None  # the headroom is still there for interactive work
    next(lease for lease in held if lease.replica is interactive.replica).release(Outcome.SUCCESS)
    assert admission.idle_room() == 0  # the interactive request holds that replica's headroom now
    interactive.release(Outcome.SUCCESS)
    assert admission.idle_room() == 1
    for replica in fleet:
        replica.routable = False
    assert admission.idle_room() == 0  # no replica to send to
    for lease in held:
        lease.release(Outcome.SUCCESS)  # once each: a lease given back already stays so


def test_a_lone_slot_is_idle_capacity_too():
    admission, _ = make(limit=1, headroom=0.25, replicas=1)  # ceil(1 x 0.75): the slot, while nobody uses it
    assert admission.idle_room() == 1
    lease = admission.acquire_idle(frozenset(), None)
    assert admission.idle_room() == 0
    lease.release(Outcome.SUCCESS)


def test_nothing_is_idle_while_a_request_waits_and_the_runner_hears_of_it_at_once():
    async def scenario():
        admission, _ = make(limit=1, headroom=0.0, replicas=1)
        waits = []
        admission.on_wait = lambda: waits.append(admission.queue_length)
        background = admission.acquire_idle(frozenset(), None)
        queued = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0)
        assert waits == [1] and admission.idle_room() == 0  # told while the request is queued
        with pytest.raises(APIError):
            admission.acquire_idle(frozenset(), None)  # never ahead of a waiter, never queued itself
        background.release(Outcome.ABORTED)  # the runner gives its line back
        lease = await asyncio.wait_for(queued, 1)
        assert lease.replica.name == "replica-0" and waits == [1]
        lease.release(Outcome.SUCCESS)
        assert admission.idle_room() == 1

    asyncio.run(scenario())


def test_a_request_served_at_once_does_not_preempt():
    async def scenario():
        admission, _ = make(limit=2, headroom=0.0, replicas=1)
        admission.on_wait = lambda: pytest.fail("nothing waited")
        background = admission.acquire_idle(frozenset(), None)
        (await admission.acquire()).release(Outcome.SUCCESS)
        background.release(Outcome.SUCCESS)

    asyncio.run(scenario())


def test_background_work_honours_exclusions_and_revoked_tenants():
    admission, fleet = make(limit=2, headroom=0.0)
    lease = admission.acquire_idle(frozenset({"replica-0"}), None, tenant=Tenant("team-a"))
    assert lease.replica.name == "replica-1" and admission.tenant_in_flight("team-a") == 1
    admission.revoke(["team-a"])
    with pytest.raises(APIError) as refused:
        admission.acquire_idle(frozenset(), None, tenant=Tenant("team-a"))
    assert refused.value.status == 401
    lease.release(Outcome.SUCCESS)


def test_a_seeded_storm_of_background_and_interactive_work_leaves_every_slot_back():
    """Background and interactive acquires, releases and clients that leave the queue, interleaved at random. After
    each step: no replica over its limit, no background slot granted while a request waited, every slot held by a
    live lease; after each case every slot is back and nothing is queued."""
    import random

    async def case(rng: random.Random) -> None:
        admission, fleet = make(limit=rng.randint(1, 4), headroom=rng.choice((0.0, 0.25, 0.5)),
                                replicas=rng.randint(1, 3))
        held, queued = [], []
        for _ in range(60):
            step = rng.random()
            if step < 0.3:
                waiting = admission.queue_length
                try:
                    lease = admission.acquire_idle(frozenset(), None)
                except APIError:
                    pass
                else:
                    assert waiting == 0, "background work went ahead of a waiter"
                    held.append(lease)
            elif step < 0.55:
                queued.append(asyncio.ensure_future(admission.acquire()))
            elif step < 0.8 and held:
                held.pop(rng.randrange(len(held))).release(rng.choice((Outcome.SUCCESS, Outcome.ABORTED)))
            elif queued:
                leaving = queued[rng.randrange(len(queued))]
                if not leaving.done():  # a client that left the queue (one already served keeps its lease)
                    leaving.cancel()
            for _ in range(3):  # a granted request's task resumes an iteration after its slot is taken
                await asyncio.sleep(0)
            for future in [f for f in queued if f.done()]:
                queued.remove(future)
                if not future.cancelled() and future.exception() is None:
                    held.append(future.result())
            for replica in fleet:
                assert admission.router.in_flight(replica.name) <= admission.limit_of(replica.name) + len(held)
            assert admission.router.in_flight() == len(held), (admission.router.in_flight(), len(held))
        for future in queued:
            future.cancel()
        await asyncio.sleep(0)
        for future in queued:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release(Outcome.SUCCESS)
        for lease in held:
            lease.release(Outcome.SUCCESS)
        assert admission.router.in_flight() == 0 and admission.queue_length == 0 and not admission.ledger.held

    rng = random.Random(20261205)
    for _ in range(150):
        asyncio.run(case(rng))

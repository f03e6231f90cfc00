"""A replica's event index kept in step over a real ZeroMQ subscription, against vLLM's own publisher on loopback
(tests/gateway/kv_engine.py): stores, removals and clears; lost batches replayed; an engine that restarts; a
replay that cannot fill the gap; a dropped connection. The index is trusted only when in step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, ZmqEventPublisher

from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.subscriber import EventEndpoints, Subscription
from tests.doubles import FakeClock
from tests.gateway.kv_engine import Engine, free_port, removed, stored, until

Scenario = Callable[[Engine, Subscription], Awaitable[None]]


def run(scenario: Scenario, *, replay: bool = True, replay_timeout: float = 1.0, resync: float = 30.0,
        clock: Callable[[], float] = time.monotonic) -> None:
    """``scenario`` against a subscription to a fresh engine; ``replay=False``: nothing answers replays."""
    engine = Engine(replay=replay)

    async def main() -> None:
        context = zmq.asyncio.Context()
        events, replay_at = engine.endpoints
        subscription = Subscription("replica-0", EventEndpoints(events, replay_at or f"tcp://127.0.0.1:{free_port()}"),
                                    ReplicaIndex(100_000), context, replay_timeout_seconds=replay_timeout,
                                    resync_seconds=resync, clock=clock)
        subscription.start()
        try:
            await until(lambda: subscription.connected and subscription.syncs > 0 and not subscription.syncing,
                        what="the first sync")
            await scenario(engine, subscription)
        finally:
            await subscription.stop()
            context.term()

    try:
        asyncio.run(main())
    finally:
        engine.close()


async def in_step(engine: Engine, subscription: Subscription) -> None:
    """Every batch published is applied, and the index is the engine's cache."""
    await until(lambda: subscription.expected == engine.published, what=f"batch {engine.published - 1} applied")
    assert subscription.index.snapshot() == dict(engine.cache)


def trusted(subscription: Subscription) -> bool:
    return subscription.index.usable(time.monotonic())


def test_stores_removals_and_clears_reach_the_index_in_order():
    async def scenario(engine: Engine, subscription: Subscription) -> None:
        assert trusted(subscription)  # an engine that published nothing: an empty cache, known exactly
        engine.publish(stored(1, 2, 3))
        engine.publish(stored(4, parent=3), removed(2))
        await in_step(engine, subscription)
        assert subscription.index.matched([k for k in sorted(engine.cache)]) >= 1
        engine.publish(AllBlocksCleared())
        await in_step(engine, subscription)
        assert len(subscription.index) == 0 and subscription.index.resets["all_blocks_cleared"] == 1
        assert trusted(subscription)

    run(scenario)


def test_batches_lost_on_the_way_are_replayed():
    async def scenario(engine: Engine, subscription: Subscription) -> None:
        engine.publish(stored(1, 2))
        await in_step(engine, subscription)
        engine.drop(2)
        engine.publish(stored(3, parent=2))  # lost
        engine.publish(removed(1))  # lost: without it, the index would hold a block the engine evicted
        engine.publish(stored(5))  # arrives: the gap shows
        syncs = subscription.syncs
        await in_step(engine, subscription)
        assert trusted(subscription)
        assert subscription.syncs == syncs + 1 and subscription.index.lost_batches == 0  # replayed, all of them
        assert 1 not in subscription.index

    run(scenario)


def test_a_gap_no_replay_can_fill_empties_the_index_and_falls_back_for_the_resync_period():
    clock = FakeClock()

    async def scenario(engine: Engine, subscription: Subscription) -> None:
        assert not subscription.index.usable(clock())  # no replay: the engine's history is unknown
        engine.publish(stored(1, 2))
        await in_step(engine, subscription)
        assert subscription.index.usable(clock())  # ...until its first batch: that is all of it
        engine.drop(1)
        engine.publish(removed(1))  # lost, and no replay socket answers
        engine.publish(stored(7))  # shows the gap
        await until(lambda: subscription.index.lost_batches >= 2, what="the loss")
        assert not subscription.index.usable(clock())  # never routed on while it may be stale
        assert len(subscription.index) == 0 and subscription.index.resets["replay_failed"] == 2
        engine.publish(stored(8))
        await until(lambda: len(subscription.index) == 1, what="the next batch, adopted")
        assert not subscription.index.usable(clock())
        clock.now += 30
        assert subscription.index.usable(clock())  # a subset of the engine's cache from here: misses, never lies
        assert set(subscription.index.snapshot()) <= set(engine.cache)

    run(scenario, replay=False, replay_timeout=0.3, resync=30.0, clock=clock)


def test_an_engine_that_restarts_numbers_anew_and_its_index_starts_empty():
    async def scenario(engine: Engine, subscription: Subscription) -> None:
        engine.publish(stored(1, 2, 3))
        engine.publish(stored(4, parent=3))
        await in_step(engine, subscription)
        engine.restart()  # same ports, batches from 0 again, an empty cache
        await until(lambda: subscription.connected, what="the reconnection")
        engine.publish(stored(9))
        await in_step(engine, subscription)
        assert subscription.index.snapshot() == dict(engine.cache)  # nothing of the old engine's blocks
        assert subscription.index.resets["publisher_restart"] == 1
        assert trusted(subscription)

    run(scenario)


def test_a_restart_the_router_sees_empties_the_index_at_once():
    async def scenario(engine: Engine, subscription: Subscription) -> None:
        engine.publish(stored(1, 2, 3))
        await in_step(engine, subscription)
        subscription.restarted()
        assert len(subscription.index) == 0 and not trusted(subscription)
        engine.restart()
        engine.publish(stored(5))
        await in_step(engine, subscription)
        assert trusted(subscription)

    run(scenario)


def test_a_dropped_connection_is_unknown_until_it_is_back_in_step():
    async def scenario(engine: Engine, subscription: Subscription) -> None:
        engine.publish(stored(1, 2))
        await in_step(engine, subscription)
        port = engine.events_port
        engine.publisher.shutdown()  # the engine goes away (its cache too, as far as anyone can know)
        await until(lambda: not subscription.connected, what="the disconnection")
        assert not trusted(subscription)
        engine.cache.clear()
        engine.publisher = ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{port}",
                                             replay_endpoint=f"tcp://127.0.0.1:{engine.replay_port}")
        engine.published = 0
        await until(lambda: trusted(subscription), what="trusted again")
        assert len(subscription.index) == 0

    run(scenario)


def test_a_replay_that_no_longer_holds_the_first_batches_is_a_subset():
    """A gateway that starts after the engine's replay buffer rotated: the index misses what the lost batches
    stored, so it is trusted only after the resync period."""
    clock = FakeClock()
    engine = Engine(buffer_steps=2)

    async def main() -> None:
        for n in range(5):
            engine.publish(stored(100 + n))
        await asyncio.sleep(0.3)  # the publisher's thread has sent them (to nobody)
        context = zmq.asyncio.Context()
        events, replay = engine.endpoints
        subscription = Subscription("replica-0", EventEndpoints(events, replay), ReplicaIndex(1000), context,
                                    replay_timeout_seconds=1.0, resync_seconds=30.0, clock=clock)
        subscription.start()
        try:
            await until(lambda: subscription.expected == engine.published, what="the replay")
            assert subscription.index.lost_batches == 3  # batches 0..2 are gone from the buffer (it keeps 2)
            assert not subscription.index.usable(clock())
            clock.now += 30
            assert subscription.index.usable(clock())
            assert set(subscription.index.snapshot()) < set(engine.cache)
        finally:
            await subscription.stop()
            context.term()

    try:
        asyncio.run(main())
    finally:
        engine.close()

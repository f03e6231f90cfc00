"""A seeded storm of KV-cache events, lost batches and engine restarts: after every step the replica's index is
exactly the engine's cache (every block, every copy) and is routed on.

Each step draws a scheduler step's events, as vLLM sends them (tests/gateway/kv_engine.py: vLLM's own publisher
and event classes, on a real ZeroMQ socket): new prompts stored from the root, prompts extended from a block the
engine holds, the same blocks computed again (copies), hits reported from the root (``kv_cache_report_mode``
full), evictions of one copy, the whole cache cleared. Between steps the draw may lose batches on the way (the
replay brings them back), restart the engine (numbered from 0 again, an empty cache), with or without the router
having seen the restart. A set instead of copies, a removal applied before the store it follows, a replay applied
twice or a restart that leaves old blocks all break the equality.
"""

from __future__ import annotations

import asyncio
import random
import time

import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared

from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.subscriber import EventEndpoints, Subscription
from appliance.gateway.routing.kv_events.wire import block_key
from tests.gateway.kv_engine import Engine, digest, removed, stored, until

SEED = 20260611
STEPS = 300


class Blocks:
    """Block numbers the storm draws from: ``digest(n)`` is block n's hash."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next = 0
        self.by_key: dict[int, int] = {}

    def fresh(self, count: int) -> list[int]:
        numbers = list(range(self.next, self.next + count))
        self.next += count
        for n in numbers:
            self.by_key[block_key(digest(n))] = n
        return numbers

    def held(self, engine: Engine, count: int) -> list[int]:
        keys = list(engine.cache)
        return [self.by_key[k] for k in self.rng.sample(keys, min(count, len(keys)))]


def draw_event(rng: random.Random, blocks: Blocks, engine: Engine) -> object:
    roll = rng.random()
    held = blocks.held(engine, 3)
    if roll < 0.30 or not held:
        return stored(*blocks.fresh(rng.randint(1, 6)))
    if roll < 0.50:
        return stored(*blocks.fresh(rng.randint(1, 4)), parent=held[0])
    if roll < 0.60:
        return stored(*held[1:] or held, parent=held[0])  # computed again: another copy of each
    if roll < 0.68:
        return stored(*held, *blocks.fresh(rng.randint(0, 2)))  # a report of hits, from the root
    if roll < 0.98:
        return removed(*held[: rng.randint(1, len(held))])
    return AllBlocksCleared()


def test_the_index_is_the_engines_cache_after_every_step():
    rng = random.Random(SEED)
    engine = Engine()
    blocks = Blocks(rng)
    counts = {"restarts": 0, "seen": 0, "dropped": 0, "batches": 0}

    async def storm() -> None:
        context = zmq.asyncio.Context()
        subscription = Subscription("replica-0", EventEndpoints(*engine.endpoints), ReplicaIndex(1_000_000),
                                    context, replay_timeout_seconds=2.0, resync_seconds=3600.0)
        subscription.start()
        try:
            await until(lambda: subscription.index.usable(time.monotonic()), what="the first sync")
            for step in range(STEPS):
                roll = rng.random()
                if roll < 0.03:
                    engine.restart()
                    counts["restarts"] += 1
                    if rng.random() < 0.5:  # the router saw the replica restart (supervised replicas)
                        subscription.restarted()
                        counts["seen"] += 1
                elif roll < 0.10:
                    lost = rng.randint(1, 3)
                    engine.drop(lost)
                    for _ in range(lost):
                        engine.publish(draw_event(rng, blocks, engine))
                    counts["dropped"] += lost
                for _ in range(rng.randint(1, 3)):
                    engine.publish(*(draw_event(rng, blocks, engine) for _ in range(rng.randint(1, 3))))
                    counts["batches"] += 1
                await until(lambda: subscription.expected == engine.published, what=f"step {step} applied")
                assert subscription.index.snapshot() == dict(engine.cache), f"step {step}"
                await until(lambda: subscription.index.usable(time.monotonic()), timeout=5, what=f"step {step} trusted")
            assert subscription.index.lost_batches == 0  # every loss was replayed
        finally:
            await subscription.stop()
            context.term()

    try:
        asyncio.run(storm())
    finally:
        engine.close()
    print(f"storm: {STEPS} steps, {counts}")
    assert counts["restarts"] >= 3 and counts["seen"] >= 1 and counts["dropped"] >= 10  # the draw covered them

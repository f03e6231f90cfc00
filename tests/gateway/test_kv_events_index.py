"""One replica's event index alone: what each event does to it, and its bound."""

from __future__ import annotations

import tracemalloc

from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, block_key


def h(n: int) -> bytes:
    """A 32-byte block hash whose index key is ``n``."""
    return bytes(24) + n.to_bytes(8, "big")


def stored(*keys: int, parent: int | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(block_hashes=[h(k) for k in keys], parent_block_hash=None if parent is None else h(parent),
                       token_ids=list(range(16 * len(keys))), block_size=16, medium=medium)


def removed(*keys: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h(k) for k in keys], medium="GPU")


def test_a_key_is_the_low_64_bits_of_the_hash_as_vllm_turns_bytes_into_ints():
    digest = bytes(range(32))
    assert block_key(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert block_key(int.from_bytes(digest, "big") & ((1 << 64) - 1)) == block_key(digest)


def test_stores_removes_and_clears():
    index = ReplicaIndex(1000)
    index.apply(stored(1, 2, 3))
    index.apply(stored(4, parent=3))
    assert index.matched([block_key(h(k)) for k in (1, 2, 3, 4, 5)]) == 4
    assert index.block_size == 16
    index.apply(removed(2))
    assert index.matched([1, 2, 3, 4]) == 1  # a prefix stops at the first block the engine evicted
    index.apply(AllBlocksCleared())
    assert len(index) == 0 and index.resets["all_blocks_cleared"] == 1


def test_copies_are_counted_so_evicting_one_keeps_the_block():
    """vLLM does not deduplicate: a block computed twice (here: extended from a parent) is held twice, and one
    BlockRemoved leaves the other copy serving hits."""
    index = ReplicaIndex(1000)
    index.apply(stored(1, 2))
    index.apply(stored(2, parent=1))  # the same block again, in another block of the engine's
    assert index.copies(2) == 2
    index.apply(removed(2))
    assert 2 in index
    index.apply(removed(2))
    assert 2 not in index
    index.apply(removed(2))  # a removal of what the index does not hold changes nothing
    assert index.copies(2) == 0


def test_a_report_of_blocks_already_held_adds_no_copy():
    """kv_cache_report_mode full: vLLM reports a request's prefix-cache hits as a BlockStored from the root. Counted
    as new copies they would outlive their eviction."""
    index = ReplicaIndex(1000)
    index.apply(stored(1, 2))
    index.apply(stored(1, 2, 3))  # a report of 1 and 2 (held), and 3, which the index did not know
    assert [index.copies(k) for k in (1, 2, 3)] == [1, 1, 1]
    index.apply(removed(1, 2))
    assert 1 not in index and 2 not in index


def test_offloading_tiers_are_not_the_engines_cache():
    index = ReplicaIndex(1000)
    index.apply_batch(Batch(ts=1.0, events=[stored(1, medium="CPU"), stored(2)]), now=5.0, wall_now=3.0)
    assert 1 not in index and 2 in index
    assert (index.received, index.applied, index.last_applied_at, index.last_lag_seconds) == (2, 1, 5.0, 2.0)


def test_the_bound_drops_the_oldest_entries():
    index = ReplicaIndex(3)
    index.apply(stored(1, 2, 3, 4, 5))
    assert len(index) == 3 and index.evicted == 2
    assert index.matched([3, 4, 5]) == 3 and 1 not in index  # it misses what it dropped, claims nothing else


def test_trust_is_a_time():
    index = ReplicaIndex(1000)
    assert not index.usable(10.0)  # never in step yet
    index.trusted_from = 12.0
    assert not index.usable(11.9) and index.usable(12.0)


def test_memory_per_block_is_about_a_hundred_bytes():
    """The figure docs/configuration.md gives for routing.prefix_cache.index_max_blocks."""
    index = ReplicaIndex(1 << 30)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(0, 200_000, 1000):
        keys = [k * 0x9E3779B97F4A7C15 % (1 << 64) for k in range(start, start + 1000)]  # 64 bits, as real ones
        index.apply(BlockStored(block_hashes=[h(k) for k in keys], parent_block_hash=None, token_ids=[],
                                block_size=16, medium="GPU"))
    per_block = (tracemalloc.get_traced_memory()[0] - before) / len(index)
    tracemalloc.stop()
    print(f"index memory: {per_block:.0f} bytes per block")
    assert 40 < per_block < 160

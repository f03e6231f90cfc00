"""The prefix index: chained block hashes, matching, LRU eviction within each replica's capacity and the byte
budget, forgetting a replica."""

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.gateway.routing.prefix_index import ENTRY_BYTES, PrefixIndex, block_hashes


def test_a_block_hash_covers_everything_before_it():
    a = block_hashes("x" * 8 + "same-block", 8)
    b = block_hashes("y" * 8 + "same-block", 8)
    assert len(a) == 2 and a[1] != b[1]  # same text in block 2, different history
    assert block_hashes("abcdefgh" * 3, 8)[:2] == block_hashes("abcdefgh" * 2 + "zzz", 8)
    assert block_hashes("short", 8) == []  # only full blocks are hashed


def test_matched_blocks_is_the_shared_leading_run():
    index = PrefixIndex(2**20)
    sent = block_hashes("".join(chr(65 + i) * 4 for i in range(10)), 4)
    index.record("r0", sent)
    assert index.matched_blocks("r0", sent) == 10
    assert index.matched_blocks("r0", sent[:4] + [12345] + sent[5:]) == 4  # stops at the first miss
    assert index.matched_blocks("r1", sent) == 0


def test_budget_bounds_entries_and_evicts_least_recent_tails_first():
    index = PrefixIndex(ENTRY_BYTES * 10)
    old, new = list(range(1, 7)), list(range(100, 106))
    index.record("r0", old)
    index.record("r0", new)
    assert len(index) == 10 and index.bytes == 10 * ENTRY_BYTES
    assert index.evictions == 2
    assert index.matched_blocks("r0", new) == 6
    assert index.matched_blocks("r0", old) == 4  # the old prompt lost its tail, never its head


def test_recording_again_refreshes_a_prefix():
    index = PrefixIndex(ENTRY_BYTES * 6)
    index.record("r0", [1, 2, 3])
    index.record("r0", [7, 8, 9])
    index.record("r0", [1, 2, 3])  # used again: now the most recent
    index.record("r0", [4, 5, 6])
    assert index.matched_blocks("r0", [1, 2, 3]) == 3
    assert index.matched_blocks("r0", [7, 8, 9]) == 0


def test_forget_drops_a_replica_and_a_new_life_starts_empty():
    index = PrefixIndex(2**20)
    index.record("r0", [1, 2])
    index.record("r1", [1, 2])
    index.forget("r0")
    assert index.matched_blocks("r0", [1, 2]) == 0
    assert index.matched_blocks("r1", [1, 2]) == 2
    index.record("r0", [3])
    assert index.matched_blocks("r0", [1, 2]) == 0 and index.matched_blocks("r0", [3]) == 1


def test_entry_bytes_accounts_for_what_an_entry_really_costs():
    index = PrefixIndex(2**40)
    rng = random.Random(1)
    blocks = [[rng.getrandbits(44) for _ in range(1000)] for _ in range(200)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for prompt in blocks:
            index.record("r0", prompt)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 200_000
    assert used / len(index) <= ENTRY_BYTES


# -- each replica's capacity (its engine's KV cache) ------------------------------------------------------------

def test_a_replica_holds_no_more_blocks_than_its_capacity_least_recent_out_first():
    index = PrefixIndex(2**20)
    index.set_capacity("r0", 5)
    index.record("r0", [1, 2, 3])
    index.record("r0", [10, 11, 12])
    assert index.held("r0") == 5 and index.evictions == 1
    assert index.matched_blocks("r0", [10, 11, 12]) == 3  # the newest prompt whole
    assert index.matched_blocks("r0", [1, 2, 3]) == 2  # the older one lost its tail, not its head
    index.record("r1", list(range(100, 150)))  # another replica's capacity is its own: unknown, budget only
    assert index.held("r1") == 50 and index.held("r0") == 5


def test_recording_a_prefix_again_makes_it_the_last_the_replica_evicts():
    index = PrefixIndex(2**20)
    index.set_capacity("r0", 6)
    index.record("r0", [1, 2, 3])
    index.record("r0", [7, 8, 9])
    index.record("r0", [1, 2, 3])  # used again (vLLM: a cache hit refreshes the blocks)
    index.record("r0", [4, 5, 6])
    assert index.matched_blocks("r0", [1, 2, 3]) == 3
    assert index.matched_blocks("r0", [7, 8, 9]) == 0


def test_a_smaller_capacity_evicts_at_once_and_unknown_lifts_the_bound():
    index = PrefixIndex(2**20)
    index.record("r0", list(range(1, 21)))
    index.set_capacity("r0", 8)
    assert index.held("r0") == 8 and index.matched_blocks("r0", list(range(1, 21))) == 8
    index.set_capacity("r0", None)
    index.record("r0", list(range(1, 21)))
    assert index.held("r0") == 20 and index.capacity_of("r0") is None


def test_the_memory_budget_still_bounds_all_replicas_taking_from_the_largest():
    index = PrefixIndex(ENTRY_BYTES * 10)
    index.set_capacity("r0", 100)  # capacities above the budget: the budget binds
    index.record("r0", list(range(1, 9)))
    index.record("r1", [101, 102, 103, 104])
    assert len(index) == 10 and index.bytes == 10 * ENTRY_BYTES
    assert (index.held("r0"), index.held("r1")) == (6, 4)  # the largest gave up its least recent blocks
    assert index.matched_blocks("r0", list(range(1, 9))) == 6
    index.record("r1", [105, 106, 107, 108])
    assert (index.held("r0"), index.held("r1")) == (5, 5)  # shared evenly once both are full


def test_forgetting_a_replica_frees_its_blocks_and_its_capacity():
    index = PrefixIndex(2**20)
    index.set_capacity("r0", 4)
    index.record("r0", [1, 2, 3, 4])
    index.forget("r0")
    assert len(index) == 0 and index.capacity_of("r0") is None  # a new engine may be sized differently
    index.record("r0", list(range(10, 20)))
    assert index.held("r0") == 10


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("route"), st.integers(0, 3), st.integers(0, 30), st.integers(1, 40)),
    st.tuples(st.just("capacity"), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 60))),
    st.tuples(st.just("forget"), st.integers(0, 3)),
), max_size=120), st.integers(4, 120))
def test_no_replica_exceeds_its_capacity_and_the_total_never_exceeds_the_budget(steps, budget):
    """A storm of routes (conversations of growing prompts), capacity readings (known, changed, unknown) and
    restarts: after every step each replica holds at most its capacity, all together at most the budget, the
    size accounting matches, and what a replica matches is a leading run (never a tail without its head)."""
    index = PrefixIndex(ENTRY_BYTES * budget)
    conversations = {c: [c * 1000 + b for b in range(40)] for c in range(31)}
    for step in steps:
        kind, replica = step[0], f"r{step[1]}"
        if kind == "route":
            index.record(replica, conversations[step[2]][:step[3]])
        elif kind == "capacity":
            index.set_capacity(replica, step[2])
        else:
            index.forget(replica)
        held = {f"r{i}": index.held(f"r{i}") for i in range(4)}
        assert sum(held.values()) == len(index) <= index.budget
        for name, count in held.items():
            capacity = index.capacity_of(name)
            assert capacity is None or count <= capacity
    for replica in (f"r{i}" for i in range(4)):
        for blocks in conversations.values():
            matched = index.matched_blocks(replica, blocks)
            assert not any(index.matched_blocks(replica, [b]) for b in blocks[matched:])  # heads outlive tails

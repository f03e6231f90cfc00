"""The prefix index: chained block hashes, matching, LRU eviction within the byte budget, forgetting a replica."""

import random
import tracemalloc

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

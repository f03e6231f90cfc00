"""The prefix-routing bench's oracle, without engines: its model of vLLM's prefix cache counts hits as vLLM does
(full blocks only, never the prompt's last token), evicts as vLLM's free queue does (partly filled blocks first,
then the least recently freed, a request's last block before its first), and routes to the longest cached prefix
within the router's balance bound.
"""

from pathlib import Path

import pytest

from tests.test_bench import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "prefix_routing.py"


@pytest.fixture
def bench(monkeypatch):
    return load_bench(BENCH, monkeypatch)


def test_hits_are_full_blocks_short_of_the_prompts_last_token(bench):
    cache = bench.EngineCache(blocks=9, block_size=4)
    prompt = list(range(14))  # 3 full blocks and 2 tokens
    assert cache.serve(prompt, output_tokens=0) == 0  # new: nothing cached
    assert cache.serve(prompt, output_tokens=0) == 12  # every full block
    assert cache.serve(prompt[:12], output_tokens=0) == 8  # block-aligned: the last block is computed again
    assert cache.serve([99, *prompt[1:]], output_tokens=0) == 0  # chained: a different first block shares nothing


def test_eviction_takes_the_least_recently_freed_block_and_a_requests_tail_first(bench):
    cache = bench.EngineCache(blocks=4, block_size=4)  # 3 usable: vLLM keeps one as its null block
    first, other = list(range(8)), list(range(100, 108))
    cache.serve(first, output_tokens=0)  # 2 blocks, given back tail first: its first block is the newer
    assert cache.unused() == 1
    cache.serve(other, output_tokens=0)  # 2 blocks: the never-used one, then first's tail block
    assert cache.held(bench.block_keys(first, 4)) == 1
    assert cache.serve(first, output_tokens=0) == 4  # its first block survived (at most 1 block: 8 - 1 tokens)


def test_partly_filled_blocks_are_reused_before_any_cached_block(bench):
    cache = bench.EngineCache(blocks=4, block_size=4)
    conversation = list(range(8))
    cache.serve(conversation, output_tokens=0)  # 2 cached blocks
    cache.serve([50, 51], output_tokens=0)  # the last free block, partly filled: back to the head of the queue
    cache.serve([60, 61, 62], output_tokens=0)  # takes that one again, not the conversation's least recent block
    assert cache.serve([*conversation, 9], output_tokens=0) == 8


def test_output_blocks_take_room_but_are_never_hit(bench):
    cache = bench.EngineCache(blocks=4, block_size=4)
    cache.serve(list(range(4)) + [50], output_tokens=4)  # 2 blocks: one of prompt, one of prompt tail and output
    assert cache.unused() == 2  # the output's block holds nothing reusable
    cache.serve(list(range(200, 208)), output_tokens=0)  # takes the never-used block and the output's
    assert cache.serve(list(range(4)) + [51], output_tokens=0) == 4  # the prompt's block is still there


def test_the_oracle_follows_the_cached_prefix_starts_new_prefixes_where_nothing_is_evicted_and_forgets_a_restart(
        bench):
    oracle = bench.Oracle(replicas=2, blocks=64, block_size=4, output_tokens=0)
    a, b = list(range(40)), list(range(1000, 1040))
    first, _ = oracle.route(a, (0, 1))
    second, _ = oracle.route(b, (0, 1))
    assert second != first  # equal (empty) prefixes: the replica with more unused blocks
    assert oracle.route(a + [7, 7], (0, 1)) == (first, 40)
    assert oracle.route(b + [7, 7], (0, 1)) == (second, 40)
    oracle.caches[first].empty()
    assert oracle.route(a + [8, 8], (0, 1)) == (first, 0)  # restarted: held nowhere, and it has the room
    assert oracle.route(b, (first,)) == (first, 0)  # the other replica away: it goes here, a miss


def test_the_oracle_keeps_within_the_routers_balance_bound(bench):
    oracle = bench.Oracle(replicas=2, blocks=256, block_size=4, output_tokens=0)
    shared = list(range(40))
    replicas = [oracle.route(shared + [i], (0, 1))[0] for i in range(20)]
    assert 0 < replicas.count(0) < 20  # affinity alone would send all 20 to one replica
    assert max(replicas.count(0), replicas.count(1)) <= 13  # ceil(1.25 x 20 / 2)


def test_replay_counts_hits_over_queries_per_round_and_the_scored_rounds_together(bench):
    oracle = bench.Oracle(replicas=2, blocks=64, block_size=4, output_tokens=0)
    prompts = {(c, t): [c * 1000 + i for i in range(16)] + [t] * (t + 1) for c in range(3) for t in range(2)}
    rounds = bench.replay(oracle, lambda c, t: prompts[c, t], 3, [bench.Round(0), bench.Round(1)])
    assert [r["hits"] for r in rounds] == [0, 3 * 16]
    assert [r["queries"] for r in rounds] == [3 * 17, 3 * 18]
    assert [sum(r["requests_per_engine"]) for r in rounds] == [3, 3]
    summary = bench.oracle_summary(rounds, scored_from=1)
    assert summary["hit_rate"] == round(48 / 54, 4)
    assert summary["rounds"] == [0.0, round(48 / 54, 4)]

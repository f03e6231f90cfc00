"""Each scorer alone: 0..1 per candidate, None (neutral) when it cannot tell."""

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.contract import ReplicaState
from appliance.engine.load import EngineLoad
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Router
from appliance.gateway.routing.scorers import (
    CacheRoomScorer,
    KvCacheScorer,
    OutstandingScorer,
    PrefixScorer,
    QueueScorer,
)
from appliance.gateway.routing.settings import PrefixScorerSettings, RoutingSettings
from tests.doubles import FakeClock, FakeReplica


def fleet(n: int = 3, **routing):
    replicas = [FakeReplica(f"replica-{i}") for i in range(n)]
    clock = FakeClock()
    return Router(lambda: replicas, RoutingSettings(**routing), clock=clock), replicas, clock


def test_outstanding_is_strictly_decreasing_in_the_gateways_own_count():
    router, replicas, _ = fleet()
    router.outstanding.update({"replica-0": 3, "replica-1": 1})
    scores = OutstandingScorer().scores(replicas, router, None)
    assert scores == [1 - 3 / 5, 1 - 1 / 5, 1.0]
    assert all(0 <= s <= 1 for s in scores)


def test_kv_and_queue_read_fresh_engine_readings():
    router, replicas, clock = fleet()
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.9, waiting=4, read_at=clock.now))
    router.update_load("replica-1", EngineLoad(kv_cache_usage=0.123, waiting=0, read_at=clock.now))
    assert KvCacheScorer().scores(replicas, router, None) == [1 - 0.9, 1 - 0.12, None]  # no reading: unknown
    assert QueueScorer().scores(replicas, router, None) == [1 - 4 / 5, 1.0, None]


def test_stale_readings_are_unknown():
    router, replicas, clock = fleet(metrics_stale_seconds=5)
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.9, waiting=4, read_at=clock.now))
    clock.now += 5.5
    assert KvCacheScorer().scores(replicas[:1], router, None) == [None]
    assert QueueScorer().scores(replicas[:1], router, None) == [None]


def test_a_reading_that_contradicts_the_gateways_in_flight_count_is_unknown():
    """vLLM's CPU build can report 0 running while a request runs: then its KV and queue readings lag
    too, and must not steer routing."""
    router, replicas, clock = fleet(metrics_poll_seconds=1)
    assert router.try_acquire() is replicas[0]  # busy since 1000
    clock.now += 0.5
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.0, waiting=0, running=0, read_at=clock.now))
    assert KvCacheScorer().scores(replicas[:1], router, None) == [1.0]  # within one poll: may just not be seen yet
    clock.now += 2
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.0, waiting=0, running=0, read_at=clock.now))
    assert KvCacheScorer().scores(replicas[:1], router, None) == [None]  # idle for 2.5 s while busy: lagging
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.3, waiting=0, running=1, read_at=clock.now))
    assert KvCacheScorer().scores(replicas[:1], router, None) == [0.7]  # the engine sees its request: trusted


def prompt(conversation: int, turns: int = 1) -> RoutingRequest:
    return RoutingRequest("".join(f"{conversation:04d}: conversation turn {t:03d} " * 4 for t in range(turns)))


def test_prefix_scores_the_matched_share_of_the_prompt():
    router, replicas, _ = fleet()
    scorer = PrefixScorer(PrefixScorerSettings(block_chars=16))
    first = prompt(7, turns=2)
    scorer.chosen(replicas[1], first)
    follow_up = prompt(7, turns=4)
    scores = scorer.scores(replicas, router, follow_up)
    matched = (len(first.prompt) // 16) * 16
    assert scores == [0.0, matched / len(follow_up.prompt), 0.0]
    assert 0.4 < scores[1] <= 0.5
    assert scorer.scores(replicas, router, prompt(8, turns=4)) == [0.0, 0.0, 0.0]  # shares nothing
    assert scorer.scores(replicas, router, None) == [0.0, 0.0, 0.0]


def test_prefix_yields_when_the_replica_is_loaded_beyond_the_bound():
    router, replicas, _ = fleet(n=2)
    scorer = PrefixScorer(PrefixScorerSettings(block_chars=16, load_factor=1.25))
    conversation = prompt(1, turns=3)
    scorer.chosen(replicas[0], conversation)
    router.outstanding.update({"replica-0": 2, "replica-1": 1})  # bound: ceil(1.25 * 4 / 2) = 3; 2 + 1 fits
    assert scorer.scores(replicas, router, conversation)[0] == 1.0 - (len(conversation.prompt) % 16) / len(
        conversation.prompt)
    router.outstanding.update({"replica-0": 3, "replica-1": 0})  # bound 3; 3 + 1 does not fit
    assert scorer.scores(replicas, router, conversation) == [0.0, 0.0]
    assert scorer.yields == 1


def test_prefix_forgets_a_replica_that_restarts_or_loses_its_engine():
    router, replicas, _ = fleet(n=2)
    scorer = PrefixScorer(PrefixScorerSettings(block_chars=16))
    conversation = prompt(1, turns=3)
    scorer.observe(replicas)
    for replica in replicas:
        scorer.chosen(replica, conversation)
    replicas[0].status.starts += 1  # a new process (supervisor restart)
    replicas[1].drain()  # a drain keeps the engine and its cache
    scorer.observe(replicas)
    scores = scorer.scores(replicas, router, conversation)
    assert scores[0] == 0.0 and scores[1] > 0.9
    replicas[1].status.state = ReplicaState.UNHEALTHY  # e.g. an external engine that went away
    scorer.observe(replicas)
    assert scorer.scores(replicas, router, conversation) == [0.0, 0.0]
    assert scorer.forgotten == 2


def test_prefix_capacity_is_the_engines_kv_tokens_in_character_blocks():
    """40 tokens x 4 characters per token / 16 characters per block = 10 blocks: the index holds no more for that
    replica, so a prompt longer than the engine's cache matches only the head the engine can still hold."""
    router, replicas, clock = fleet(n=2, scorers={"prefix": {"block_chars": 16, "chars_per_token": 4}})
    scorer = router.policy.prefix
    router.update_load("replica-0", EngineLoad(kv_capacity_tokens=40, read_at=clock.now))
    router.update_load("replica-1", EngineLoad(kv_cache_usage=0.1, read_at=clock.now))  # capacity not reported
    assert scorer.index.capacity_of("replica-0") == 10 and scorer.index.capacity_of("replica-1") is None
    long = prompt(3, turns=4)  # 4 turns x 4 x 28 = 448 characters: 28 blocks
    scorer.chosen(replicas[0], long)
    scorer.chosen(replicas[1], long)
    assert scorer.index.held("replica-0") == 10 and scorer.index.held("replica-1") == 28
    assert scorer.scores(replicas, router, long) == [10 * 16 / len(long.prompt), 28 * 16 / len(long.prompt)]


def test_prefix_capacity_is_read_again_after_a_restart():
    router, replicas, clock = fleet(n=1, scorers={"prefix": {"block_chars": 16, "chars_per_token": 4}})
    scorer = router.policy.prefix
    router.update_load("replica-0", EngineLoad(kv_capacity_tokens=40, read_at=clock.now))
    scorer.observe(replicas)
    replicas[0].status.starts += 1
    scorer.observe(replicas)
    assert scorer.index.capacity_of("replica-0") is None  # the new engine may be sized differently
    router.update_load("replica-0", EngineLoad(kv_capacity_tokens=80, read_at=clock.now))
    assert scorer.index.capacity_of("replica-0") == 20


def test_cache_room_rates_free_cache_for_a_prompt_every_replica_holds_equally_much_of():
    """A new conversation starts where it evicts nothing; a conversation one replica holds is affinity's to place;
    a replica whose cache size is unknown is neutral."""
    router, replicas, clock = fleet(n=3, scorers={"prefix": {"block_chars": 16, "chars_per_token": 4}})
    prefix = router.policy.prefix
    room = CacheRoomScorer(prefix)
    router.update_load("replica-0", EngineLoad(kv_capacity_tokens=40, read_at=clock.now))  # 10 blocks
    router.update_load("replica-1", EngineLoad(kv_capacity_tokens=40, read_at=clock.now))
    prefix.chosen(replicas[0], prompt(1, turns=4))  # 28 blocks: replica-0's 10 are full
    prefix.chosen(replicas[1], RoutingRequest("x" * 16 * 4))  # replica-1 holds 4 of 10
    new = prompt(2, turns=2)
    assert room.scores(replicas, router, new) == [0.0, 0.6, None]
    assert room.scores(replicas, router, prompt(1, turns=2)) == [None, None, None]  # replica-0 holds its head
    assert room.scores(replicas, router, RoutingRequest("short")) == [None, None, None]  # shorter than a block
    assert room.scores(replicas, router, None) == [None, None, None]
    shared = "S" * 16 * 2  # a system prompt every replica holds: what follows is new everywhere
    for replica in replicas:
        prefix.chosen(replica, RoutingRequest(shared))
    assert room.scores(replicas, router, RoutingRequest(shared + "a new user's question " * 3))[1] < 0.6


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 4)), max_size=40),
       st.lists(st.one_of(st.none(), st.integers(0, 30)), min_size=3, max_size=3),
       st.integers(0, 5), st.integers(1, 4))
def test_cache_room_never_overrides_affinity_and_stays_in_range(history, capacities, conversation, turns):
    """Whatever each replica holds and whatever its capacity: for a prompt one replica holds more of, the
    cache-room scorer has no opinion (affinity decides); otherwise every score it gives is a share in [0, 1], and
    it gives none for a replica whose capacity is unknown."""
    router, replicas, clock = fleet(n=3, scorers={"prefix": {"block_chars": 16, "chars_per_token": 4}})
    prefix = router.policy.prefix
    for replica, blocks in zip(replicas, capacities, strict=True):
        router.update_load(replica.name, EngineLoad(kv_capacity_tokens=None if blocks is None else blocks * 4,
                                                    read_at=clock.now))
    for where, number, length in history:
        prefix.chosen(replicas[where], prompt(number, turns=length))
    request = prompt(conversation, turns=turns)
    scores = CacheRoomScorer(prefix).scores(replicas, router, request)
    matched = {prefix.index.matched_blocks(r.name, request.hashes(16)) for r in replicas}
    if len(matched) > 1:
        assert scores == [None, None, None]
    else:
        for replica, blocks, score in zip(replicas, capacities, scores, strict=True):
            assert (score is None) == (not blocks), (replica.name, blocks, score)
            assert score is None or 0.0 <= score <= 1.0

"""The precise prefix scorer in the router: it routes on what the engines' events say they hold, falls back per
replica when an index is not current (or scores 0 in precise mode), and never reads an index across a restart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from appliance.engine.contract import ReplicaState
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.metrics import KvEventsCollector
from appliance.gateway.routing.kv_events.scorer import PreciseScorer
from appliance.gateway.routing.kv_events.settings import PrefixCacheMode, PrefixCacheSettings
from appliance.gateway.routing.kv_events.tokens import PromptTokens
from appliance.gateway.routing.kv_events.wire import BlockStored
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from tests.doubles import FakeClock, FakeReplica

HASHER = BlockHasher("random")
PROMPT_IDS = list(range(1000, 1100))  # 6 full blocks of 16 tokens, 4 left over
TEXT = "a long shared system prompt, rendered as the router sees it " * 4


class Fleet:
    def __init__(self, mode: PrefixCacheMode = "precise-with-fallback", n: int = 2) -> None:
        self.clock = FakeClock()
        self.replicas = [FakeReplica(f"replica-{i}") for i in range(n)]
        self.hub = KvEventsHub(PrefixCacheSettings(mode=mode), lambda _replica: None, lambda: self.replicas,
                               clock=self.clock)
        self.registry = CollectorRegistry()
        self.router = Router(lambda: self.replicas, RoutingSettings(), clock=self.clock, registry=self.registry,
                             affinity_scorer=lambda s: PreciseScorer(s, self.hub, mode, HASHER))
        scorer = self.router.policy.prefix
        assert isinstance(scorer, PreciseScorer)
        self.scorer = scorer
        self.registry.register(KvEventsCollector(self.hub, scorer, None, clock=self.clock))

    def engine_holds(self, name: str, blocks: int, *, trusted: bool = True, ids: list[int] = PROMPT_IDS
                     ) -> ReplicaIndex:
        """``name``'s engine reports the prompt's (``ids``) first ``blocks`` blocks stored."""
        index = self.hub.indexes.setdefault(name, ReplicaIndex(10_000))
        keys = PromptTokens(ids).keys(HASHER, 16)[:blocks]
        index.apply(BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=16))
        index.trusted_from = self.clock.now if trusted else None
        return index

    def route(self, tokens: bool = True) -> tuple[str, RoutingRequest]:
        request = RoutingRequest(TEXT, tokens=PromptTokens(list(PROMPT_IDS)) if tokens else None)
        replica = self.router.try_acquire(request=request)
        assert replica is not None
        self.router.release(replica, Outcome.SUCCESS)
        return replica.name, request

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def test_a_repeat_goes_where_the_engine_holds_the_prompt():
    fleet = Fleet()
    fleet.engine_holds("replica-0", 0)
    fleet.engine_holds("replica-1", 6)
    name, request = fleet.route()
    assert name == "replica-1"
    assert request.decision is not None and request.decision.decided_by == "prefix"
    assert request.decision.prefix_match == 1.0  # it holds all the prompt's blocks
    assert fleet.scorer.sources["precise"] == 1
    assert fleet.metric("appliance_routing_prefix_source_total", source="precise") == 1.0


def test_the_score_counts_the_blocks_an_earlier_prompt_could_have_left():
    """Of the 6 full blocks before a 100-token prompt's last token, the last is the one a new turn completes: no
    engine holds it yet, so 5 held blocks score 1.0, 3 score 3/5."""
    fleet = Fleet(n=3)
    fleet.engine_holds("replica-0", 3)
    fleet.engine_holds("replica-1", 5)
    fleet.engine_holds("replica-2", 0)
    request = RoutingRequest(TEXT, tokens=PromptTokens(list(PROMPT_IDS)))
    assert fleet.scorer.ratios(fleet.replicas, request) == [0.6, 1.0, 0.0]
    fleet.engine_holds("replica-1", 6)  # all of them (the same prompt again): no more than 1.0
    assert fleet.scorer.ratios(fleet.replicas, request)[1] == 1.0
    one = list(range(3000, 3016))  # a single block: the engine computes its last token, nothing can be a hit
    fleet.engine_holds("replica-0", 1, ids=one)
    assert fleet.scorer.ratios(fleet.replicas, RoutingRequest(TEXT, tokens=PromptTokens(one)))[0] == 0.0


def test_a_conversation_held_whole_outweighs_the_widest_spread_of_requests_in_flight():
    """A conversation's next turn (111 tokens: 6 full blocks, the 6th new) stays where the engine holds the 5 blocks
    its earlier turns left, with all 7 other requests in flight there and none at its peer: the outstanding scorer
    then differs by 7/8, more than the share of the prompt's tokens it holds (80/111), which would send it to
    where it misses."""
    fleet = Fleet()
    ids = list(range(2000, 2111))
    fleet.engine_holds("replica-0", 5, ids=ids)
    fleet.engine_holds("replica-1", 0)
    fleet.router.outstanding.update({"replica-0": 7})
    request = RoutingRequest(TEXT, tokens=PromptTokens(ids))
    replica = fleet.router.try_acquire(request=request)
    assert replica is not None and replica.name == "replica-0"
    assert request.decision is not None and request.decision.decided_by == "prefix"
    assert request.decision.prefix_match == 1.0


def test_the_longest_held_prefix_counts_not_any_held_block():
    fleet = Fleet()
    fleet.engine_holds("replica-0", 3)
    index = fleet.engine_holds("replica-1", 0)
    keys = PromptTokens(PROMPT_IDS).keys(HASHER, 16)
    index.apply(BlockStored(block_hashes=keys[1:], parent_block_hash=keys[0], token_ids=[], block_size=16))
    assert fleet.route()[0] == "replica-0"  # replica-1 lacks the first block: nothing of it can be a hit


def test_an_unknown_replica_falls_back_to_the_approximate_scorer():
    fleet = Fleet()
    fleet.engine_holds("replica-0", 0)
    fleet.engine_holds("replica-1", 6, trusted=False)  # e.g. events were lost: its index is not read
    first, _ = fleet.route()
    assert first == "replica-0"  # neither holds it, as far as anything current says: load and index decide
    fleet.hub.indexes["replica-0"].trusted_from = None
    again, request = fleet.route()
    assert again == first  # the approximate index saw the prompt go there
    assert fleet.scorer.sources["approximate"] == 1
    assert fleet.scorer.fallbacks["unknown_replica"] >= 2


def test_precise_mode_gives_an_unknown_replica_no_affinity():
    fleet = Fleet(mode="precise")
    fleet.engine_holds("replica-0", 0)
    fleet.engine_holds("replica-1", 6, trusted=False)
    name, request = fleet.route()
    assert request.decision is not None
    assert request.decision.scores_by_replica()["replica-1"]["prefix"] == 0.0
    assert fleet.scorer.sources["none"] + fleet.scorer.sources["precise"] == 1


def test_a_request_without_tokens_is_scored_approximately():
    fleet = Fleet()
    fleet.engine_holds("replica-1", 6)
    fleet.route(tokens=False)
    assert fleet.scorer.fallbacks["no_tokens"] == 2
    assert fleet.metric("appliance_routing_precise_fallbacks_total", reason="no_tokens") == 2.0


def test_a_restart_empties_the_replicas_index_before_it_is_scored_again():
    fleet = Fleet()
    fleet.engine_holds("replica-0", 0)
    fleet.engine_holds("replica-1", 6)
    assert fleet.route()[0] == "replica-1"
    fleet.replicas[1].status.restarts += 1  # its engine is another process now
    fleet.replicas[1].status.state = ReplicaState.READY
    name, request = fleet.route()
    assert len(fleet.hub.indexes["replica-1"]) == 0
    assert request.decision is not None and request.decision.scores_by_replica()["replica-1"]["prefix"] == 0.0
    assert fleet.metric("appliance_routing_kv_index_resets_total", replica="replica-1", reason="restart") == 1.0


def test_affinity_still_yields_to_the_load_bound():
    fleet = Fleet(n=3)
    for name in ("replica-0", "replica-2"):
        fleet.engine_holds(name, 0)
    fleet.engine_holds("replica-1", 6)
    fleet.router.outstanding.update({"replica-1": 5})
    request = RoutingRequest(TEXT, tokens=PromptTokens(list(PROMPT_IDS)))
    scores = fleet.scorer.scores(fleet.replicas, fleet.router, request)
    assert scores[1] == 0.0 and fleet.scorer.yields == 1


def test_the_replicas_index_metrics():
    fleet = Fleet()
    index = fleet.engine_holds("replica-1", 6)
    index.received, index.applied, index.lost_batches, index.last_applied_at = 7, 6, 2, fleet.clock.now
    fleet.clock.now += 3
    assert fleet.metric("appliance_routing_kv_index_blocks", replica="replica-1") == 6.0
    assert fleet.metric("appliance_routing_kv_events_received_total", replica="replica-1") == 7.0
    assert fleet.metric("appliance_routing_kv_events_applied_total", replica="replica-1") == 6.0
    assert fleet.metric("appliance_routing_kv_event_batches_lost_total", replica="replica-1") == 2.0
    assert fleet.metric("appliance_routing_kv_index_staleness_seconds", replica="replica-1") == 3.0
    assert fleet.metric("appliance_routing_kv_index_usable", replica="replica-1") == 1.0

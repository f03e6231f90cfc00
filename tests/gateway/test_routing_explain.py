"""The routing decision explains itself: every replica considered, the first filter that removed each one left out,
every scorer's value for the candidates that reached the policy (what the request record shows)."""

from __future__ import annotations

import json

from appliance.engine.load import EngineLoad
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from tests.doubles import FakeReplica

SCORERS = {"outstanding", "kv_cache", "queue", "prefix", "cache_room"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int = 4, limit: int = 1 << 30, **routing):
    replicas = [FakeReplica(f"replica-{i}") for i in range(n)]
    clock = Clock()
    router = Router(lambda: replicas, RoutingSettings(**routing), limit_for=lambda _name: limit, clock=clock)
    return router, replicas, clock


def conversation(number: int, turns: int) -> RoutingRequest:
    system = f"{number:04d} You are assistant number {number}; answer briefly. " * 8
    return RoutingRequest(system + "".join(f"turn {t}: a question and its answer. " for t in range(turns)))


def decide(router: Router, exclude: frozenset[str] | set[str] = frozenset(),
           request: RoutingRequest | None = None) -> dict:
    request = request or RoutingRequest("a prompt")
    assert router.try_acquire(exclude, request=request) is not None
    assert request.decision is not None
    return request.decision.to_json()


def test_each_removed_replica_names_the_first_filter_that_removed_it():
    router, (r0, r1, r2, r3, r4), _ = fleet(n=5, limit=1)
    r0.drain()  # not routable: ready
    router.eject("replica-2", "test")  # 3 of the 4 routable stay: no panic, the ejection holds
    router.outstanding["replica-3"] = 1  # at its limit of 1: under_limit
    explained = decide(router, exclude={"replica-1"})
    assert explained["candidates"] == ["replica-0", "replica-1", "replica-2", "replica-3", "replica-4"]
    assert explained["removed"] == {"replica-0": "ready", "replica-1": "not_excluded", "replica-2": "not_ejected",
                                    "replica-3": "under_limit"}
    assert explained["picked"] == "replica-4" and set(explained["scores"]) == {"replica-4"}


def test_the_first_failing_filter_is_the_one_shown_and_the_pick_is_scored():
    router, (r0, r1, r2, r3), _ = fleet(limit=1)
    r0.drain()
    router.outstanding["replica-3"] = 1
    explained = decide(router, exclude={"replica-0", "replica-3"})  # excluded too, but not ready comes first
    assert explained["removed"] == {"replica-0": "ready", "replica-3": "not_excluded"}
    assert explained["picked"] == "replica-1" and explained["decided_by"] == "index"
    assert set(explained["scores"]) == {"replica-1", "replica-2"}
    assert set(explained["totals"]) == {"replica-1", "replica-2"}


def test_full_replicas_are_under_limit_removals():
    router, (r0, r1), _ = fleet(n=2, limit=1)
    request = RoutingRequest("x")
    assert router.try_acquire(request=request) is r0
    explained = decide(router)
    assert explained["removed"] == {"replica-0": "under_limit"}
    assert explained["picked"] == "replica-1" and explained["decided_by"] == "single"


def test_every_candidate_has_every_scorers_unweighted_value_and_unknown_is_null():
    router, replicas, clock = fleet(n=3)
    router.outstanding["replica-0"] = 2
    router.update_load("replica-1", EngineLoad(kv_cache_usage=0.25, waiting=3, running=1, read_at=clock.now))
    explained = decide(router)
    assert set(explained["scores"]) == {"replica-0", "replica-1", "replica-2"} and explained["removed"] == {}
    for scores in explained["scores"].values():
        assert set(scores) == SCORERS
    assert explained["scores"]["replica-1"]["kv_cache"] == 0.75
    assert explained["scores"]["replica-2"]["kv_cache"] is None  # never read: unknown, neutral in the total
    assert explained["scores"]["replica-0"]["outstanding"] < explained["scores"]["replica-1"]["outstanding"]
    assert explained["picked"] == "replica-1" and explained["decided_by"] == "tie_kv_cache"  # vs replica-2
    assert explained["total"] == explained["totals"]["replica-1"] == max(explained["totals"].values())
    assert json.loads(json.dumps(explained)) == explained  # JSON-ready, null for unknown


def test_the_balance_bound_shows_as_a_removal():
    router, (r0, r1), _ = fleet(n=2)
    explained = []
    for turn in range(2, 5):
        request = conversation(7, turns=turn)
        replica = router.try_acquire(request=request)
        router.release(replica, Outcome.SUCCESS)
        explained.append(request.decision.to_json())
    assert explained[2]["decided_by"] == "balance"
    assert explained[2]["removed"] == {"replica-0": "balance"}
    assert set(explained[2]["scores"]) == {"replica-1"}  # only what reached the scorers


def test_round_robin_explains_candidates_and_removals_without_scores():
    router, (r0, r1, r2, r3), _ = fleet(scorers={"policy": "round_robin"})
    r2.drain()
    explained = decide(router, exclude={"replica-3"})
    assert explained["candidates"] == ["replica-0", "replica-1", "replica-2", "replica-3"]
    assert explained["removed"] == {"replica-2": "ready", "replica-3": "not_excluded"}
    assert explained["scores"] == {} and explained["totals"] == {}
    assert explained["picked"] == "replica-0" and explained["decided_by"] == "round_robin"


def test_no_request_no_explanation_and_no_candidate_no_decision():
    router, replicas, _ = fleet(n=2)
    assert router.try_acquire() is not None  # nothing to explain to: still routes
    for replica in replicas:
        replica.drain()
    request = RoutingRequest("x")
    assert router.try_acquire(request=request) is None and request.decision is None


def test_a_retry_is_explained_anew():
    router, (r0, r1), _ = fleet(n=2)
    request = RoutingRequest("x")
    assert router.try_acquire(request=request) is r0
    first = request.decision
    router.release(r0, Outcome.FAILURE)
    assert router.try_acquire({"replica-0"}, request=request) is r1
    assert request.decision is not first
    assert request.decision.to_json()["removed"] == {"replica-0": "not_excluded"}
    assert first.to_json()["removed"] == {}  # the first attempt's decision is unchanged

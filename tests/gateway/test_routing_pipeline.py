"""The routing pipeline as a whole: filters, weighted scorers, tie-breakers, bounded load, metrics."""

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from appliance.engine.contract import ReplicaState
from appliance.engine.load import EngineLoad
from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from appliance.settings import ConfigError, load_settings
from tests.doubles import FakeClock, FakeReplica


def fleet(n: int = 2, registry: CollectorRegistry | None = None, **routing):
    replicas = [FakeReplica(f"replica-{i}") for i in range(n)]
    clock = FakeClock()
    router = Router(lambda: replicas, RoutingSettings(**routing), clock=clock, registry=registry)
    return router, replicas, clock


def conversation(number: int, turns: int) -> RoutingRequest:
    system = f"{number:04d} You are assistant number {number}; answer briefly. " * 8
    return RoutingRequest(system + "".join(f"turn {t}: a question and its answer. " for t in range(turns)))


def old_rank(router: Router, replica: FakeReplica) -> tuple:
    """The fixed policy the defaults must reproduce (router.py before the scorers)."""
    load = router.engine_load(replica.name) or EngineLoad()
    kv = 0.5 if load.kv_cache_usage is None else load.kv_cache_usage
    waiting = 0.0 if load.waiting is None else load.waiting
    return router.in_flight(replica.name), round(kv, 2), waiting


def test_default_weights_choose_as_the_old_fixed_policy_when_prompts_share_nothing():
    """Exactly the old choices, with every engine's reading fresh or none of them. (One intended difference:
    the old policy took an unknown queue for an empty one; now unknown is neutral, below a known empty queue.)"""
    rng = random.Random(7)
    for trial in range(300):
        router, replicas, clock = fleet(n=4)
        for replica in replicas:
            router.outstanding[replica.name] = rng.choice([0, 1, 1, 2, 5])
            if trial % 3:
                router.update_load(replica.name, EngineLoad(kv_cache_usage=rng.choice([0.1, 0.5, 0.52, 0.9]),
                                                            waiting=rng.choice([0, 2]), running=1,
                                                            read_at=clock.now))
        expected = min(replicas, key=lambda r: old_rank(router, r))
        request = RoutingRequest(f"{trial} unrelated prompt " * 20) if trial % 2 else None
        assert router.try_acquire(request=request) is expected


def test_affinity_beats_a_small_load_difference_and_yields_beyond_the_bound():
    # the in-flight bound alone, at a factor where two requests in flight are enough to show it (default 2.0)
    router, (r0, r1), _ = fleet(scorers={"prefix": {"balance_window": 0, "load_factor": 1.25}})
    first = conversation(1, turns=2)
    assert router.try_acquire(request=first) is r0
    assert first.decision.decided_by == "index"
    router.release(r0, Outcome.SUCCESS)
    router.outstanding["replica-0"] = 1  # r0 busier by one: today's policy would pick r1
    follow = conversation(1, turns=3)
    assert router.try_acquire(request=follow) is r0
    assert follow.decision.decided_by == "prefix" and follow.decision.prefix_match > 0.9
    # r0 now holds 2 of 2 in flight; the bound is ceil(1.25 * 3 / 2) = 2, so a third would overload it
    again = conversation(1, turns=4)
    assert router.try_acquire(request=again) is r1
    assert again.decision.decided_by == "outstanding"


@pytest.mark.parametrize("cache_room", [2.0, 0.0])
def test_a_new_conversation_starts_on_the_replica_whose_cache_has_room(cache_room):
    """After a restart: replica-0's cache is full of conversations still to come back, replica-1's is empty and
    busier by one request. A conversation neither holds goes to replica-1, where it evicts nothing (with the
    cache-room scorer off, load alone sends it to replica-0, evicting one); a conversation replica-0 holds stays
    there."""
    router, (r0, r1), clock = fleet(scorers={"prefix": {"block_chars": 16, "chars_per_token": 4, "balance_window": 0},
                                             "weights": {"cache_room": cache_room}})
    for replica in (r0, r1):
        router.update_load(replica.name, EngineLoad(kv_capacity_tokens=400, read_at=clock.now))  # 100 blocks
    for number in range(5):
        home = conversation(number, turns=1)
        assert router.try_acquire(request=home, exclude={"replica-1"}) is r0
        router.release(r0, Outcome.SUCCESS)
    assert router.policy.prefix.index.held("replica-0") == 100  # full
    router.outstanding["replica-1"] = 1
    new = conversation(9, turns=1)
    chosen = router.try_acquire(request=new)
    assert (chosen, new.decision.decided_by) == ((r1, "cache_room") if cache_room else (r0, "outstanding"))
    router.release(chosen, Outcome.SUCCESS)
    back = conversation(3, turns=2)
    assert router.try_acquire(request=back) is r0 and back.decision.decided_by == "prefix"


def test_the_balance_bound_leaves_out_a_replica_over_its_share_of_recent_decisions():
    """Sequential requests (never more than one in flight, so the in-flight bound is loose): affinity keeps the
    conversation home until its replica would exceed ceil(1.25 x equal share) of the window, then it is left
    out and the decision says so."""
    router, (r0, r1), _ = fleet()
    chosen = []
    for turn in range(2, 6):
        request = conversation(7, turns=turn)
        replica = router.try_acquire(request=request)
        router.release(replica, Outcome.SUCCESS)
        chosen.append((replica.name, request.decision.decided_by))
    assert chosen[:2] == [("replica-0", "index"), ("replica-0", "prefix")]
    assert chosen[2] == ("replica-1", "balance")  # 3 of 3 would exceed ceil(1.25 x 3 / 2) = 2
    assert router.policy.balance.held_back == 1
    request = RoutingRequest("short")  # below one block: not prefix-routed, not bounded, not counted
    assert router.try_acquire(request=request) is r0 and request.decision.decided_by != "balance"


def test_the_balance_window_restarts_when_a_replica_rejoins():
    router, (r0, r1), _ = fleet()
    r1.routable, r1.status.state = False, ReplicaState.STARTING
    for number in range(10):
        replica = router.try_acquire(request=conversation(100 + number, turns=2))
        router.release(replica, Outcome.SUCCESS)
    assert router.policy.balance.taken("replica-0") == 10
    r1.routable, r1.status.state = True, ReplicaState.READY
    picked = []
    for number in range(10):  # conversations r0 holds: affinity would keep them all there
        replica = router.try_acquire(request=conversation(100 + number, turns=3))
        router.release(replica, Outcome.SUCCESS)
        picked.append(replica.name)
    assert 3 <= picked.count("replica-1") <= 5  # its share from the first request on: within ceil(1.25 x 10 / 2)
    assert max(picked.count(n) for n in ("replica-0", "replica-1")) <= 7


def test_weights_decide_what_counts():
    router, (r0, r1), clock = fleet(scorers={"weights": {"prefix": 0}})
    first = conversation(2, turns=2)
    router.try_acquire(request=first)
    router.release(r0, Outcome.SUCCESS)
    router.outstanding["replica-0"] = 1
    assert router.try_acquire(request=conversation(2, turns=3)) is r1  # affinity off: least outstanding
    router2, (s0, s1), clock2 = fleet(scorers={"weights": {"outstanding": 1, "kv_cache": 2}})
    router2.outstanding["replica-0"] = 1
    router2.update_load("replica-0", EngineLoad(kv_cache_usage=0.0, waiting=0, running=1, read_at=clock2.now))
    router2.update_load("replica-1", EngineLoad(kv_cache_usage=0.95, waiting=0, running=0, read_at=clock2.now))
    assert router2.try_acquire() is s0  # KV weighted above one request's difference


def test_lagging_engine_readings_leave_the_decision_to_the_in_flight_counts():
    router, (r0, r1), clock = fleet(metrics_poll_seconds=1)
    assert router.try_acquire() is r0
    assert router.try_acquire() is r1
    clock.now += 3  # both busy for 3 s; r0's engine claims to be idle and empty: its gauges lag
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.0, waiting=0, running=0, read_at=clock.now))
    router.update_load("replica-1", EngineLoad(kv_cache_usage=0.3, waiting=0, running=1, read_at=clock.now))
    request = RoutingRequest("")
    assert router.try_acquire(request=request) is r1  # r0's 0.0 is unknown (0.5): r1's real 0.3 is better
    assert request.decision.decided_by == "tie_kv_cache"


def test_a_restarted_replica_loses_its_affinity():
    router, (r0, r1), _ = fleet()
    router.outstanding["replica-0"] = 1
    assert router.try_acquire(request=conversation(3, turns=2)) is r1
    router.release(r1, Outcome.SUCCESS)
    r1.status.restarts += 1
    r1.status.starts += 1
    router.outstanding["replica-1"] = 1
    router.outstanding["replica-0"] = 0
    request = conversation(3, turns=3)
    assert router.try_acquire(request=request) is r0  # r1 forgot: plain least outstanding
    assert request.decision.prefix_match == 0.0


def test_round_robin_rotates_over_candidates():
    router, (r0, r1), _ = fleet(scorers={"policy": "round_robin"})
    chosen = [router.try_acquire(request=conversation(4, turns=2)) for _ in range(4)]
    assert chosen == [r0, r1, r0, r1]


def test_decisions_are_measured():
    registry = CollectorRegistry()
    router, (r0, _), _ = fleet(registry=registry)
    router.try_acquire(request=conversation(5, turns=2))
    router.release(r0, Outcome.SUCCESS)
    router.try_acquire(request=conversation(5, turns=3))
    value = registry.get_sample_value
    assert value("appliance_routing_duration_seconds_count") == 2
    assert value("appliance_routing_decisions_total", {"policy": "weighted", "decided_by": "index"}) == 1
    assert value("appliance_routing_decisions_total", {"policy": "weighted", "decided_by": "prefix"}) == 1
    assert value("appliance_routing_prefix_match_ratio_count") == 2
    assert value("appliance_routing_prefix_match_ratio_bucket", {"le": "0.0"}) == 1  # the first turn
    assert value("appliance_routing_prefix_index_entries") > 0
    assert value("appliance_routing_prefix_index_bytes") > 0
    assert value("appliance_routing_prefix_index_evictions_total") == 0


def test_a_queued_request_is_dispatched_with_its_prompt():
    async def scenario():
        replicas = [FakeReplica("replica-0"), FakeReplica("replica-1")]
        limits = ConcurrencyLimits(lambda: AIMDLimit(1, 1, 1, target_seconds=1.0))
        router = Router(lambda: replicas, limit_for=limits.limit_of)
        admission = Admission(router, limits, max_queue=4, queue_timeout_seconds=5)
        r0, r1 = replicas
        first = await admission.acquire()
        second = await admission.acquire(request=conversation(6, turns=2))
        assert (first.replica, second.replica) == (r0, r1)
        waiting = asyncio.ensure_future(admission.acquire(request=conversation(6, turns=3)))
        await asyncio.sleep(0)
        # Both freed before the queue moves: without its prompt the waiter would get r0 (lower index).
        router.release(r0, Outcome.SUCCESS)
        router.release(r1, Outcome.SUCCESS)
        admission.dispatch()
        return (await waiting).replica, r1

    chosen, r1 = asyncio.run(scenario())
    assert chosen is r1


@pytest.mark.parametrize(("env", "message"), [
    ({"APPLIANCE_ROUTING__SCORERS__WEIGHTS__OUTSTANDING": "0", "APPLIANCE_ROUTING__SCORERS__WEIGHTS__PREFIX": "0"},
     "every scorer weight is 0"),
    ({"APPLIANCE_ROUTING__SCORERS__TIE_BREAKERS": "queue,queue"}, "tie_breakers lists a scorer twice"),
    ({"APPLIANCE_ROUTING__SCORERS__TIE_BREAKERS": "gpu_temperature"}, "routing.scorers.tie_breakers.0"),
    ({"APPLIANCE_ROUTING__SCORERS__POLICY": "random"}, "routing.scorers.policy"),
    ({"APPLIANCE_ROUTING__SCORERS__WEIGHTS__PREFIX": "-1"}, "routing.scorers.weights.prefix"),
    ({"APPLIANCE_ROUTING__SCORERS__PREFIX__LOAD_FACTOR": "0.5"}, "routing.scorers.prefix.load_factor"),
])
def test_bad_routing_config_is_refused_naming_the_key(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        load_settings()


def test_routing_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("APPLIANCE_ROUTING__SCORERS__TIE_BREAKERS", "queue")
    monkeypatch.setenv("APPLIANCE_ROUTING__SCORERS__WEIGHTS__PREFIX", "2.5")
    scorers = load_settings().routing.scorers
    assert scorers.tie_breakers == ["queue"] and scorers.weights.prefix == 2.5 and scorers.weights.outstanding == 1

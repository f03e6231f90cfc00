"""Routing policy and passive outlier ejection, with a controllable clock."""

from appliance.engine.load import EngineLoad
from appliance.gateway.router import Outcome, Router
from appliance.settings import RoutingSettings
from tests.doubles import FakeReplica


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(n: int = 2, **routing):
    replicas = [FakeReplica(f"replica-{i}", f"http://r{i}") for i in range(n)]
    clock = Clock()
    router = Router(lambda: replicas, RoutingSettings(**routing), clock=clock)
    return router, replicas, clock


def test_least_outstanding_then_kv_usage_then_queue():
    router, (r0, r1), clock = make()
    assert router.try_acquire() is r0  # tie: lowest index
    assert router.try_acquire() is r1  # r0 now has one outstanding
    router.release(r0, Outcome.SUCCESS)
    router.release(r1, Outcome.SUCCESS)
    router.update_load("replica-0", EngineLoad(kv_cache_usage=0.9, waiting=0, read_at=clock.now))
    router.update_load("replica-1", EngineLoad(kv_cache_usage=0.2, waiting=0, read_at=clock.now))
    assert router.try_acquire() is r1  # equal outstanding: the emptier KV cache wins
    router.release(r1, Outcome.SUCCESS)
    clock.now += 60  # readings go stale: unknown, back to index order
    assert router.try_acquire() is r0


def test_only_routable_replicas_under_their_limit():
    replicas = [FakeReplica("a", "http://a", routable=False), FakeReplica("b", "http://b")]
    router = Router(lambda: replicas, limit_for=lambda _name: 1)
    assert router.try_acquire() is replicas[1]
    assert router.try_acquire() is None  # b is at its limit of 1


def test_consecutive_failures_eject_and_probe_brings_back():
    router, (r0, r1), clock = make(eject_consecutive_failures=2, eject_base_seconds=5)
    for _ in range(2):
        assert router.try_acquire(exclude={"replica-1"}) is r0
        router.release(r0, Outcome.FAILURE)
    assert router.health_of("replica-0").ejected
    assert router.try_acquire() is r1 and router.try_acquire() is r1  # r0 out of rotation
    assert router.due_for_probe() == []
    clock.now += 5
    assert router.due_for_probe() == ["replica-0"]
    router.probe_result("replica-0", ok=False)  # still sick: ejected again, for twice as long
    clock.now += 5
    assert router.due_for_probe() == []
    clock.now += 5
    router.probe_result("replica-0", ok=True)
    assert not router.health_of("replica-0").ejected
    assert router.try_acquire() is r0


def test_client_errors_do_not_count_against_a_replica():
    router, (r0, _), _ = make(eject_consecutive_failures=1)
    router.try_acquire()
    router.release(r0, Outcome.CLIENT_ERROR)
    assert not router.health_of("replica-0").ejected


def test_latency_outlier_is_ejected_but_never_the_last_replica():
    router, (r0, r1), _ = make(latency_outlier_factor=3, latency_outlier_min_seconds=0.5)
    for _ in range(5):
        for replica, ttft in ((r0, 0.1), (r1, 0.1)):
            router.outstanding[replica.name] = router.in_flight(replica.name) + 1
            router.release(replica, Outcome.SUCCESS, ttft)
    for _ in range(10):
        router.outstanding[r1.name] = router.in_flight(r1.name) + 1
        router.release(r1, Outcome.SUCCESS, 3.0)
    assert router.health_of("replica-1").ejected
    assert "TTFT outlier" in router.health_of("replica-1").reason
    for _ in range(10):  # r0 slows down too, but it is the only one left: keep it
        router.outstanding[r0.name] = router.in_flight(r0.name) + 1
        router.release(r0, Outcome.SUCCESS, 5.0)
    assert not router.health_of("replica-0").ejected

"""Routing policy and passive outlier ejection, with a controllable clock."""

from appliance.engine.load import EngineLoad
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from tests.doubles import FakeClock, FakeReplica


def make(n: int = 2, **routing):
    replicas = [FakeReplica(f"replica-{i}", f"http://r{i}") for i in range(n)]
    clock = FakeClock()
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


def test_has_room_answers_what_try_acquire_would_without_taking_a_slot():
    replicas = [FakeReplica("a", "http://a", routable=False), FakeReplica("b", "http://b"), FakeReplica("c", "http://c")]
    router = Router(lambda: replicas, limit_for=lambda _name: 1)
    assert router.has_room() and router.has_room({"b"}) and not router.has_room({"b", "c"})  # a: not routable
    assert router.in_flight() == 0
    assert router.try_acquire() is replicas[1]
    assert router.has_room() and not router.has_room({"c"})
    assert router.try_acquire() is replicas[2]
    assert not router.has_room() and router.try_acquire() is None


def test_a_replica_out_of_routing_is_read_while_it_has_requests_in_flight():
    """A draining replica's engine keeps working on its requests: its counters are read until the last one ends
    (the tenants' reconciliation counts that work), then no more."""
    router, (r0, r1), _ = make()
    assert router.try_acquire(exclude={"replica-1"}) is r0
    r0.drain()
    assert router.poll_targets() == [r0, r1]
    router.release(r0, Outcome.SUCCESS)
    assert router.poll_targets() == [r1]


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


def serve(router, replica, ttft: float, times: int = 1) -> None:
    for _ in range(times):
        router.outstanding[replica.name] = router.in_flight(replica.name) + 1
        router.release(replica, Outcome.SUCCESS, ttft)


def test_a_peers_reading_from_before_its_restart_does_not_eject_the_replica_that_carried_the_load():
    """Replica 1 served fast, then was away (restarted) for minutes while replica 0 carried every request, slowly.
    Back, replica 1's old reading describes a process that no longer exists: replica 0 is not an outlier against
    it."""
    router, (r0, r1), clock = make(latency_outlier_factor=3, latency_outlier_min_seconds=0.5,
                                   latency_outlier_window_seconds=30)
    serve(router, r0, 0.07, 5)
    serve(router, r1, 0.07, 5)
    r1.routable = False  # restarting
    for _ in range(120):  # two minutes alone: no peer to be an outlier against
        clock.now += 1
        serve(router, r0, 0.9)
    assert not router.health_of("replica-0").ejected
    r1.routable = True
    serve(router, r0, 0.9)  # replica 1 is routable again, with its old reading
    assert not router.health_of("replica-0").ejected
    clock.now += 1
    serve(router, r1, 0.07, 10)  # fresh readings from both now: a real outlier is one again
    serve(router, r0, 0.9)
    assert router.health_of("replica-0").ejected


def test_a_replicas_own_old_average_is_not_carried_into_its_new_readings():
    router, (r0, r1), clock = make(latency_outlier_factor=3, latency_outlier_min_seconds=0.5,
                                   latency_outlier_window_seconds=30)
    serve(router, r1, 0.1, 5)
    serve(router, r0, 5.0, 3)  # slow, then away long enough to be another process
    assert router.health_of("replica-0").ejected
    router.health_of("replica-0").ejected_until = None  # back in rotation
    clock.now += 60
    serve(router, r1, 0.1)
    serve(router, r0, 0.1)
    assert router.health_of("replica-0").ttft_ewma == 0.1 and not router.health_of("replica-0").ejected


def fail_until_ejected(router, replica, clock=None) -> None:
    while not router.health_of(replica.name).ejected:
        router.outstanding[replica.name] = router.in_flight(replica.name) + 1
        router.release(replica, Outcome.FAILURE)


def test_ejection_never_leaves_zero_routable_replicas():
    router, (r0, r1), _ = make(eject_consecutive_failures=1)
    fail_until_ejected(router, r0)
    assert router.try_acquire() is r1  # one of two ejected: 50% healthy, at the panic threshold, not below
    fail_until_ejected(router, r1)
    assert router.health_of("replica-0").ejected and router.health_of("replica-1").ejected
    assert router.try_acquire() is not None  # panic: ejection is ignored rather than route nowhere
    assert router.panic()


def test_panic_threshold_is_configurable():
    router, replicas, _ = make(n=4, eject_consecutive_failures=1, eject_panic_threshold=0.5)
    for replica in replicas[:2]:
        fail_until_ejected(router, replica)
    assert [r.name for r in router.eligible()] == ["replica-2", "replica-3"]  # 2 of 4 healthy: at the threshold
    fail_until_ejected(router, replicas[2])
    assert len(router.eligible()) == 4  # 1 of 4 healthy is below 50%: spread over all, as Envoy does
    strict, replicas, _ = make(n=4, eject_consecutive_failures=1, eject_panic_threshold=0)
    for replica in replicas[:3]:
        fail_until_ejected(strict, replica)
    assert [r.name for r in strict.eligible()] == ["replica-3"]  # threshold 0: only zero healthy panics


def test_ejection_backoff_decays_after_a_healthy_period():
    router, (r0, _), clock = make(eject_consecutive_failures=1, eject_base_seconds=5, eject_max_seconds=1000,
                                  eject_decay_seconds=60)

    def eject_and_return() -> float:
        start = clock.now
        fail_until_ejected(router, r0)
        period = router.health_of("replica-0").ejected_until - start
        clock.now = router.health_of("replica-0").ejected_until
        router.probe_result("replica-0", ok=True)
        return period

    assert [eject_and_return() for _ in range(3)] == [5, 10, 20]  # repeated incidents back off
    clock.now += 60  # one healthy period halves the doubling: 10 s, where 40 s would have come next
    assert eject_and_return() == 10
    clock.now += 600  # a long good spell: back to the first period
    assert eject_and_return() == 5
    assert router.health_of("replica-0").ejections == 5  # the counter of ejections itself never decreases


def test_the_router_remembers_when_it_last_relayed_bytes_from_a_replica():
    """For maintenance (relayed_at) and on the replica's status, for its health watch (last_progress)."""
    now = [10.0]
    router = Router(list, clock=lambda: now[0])
    replica = FakeReplica("replica-0")
    assert router.relayed_at("replica-0") is None and replica.status.last_progress is None
    router.note_relayed(replica)
    now[0] = 12.5
    assert router.relayed_at("replica-0") == 10.0
    assert replica.status.last_progress == 10.0

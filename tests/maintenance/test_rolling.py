"""Rolling restart over stub replicas: order, one at a time, min ready respected, abort, warm-up before routing."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from appliance.app import maintenance_api_error
from appliance.maintenance.controller import MaintenanceController, http_warmer
from appliance.maintenance.errors import LastRoutableReplica
from appliance.maintenance.metrics import MaintenanceMetrics
from appliance.maintenance.rolling import RestartProcedure, RestartTimeouts, RollingRestart
from tests.maintenance.support import fleet

FAST = RestartTimeouts(drain_seconds=1, ready_seconds=1, min_ready_wait_seconds=0.3, poll_seconds=0.01)


class Warmer:
    def __init__(self) -> None:
        self.warmed: list[tuple[str, bool]] = []

    async def __call__(self, replica) -> bool:
        self.warmed.append((replica.name, replica.routable))
        return True


def test_every_replica_in_order_one_at_a_time_warmed_before_routing():
    replicas = fleet(["http://a", "http://b", "http://c"])
    warm = Warmer()
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, warm), min_ready=1).run())
    assert outcome.result == "ok" and outcome.restarted == ("replica-0", "replica-1", "replica-2")
    events = replicas[0].events
    assert [e[:2] for e in events] == [(a, f"replica-{i}") for i in range(3) for a in ("drain", "restart", "undrain")]
    assert [e[2] for e in events if e[0] == "restart"] == [2, 2, 2]  # the others kept serving each time
    assert warm.warmed == [(f"replica-{i}", False) for i in range(3)]  # warmed while still out of routing
    assert all(r.routable and r.status.restarts == 1 and not r.status.planned_restart for r in replicas)


def test_min_ready_is_respected_by_skipping():
    replicas = fleet(["http://a", "http://b"])
    replicas[1].drain()  # an operator took replica-1 out: restarting replica-0 would leave none routable
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1).run())
    assert outcome.result == "skipped"
    assert all(r.status.restarts == 0 for r in replicas)
    assert replicas[0].routable


def test_waits_for_min_ready_when_it_comes_back_in_time():
    replicas = fleet(["http://a", "http://b"])
    replicas[1].routable = False

    async def scenario():
        asyncio.get_running_loop().call_later(0.1, setattr, replicas[1], "routable", True)
        return await RollingRestart(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1).run()

    assert asyncio.run(scenario()).result == "ok"


def test_a_replica_that_does_not_come_back_aborts_and_the_rest_keep_serving():
    replicas = fleet(["http://a", "http://b"])
    replicas[0].comes_back = False
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1).run())
    assert outcome.result == "aborted" and "replica-0" in outcome.detail
    assert replicas[1].status.restarts == 0 and replicas[1].routable
    assert not replicas[0].status.planned_restart and not replicas[0].status.hold_when_ready  # no waiting for it


def test_a_single_replica_is_restarted_as_a_planned_restart():
    replicas = fleet(["http://a"])
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1).run())
    assert outcome.result == "ok"
    (_kind, _name, routable_others, planned), = [e for e in replicas[0].events if e[0] == "restart"]
    assert routable_others == 0 and planned  # requests queue for it instead of failing


def test_controller_counts_and_refuses_a_second_rolling_restart():
    replicas = fleet(["http://a", "http://b"])
    registry = CollectorRegistry()
    controller = MaintenanceController(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1,
                                       metrics=MaintenanceMetrics(registry))

    async def scenario():
        task = controller.start_rolling_restart("admin")
        try:
            controller.start_rolling_restart("admin")
        except Exception as exc:  # noqa: BLE001
            refused = exc
        await task
        return refused

    refused = asyncio.run(scenario())
    assert maintenance_api_error(refused).status == 409
    value = registry.get_sample_value
    assert value("appliance_maintenance_actions_total",
                 {"action": "rolling_restart", "trigger": "admin", "result": "ok"}) == 1
    assert value("appliance_maintenance_actions_total", {"action": "restart", "trigger": "admin", "result": "ok"}) == 2
    assert controller.status()["last_action"]["action"] == "rolling_restart"


def test_http_warmer_sends_one_small_completion(stubs):
    replicas = fleet([stubs[0].url])
    warm = http_warmer("demo", "Hello", 4)
    assert asyncio.run(warm(replicas[0]))
    assert stubs[0].received[-1].body == {"model": "demo", "prompt": "Hello", "max_tokens": 4}
    stubs[0].fail_status = 500
    assert not asyncio.run(warm(replicas[0]))


def test_a_hung_replica_is_restarted_without_waiting_out_the_drain():
    replicas = fleet(["http://a", "http://b"])
    in_flight = {"replica-0": 3}  # stuck requests: they will never finish
    slow_drain = RestartTimeouts(drain_seconds=60, ready_seconds=1, poll_seconds=0.01)
    procedure = RestartProcedure(slow_drain, Warmer(), in_flight=lambda name: in_flight.get(name, 0))
    controller = MaintenanceController(lambda: replicas, procedure, min_ready=1,
                                       metrics=MaintenanceMetrics(CollectorRegistry()),
                                       is_hung=lambda name: name == "replica-0")

    async def scenario():
        return await asyncio.wait_for(controller.start_restart("replica-0", "alert"), timeout=5)

    assert asyncio.run(scenario()).result == "ok"
    assert replicas[0].status.restarts == 1


def test_an_alert_never_rolls_a_single_replica_but_an_operator_can():
    replicas = fleet(["http://a"])
    controller = MaintenanceController(lambda: replicas, RestartProcedure(FAST, Warmer()), min_ready=1,
                                       metrics=MaintenanceMetrics(CollectorRegistry()))

    async def scenario():
        with pytest.raises(LastRoutableReplica) as refused:
            controller.start_rolling_restart("alert")
        return refused.value, await controller.start_rolling_restart("admin")

    refused, outcome = asyncio.run(scenario())
    assert refused.result == "refused" and "last routable" in refused.message
    assert outcome.result == "ok" and replicas[0].status.restarts == 1

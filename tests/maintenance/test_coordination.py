"""Restart leases across node pods: one node at a time, never below the fleet's min-ready, a dead holder's lease
expires; rolling restarts wait for the lease, hold it while they run and release it; the gateway's HTTP surface.
Stub replicas (tests/doubles.py); the real thing: tests/integration/test_multihost_maintenance.py."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from appliance.maintenance.coordination import (
    EnginesNotInView,
    GatewayLeaseCoordinator,
    LeaseAnswer,
    LeaseBoard,
    LeaseHeld,
)
from appliance.maintenance.errors import BelowMinReady, MaintenanceError
from appliance.maintenance.rolling import RestartProcedure, RestartTimeouts, RollingRestart
from tests.doubles import RestartableReplica
from tests.maintenance.support import AUTH

FAST = RestartTimeouts(drain_seconds=1, ready_seconds=2, min_ready_wait_seconds=0.3, poll_seconds=0.01)


async def warm(_replica) -> bool:
    return True


@dataclass
class View:
    """A gateway's discovered engine ``address:port``, following a node's replica."""

    name: str
    replica: RestartableReplica

    @property
    def routable(self) -> bool:
        return self.replica.routable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def board_over(views, min_ready: int = 1, clock=None) -> LeaseBoard:
    return LeaseBoard(lambda: views, min_ready=min_ready, max_ttl_seconds=60, clock=clock or Clock())


def engines(*names: str) -> frozenset[str]:
    return frozenset(names)


# -- the board ------------------------------------------------------------------------------------------------


def test_one_holder_at_a_time_and_renewal():
    nodes = [RestartableReplica(f"replica-{i}", "http://x") for i in range(3)]
    views = [View(f"10.0.0.{i}:8100", r) for i, r in enumerate(nodes)]
    board = board_over(views)
    board.acquire("a", engines("10.0.0.0:8100"), 30)
    with pytest.raises(LeaseHeld):
        board.acquire("b", engines("10.0.0.1:8100"), 30)
    nodes[0].routable = False  # a is restarting: its renewal is not a new capacity check
    assert board.acquire("a", engines("10.0.0.0:8100"), 30).holder == "a"
    assert not board.release("b") and board.release("a")
    board.acquire("b", engines("10.0.0.1:8100"), 30)  # 10.0.0.2 still routable: 1 >= min_ready
    assert board.granted == 2


def test_capacity_counts_only_engines_besides_the_holders():
    nodes = [RestartableReplica(f"replica-{i}", "http://x") for i in range(2)]
    views = [View("10.0.0.1:8100", nodes[0]), View("10.0.0.2:8100", nodes[1])]
    board = board_over(views, min_ready=1)
    nodes[1].routable = False  # the other node is down: restarting the last engine would leave none
    with pytest.raises(BelowMinReady, match="leave 0 engine"):
        board.acquire("a", engines("10.0.0.1:8100"), 30)
    nodes[1].routable = True
    board.acquire("a", engines("10.0.0.1:8100"), 30)
    assert board_over(views, min_ready=2).live() is None
    with pytest.raises(BelowMinReady):
        board_over(views, min_ready=2).acquire("a", engines("10.0.0.1:8100"), 30)


def test_ejected_engines_are_no_capacity():
    nodes = [RestartableReplica(f"replica-{i}", "http://x") for i in range(2)]
    views = [View("10.0.0.1:8100", nodes[0]), View("10.0.0.2:8100", nodes[1])]
    board = LeaseBoard(lambda: views, min_ready=1, max_ttl_seconds=60, is_ejected=lambda n: n == "10.0.0.2:8100")
    with pytest.raises(BelowMinReady):
        board.acquire("a", engines("10.0.0.1:8100"), 30)


def test_engines_the_gateway_does_not_see_are_refused():
    """A wrong coordinator_address would make the gateway count the holder's own engines as capacity."""
    views = [View("10.0.0.1:8100", RestartableReplica("r", "http://x"))]
    with pytest.raises(EnginesNotInView, match="coordinator_address"):
        board_over(views).acquire("a", engines("127.0.0.1:8100"), 30)


def test_a_dead_holders_lease_expires_and_ttl_is_capped():
    clock = Clock()
    nodes = [RestartableReplica(f"replica-{i}", "http://x") for i in range(3)]
    views = [View(f"10.0.0.{i}:8100", r) for i, r in enumerate(nodes)]
    board = board_over(views, clock=clock)
    board.acquire("a", engines("10.0.0.0:8100"), 10_000)  # capped at max_ttl_seconds (60)
    nodes[0].routable = False  # a died mid-restart
    clock.now = 59
    with pytest.raises(LeaseHeld):
        board.acquire("b", engines("10.0.0.1:8100"), 30)
    clock.now = 61
    board.acquire("b", engines("10.0.0.1:8100"), 30)  # 10.0.0.2 still serves: 1 >= 1
    assert board.status()["holder"] == "b"


def test_after_expiry_capacity_still_guards_a_two_node_fleet():
    clock = Clock()
    nodes = [RestartableReplica(f"replica-{i}", "http://x") for i in range(2)]
    views = [View(f"10.0.0.{i}:8100", r) for i, r in enumerate(nodes)]
    board = board_over(views, clock=clock)
    board.acquire("a", engines("10.0.0.0:8100"), 30)
    nodes[0].routable = False
    clock.now = 100  # a's lease expired while its engine is still down
    with pytest.raises(BelowMinReady):
        board.acquire("b", engines("10.0.0.1:8100"), 30)


# -- the rolling restart with a coordinator -------------------------------------------------------------------


class Coordinator:
    """A coordinator whose answers the test scripts; records every call."""

    retry_seconds = 0.01
    renew_seconds = 0.02

    def __init__(self, answers: list[bool], free: bool = True) -> None:
        self.answers = answers
        self.free = free
        self.calls: list[str] = []

    async def peek(self) -> LeaseAnswer:
        return LeaseAnswer(self.free, "restart lease free" if self.free else "restart lease held by node-9")

    async def acquire(self, replica) -> LeaseAnswer:
        self.calls.append(f"acquire {replica.name}")
        granted = self.answers.pop(0) if self.answers else True
        return LeaseAnswer(granted, "granted" if granted else "held by another node")

    async def renew(self, replica) -> bool:
        self.calls.append(f"renew {replica.name}")
        return True

    async def release(self, replica) -> None:
        self.calls.append(f"release {replica.name}")

    async def close(self) -> None:
        return None


def test_waits_for_the_lease_then_holds_and_releases_it_around_each_replica():
    replicas = [RestartableReplica("replica-0", "http://a", restart_seconds=0.1)]
    coordinator = Coordinator([False, False, True])
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, warm), min_ready=1,
                                         coordinator=coordinator).run())
    assert outcome.result == "ok"
    calls = coordinator.calls
    assert calls[:3] == ["acquire replica-0"] * 3
    assert calls[-1] == "release replica-0"
    assert "renew replica-0" in calls[3:-1]  # kept alive while the restart ran
    assert replicas[0].status.restarts == 1


def test_no_lease_in_time_skips_with_retry_and_restarts_nothing():
    replicas = [RestartableReplica("replica-0", "http://a")]
    coordinator = Coordinator([False] * 1000)
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, warm), min_ready=1,
                                         coordinator=coordinator).run())
    assert outcome.result == "skipped" and outcome.retry and "held by another node" in outcome.detail
    assert replicas[0].status.restarts == 0 and replicas[0].routable
    assert "release replica-0" not in coordinator.calls


def test_the_lease_is_released_when_the_restart_fails():
    replicas = [RestartableReplica("replica-0", "http://a", comes_back=False)]
    coordinator = Coordinator([])
    outcome = asyncio.run(RollingRestart(lambda: replicas, RestartProcedure(FAST, warm), min_ready=1,
                                         coordinator=coordinator).run())
    assert outcome.result == "aborted"
    assert coordinator.calls[-1] == "release replica-0"


class BoardCoordinator:
    """A node's coordinator talking to an in-process board (what GatewayLeaseCoordinator does over HTTP)."""

    retry_seconds = 0.01
    renew_seconds = 0.05

    def __init__(self, board: LeaseBoard, holder: str, address: str) -> None:
        self.board, self.holder, self.address = board, holder, address

    async def peek(self) -> LeaseAnswer:
        return LeaseAnswer(True, "")

    async def acquire(self, replica) -> LeaseAnswer:
        try:
            self.board.acquire(self.holder, frozenset({f"{self.address}:8100"}), 1.0)
        except MaintenanceError as exc:
            return LeaseAnswer(False, exc.message)
        return LeaseAnswer(True, "ok")

    async def renew(self, replica) -> bool:
        return (await self.acquire(replica)).granted

    async def release(self, replica) -> None:
        self.board.release(self.holder)

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("node_count,min_ready,down", [(2, 1, 0), (3, 1, 0), (3, 2, 0), (4, 2, 0), (3, 1, 1),
                                                      (3, 2, 1), (2, 2, 1), (3, 3, 1)])
def test_node_restarts_never_overlap_and_never_drop_the_fleet_below_min_ready(seed, node_count, min_ready, down):
    """Invariant over random restart lengths and start offsets: every one-engine node runs its rolling restart
    at the same moment (a shared window); sampled all along, at most one node is out at a time and the fleet
    never has fewer than min_ready routable (``down`` more nodes are out at the start and come back a little
    later: restarts that would need them wait); every node restarts once, given enough wait."""
    rng = random.Random(seed)
    nodes = [RestartableReplica("replica-0", f"http://10.0.0.{i}", restart_seconds=rng.uniform(0.02, 0.12))
             for i in range(node_count)]
    absent = [RestartableReplica("replica-0", f"http://10.0.1.{i}", routable=False) for i in range(down)]
    views = [View(f"10.0.0.{i}:8100", r) for i, r in enumerate(nodes)] + \
        [View(f"10.0.1.{i}:8100", r) for i, r in enumerate(absent)]
    board = LeaseBoard(lambda: views, min_ready=min_ready, max_ttl_seconds=60)
    timeouts = RestartTimeouts(drain_seconds=0.1, ready_seconds=2, min_ready_wait_seconds=10, poll_seconds=0.005)
    samples: list[tuple[int, int]] = []  # (restarting nodes out of routing, routable engines in the fleet)

    async def scenario():
        async def sample():
            while True:
                samples.append((sum(not r.routable for r in nodes), sum(r.routable for r in nodes + absent)))
                await asyncio.sleep(0.002)

        sampler = asyncio.create_task(sample())
        for replica in absent:
            asyncio.get_running_loop().call_later(0.15, setattr, replica, "routable", True)

        async def node(i: int):
            await asyncio.sleep(rng.uniform(0, 0.02))
            rolling = RollingRestart(lambda: [nodes[i]], RestartProcedure(timeouts, warm), min_ready=0,
                                     coordinator=BoardCoordinator(board, f"node-{i}", f"10.0.0.{i}"))
            return await rolling.run()

        outcomes = await asyncio.gather(*(node(i) for i in range(node_count)))
        sampler.cancel()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert [o.result for o in outcomes] == ["ok"] * node_count
    assert all(r.status.restarts == 1 for r in nodes)
    assert max(out for out, _ in samples) == 1  # one node out at a time (and the samples did see restarts)
    assert min(routable for out, routable in samples if out) >= min_ready  # no restart took the fleet below
    assert board.granted == node_count and board.live() is None


# -- the gateway's HTTP surface and the node's client --------------------------------------------------------


@pytest.fixture
def gateway(stubs):
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from appliance.app import create_app
    from appliance.settings import Settings
    from tests.doubles import FakeReplica

    views = [FakeReplica("10.0.0.1:8100", stubs[0].url), FakeReplica("10.0.0.2:8100", stubs[1].url)]
    settings = Settings(served_model_name="demo", role="gateway", admin_token="t0ken",
                        discovery={"name": "engines.test"}, collectors={"enabled": False})
    with TestClient(create_app(settings, replicas=lambda: views, registry=CollectorRegistry()),
                    raise_server_exceptions=False) as client:
        yield client, views


def lease(client, holder: str, address: str | None, **extra):
    body = {"holder": holder, "address": address, "ports": [8100], "ttl_seconds": 30, **extra}
    return client.post("/admin/maintenance/lease", json=body, headers=AUTH)


def test_gateway_grants_one_lease_and_refuses_the_next_with_409(gateway):
    client, views = gateway
    first = lease(client, "node-1", "10.0.0.1")
    assert first.status_code == 200 and first.json()["engines"] == ["10.0.0.1:8100"]
    second = lease(client, "node-2", "10.0.0.2")
    assert second.status_code == 409 and second.json()["error"]["code"] == "restart_lease_held"
    assert client.get("/admin/maintenance/lease", headers=AUTH).json()["holder"] == "node-1"
    assert client.delete("/admin/maintenance/lease", params={"holder": "node-1"}, headers=AUTH).json() == \
        {"released": True}
    views[0].routable = False  # node-1's engine not back in this gateway's view yet
    third = lease(client, "node-2", "10.0.0.2")
    assert third.status_code == 409 and third.json()["error"]["code"] == "min_ready_replicas"


def test_lease_requests_need_the_admin_token_and_a_valid_body(gateway):
    client, _ = gateway
    assert client.post("/admin/maintenance/lease", json={}).status_code == 401
    for bad in ({"holder": "", "ports": [1], "ttl_seconds": 1}, {"holder": "a", "ports": [], "ttl_seconds": 1},
                {"holder": "a", "ports": [1], "ttl_seconds": -1}, {"holder": "a", "ports": [1], "ttl_seconds": 1,
                                                                    "extra": 1}):
        response = client.post("/admin/maintenance/lease", json=bad, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_lease_request", bad
    response = client.post("/admin/maintenance/lease", content=b"{nope", headers=AUTH)
    assert response.status_code == 400
    unknown = lease(client, "node-9", "10.9.9.9")
    assert unknown.status_code == 409 and unknown.json()["error"]["code"] == "engines_not_in_view"


def test_only_a_gateway_grants_leases(make_app):
    client, _, _ = make_app(2)
    response = lease(client, "node-1", "127.0.0.1")
    assert response.status_code == 409 and response.json()["error"]["code"] == "not_a_coordinator"


def test_an_unreachable_coordinator_is_a_refusal():
    async def ask():
        coordinator = GatewayLeaseCoordinator("http://127.0.0.1:9", "t", holder="n", address="10.0.0.1",
                                              lease_seconds=30, timeout_seconds=1)
        try:
            return await coordinator.acquire(RestartableReplica("replica-0", "http://10.0.0.1:8100"))
        finally:
            await coordinator.close()

    answer = asyncio.run(ask())
    assert not answer.granted and "unreachable" in answer.detail


# -- the schedule -------------------------------------------------------------------------------------------


def test_a_window_restart_skipped_for_the_lease_tries_again_in_the_same_window():
    """Before: a skipped rolling restart used up the window, so a node that found another one restarting never
    restarted in that window."""
    from datetime import UTC, datetime

    from tests.maintenance.support import Rig

    rig = Rig(datetime(2026, 12, 2, 3, 0, tzinfo=UTC))
    refusals = Coordinator([False] * 10_000)
    rig.controller.coordinator = refusals
    decisions = rig.run(10, rate=0)  # the look-back fills, then every try is refused (another node restarts)
    assert rig.restarts() == [0, 0]
    tries = sum(d.startswith("rolling restart (schedule)") for d in decisions)
    assert tries >= 2, decisions
    refusals.answers.clear()  # the other node is done
    rig.run(2, rate=0)
    assert rig.restarts() == [1, 1]
    rig.run(30, rate=0)  # and only once in this window
    assert rig.restarts() == [1, 1]


def test_a_skip_for_capacity_still_uses_up_the_window():
    """Only a lease refusal retries: a rolling restart skipped because this host lacks capacity does not loop."""
    from datetime import UTC, datetime

    from tests.maintenance.support import Rig

    rig = Rig(datetime(2026, 12, 2, 3, 0, tzinfo=UTC))
    rig.replicas[1].drain()
    decisions = rig.run(20, rate=0)
    assert sum(d.startswith("rolling restart (schedule)") for d in decisions) == 1


def test_a_node_names_its_engines_by_its_address_or_lets_the_gateway_see_it():
    from appliance.composition.maintenance import restart_coordinator
    from appliance.settings import Settings

    def coordinator(**overrides):
        maintenance = {"enabled": True, "coordinator_url": "http://gw:8000", **overrides.pop("maintenance", {})}
        return restart_coordinator(Settings(role="node", admin_token="t", maintenance=maintenance, **overrides))

    assert coordinator(engine_host="127.0.0.2").address == "127.0.0.2"
    assert coordinator(engine_host="0.0.0.0").address is None  # the pod IP, as the gateway sees the request
    assert coordinator(engine_host="0.0.0.0", maintenance={"coordinator_address": "10.1.2.3"}).address == "10.1.2.3"
    assert type(restart_coordinator(Settings(maintenance={"enabled": True}))).__name__ == "LocalCoordinator"


def test_without_an_address_the_gateway_uses_the_requests_own(gateway):
    client, views = gateway
    views[0].name = "testclient:8100"  # the TestClient's peer address
    response = lease(client, "node-1", None)
    assert response.status_code == 200 and response.json()["engines"] == ["testclient:8100"]


def test_the_schedule_waits_while_another_node_holds_the_lease_and_records_nothing():
    from datetime import UTC, datetime

    from tests.maintenance.support import Rig

    rig = Rig(datetime(2026, 12, 2, 3, 0, tzinfo=UTC))
    held = Coordinator([], free=False)
    rig.controller.coordinator = held
    decisions = rig.run(10, rate=0)
    assert rig.restarts() == [0, 0] and rig.controller.last_action is None
    assert decisions[-1] == "waiting: restart lease held by node-9"
    assert rig.scheduler.status()["restart_lease_wait"] == "restart lease held by node-9"
    held.free = True
    rig.run(2, rate=0)
    assert rig.scheduler.status()["restart_lease_wait"] is None
    assert rig.restarts() == [1, 1]


def test_a_gateway_coordinator_peeks_at_the_holder(gateway):
    """The node's client against the gateway's real lease routes (the client needs a real socket: uvicorn on a
    thread serves the same app)."""
    import threading

    import uvicorn

    client, _ = gateway
    config = uvicorn.Config(client.app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    async def scenario():
        node1 = GatewayLeaseCoordinator(url, "t0ken", holder="node-1", address="10.0.0.1", lease_seconds=30,
                                        timeout_seconds=5)
        node2 = GatewayLeaseCoordinator(url, "t0ken", holder="node-2", address="10.0.0.2", lease_seconds=30,
                                        timeout_seconds=5)
        wrong = GatewayLeaseCoordinator(url, "nope", holder="node-3", address="10.0.0.2", lease_seconds=30,
                                        timeout_seconds=5)
        try:
            replica = RestartableReplica("replica-0", "http://10.0.0.1:8100")
            assert (await node2.peek()).granted
            assert (await node1.acquire(replica)).granted
            assert (await node1.peek()).granted  # its own lease
            peek = await node2.peek()
            assert not peek.granted and "node-1" in peek.detail
            refused = await node2.acquire(RestartableReplica("replica-0", "http://10.0.0.2:8100"))
            assert not refused.granted and "409" in refused.detail
            assert not (await wrong.acquire(replica)).granted  # 401: a refusal
            assert await node1.renew(replica)
            await node1.release(replica)
            assert (await node2.peek()).granted
        finally:
            for coordinator in (node1, node2, wrong):
                await coordinator.close()

    try:
        asyncio.run(scenario())
    finally:
        server.should_exit = True
        thread.join(timeout=10)

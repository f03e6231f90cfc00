"""DNS discovery: the gateway role's fleet follows a name served by a real (test) DNS server.

The engines here are stub upstreams (the gateway's own logic under test); tests/integration/test_multihost.py
runs the same path against real vLLM engines.
"""

import asyncio
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.composition.fleet import build_dns_fleet
from appliance.context import context_of
from appliance.engine.contract import ReplicaState
from appliance.engine.discovery import DnsFleet, resolve_with_nameserver, resolve_with_system
from appliance.engine.settings import DiscoverySettings
from appliance.gateway.upstream.labels import client_label
from appliance.serve import build_fleet, node_pending
from appliance.settings import ConfigError, Settings, load_settings
from tests.engine.dns_server import TestDNSServer
from tests.fake_engine import FakeEngine

NAME = "engines.appliance.test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def dns_server():
    server = TestDNSServer().start()
    yield server
    server.stop()


@pytest.fixture
def engines():
    """Two fake engines on the same port at two loopback addresses: two 'nodes'."""
    port = free_port()
    stubs = [FakeEngine("127.0.0.2", port).start(), FakeEngine("127.0.0.3", port).start()]
    yield stubs
    for stub in stubs:
        stub.stop()


def gateway_settings(dns_server: TestDNSServer, port: int, **discovery) -> Settings:
    return Settings(role="gateway", engine_base_port=port, port=port + 1000 if port < 60000 else 8000,
                    discovery=DiscoverySettings(name=NAME, nameserver=dns_server.address, **discovery))


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_resolver_reads_the_test_server_and_tells_no_name_from_failure(dns_server):
    async def scenario() -> None:
        dns_server.set(NAME, ["127.0.0.2", "127.0.0.3"])
        assert await resolve_with_nameserver(NAME, dns_server.address, 2) == {"127.0.0.2", "127.0.0.3"}
        dns_server.set(NAME, [])
        assert await resolve_with_nameserver(NAME, dns_server.address, 2) == set()  # NXDOMAIN: no engines
        silent = f"127.0.0.1:{free_port()}"  # nothing answers there
        assert await resolve_with_nameserver(NAME, silent, 0.3) is None  # a failure, not an empty answer

    asyncio.run(scenario())


def test_system_resolver_through_getaddrinfo():
    async def scenario() -> None:
        assert "127.0.0.1" in (await resolve_with_system("localhost", 2) or set())

    asyncio.run(scenario())


def test_fleet_follows_additions_and_removals(dns_server, engines):
    async def scenario() -> None:
        port = engines[0].port
        dns_server.set(NAME, ["127.0.0.2"])
        registry = CollectorRegistry()
        fleet = build_dns_fleet(gateway_settings(dns_server, port), registry)
        await fleet.start()
        try:
            assert [r.name for r in fleet.replicas] == [f"127.0.0.2:{port}"]
            first = fleet.replicas[0]
            assert first.status.state is ReplicaState.STARTING  # joins routing only once /health is green
            await until(lambda: first.routable)

            dns_server.set(NAME, ["127.0.0.2", "127.0.0.3"])
            await fleet.refresh()
            assert [r.url for r in fleet.replicas] == [f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"]
            assert fleet.replicas[0] is first  # a known address keeps its replica (and its routing state)
            await until(lambda: all(r.routable for r in fleet.replicas))

            dns_server.set(NAME, ["127.0.0.3"])
            await fleet.refresh()
            assert [r.name for r in fleet.replicas] == [f"127.0.0.3:{port}"]
            assert first.status.state is ReplicaState.STOPPED and not first.routable

            dns_server.set(NAME, [])
            await fleet.refresh()
            assert fleet.replicas == []
            assert registry.get_sample_value("appliance_discovery_changes_total", {"change": "joined"}) == 2
            assert registry.get_sample_value("appliance_discovery_changes_total", {"change": "left"}) == 2
            assert registry.get_sample_value("appliance_discovery_addresses") == 0
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def test_failed_resolution_keeps_the_known_engines(dns_server, engines):
    async def scenario() -> None:
        port = engines[0].port
        dns_server.set(NAME, ["127.0.0.2", "127.0.0.3"])
        answers = iter([{"127.0.0.2", "127.0.0.3"}, None])

        async def flaky() -> set[str] | None:
            return next(answers)

        registry = CollectorRegistry()
        fleet = DnsFleet(flaky, ports=[port], interval_seconds=60, registry=registry)
        await fleet.start()
        try:
            await fleet.refresh()
            assert len(fleet.replicas) == 2
            assert registry.get_sample_value("appliance_discovery_resolutions_total", {"result": "failed"}) == 1
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def test_engines_per_node_are_consecutive_ports(dns_server):
    async def scenario() -> None:
        dns_server.set(NAME, ["127.0.0.2"])
        settings = gateway_settings(dns_server, 9100, engines_per_node=3)
        fleet = build_dns_fleet(settings)
        await fleet.start()
        try:
            assert [r.url for r in fleet.replicas] == [f"http://127.0.0.2:{p}" for p in (9100, 9101, 9102)]
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def test_gateway_routes_to_discovered_engines_and_lets_a_vanished_one_finish(dns_server, engines):
    port = engines[0].port
    dns_server.set(NAME, ["127.0.0.2", "127.0.0.3"])
    settings = gateway_settings(dns_server, port, interval_seconds=0.2)
    app = create_app(settings, fleet=build_fleet(settings, CollectorRegistry()), registry=CollectorRegistry())
    with TestClient(app) as client:
        assert wait_for(lambda: client.get("/health/ready").json()["ready_replicas"] == 2)
        engines[0].first_token_delay = 1.5
        slow: dict = {}
        thread = threading.Thread(target=lambda: slow.update(
            r=client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})))
        served_before = len(engines[0].received)
        thread.start()
        router = context_of(app).gateway.router
        assert wait_for(lambda: len(engines[0].received) > served_before or router.in_flight() > 0)
        dns_server.set(NAME, ["127.0.0.3"])  # the node at 127.0.0.2 leaves while a request runs there
        assert wait_for(lambda: client.get("/health/ready").json()["ready_replicas"] == 1)
        for _ in range(5):
            response = client.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
            assert response.status_code == 200
            assert response.headers["x-appliance-replica"] == client_label(f"127.0.0.3:{port}")  # not the address
        thread.join(10)
        assert slow["r"].status_code == 200  # the request already on the vanished node finished
        assert router.in_flight() == 0


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_role_settings_are_checked(monkeypatch):
    assert Settings().role == "all"
    with pytest.raises(ConfigError, match="discovery.name"):
        load_settings(role="gateway")
    with pytest.raises(ConfigError, match="engine_urls"):
        load_settings(role="gateway", discovery={"name": NAME}, engine_urls=["http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="host:port"):
        load_settings(discovery={"nameserver": "127.0.0.1"})
    monkeypatch.setenv("APPLIANCE_ROLE", "gateway")
    monkeypatch.setenv("APPLIANCE_DISCOVERY__NAME", NAME)
    assert load_settings().discovery.name == NAME


def test_node_drain_waits_for_requests_other_gateways_sent_to_its_engines():
    from appliance.engine.load import EngineLoad

    settings = Settings(engine_urls=["http://127.0.0.1:1"])
    app = create_app(settings, fleet=build_fleet(settings, CollectorRegistry()))
    router = context_of(app).gateway.router
    assert node_pending(app) == 0
    router.update_load("external-0", EngineLoad(running=2, waiting=1, read_at=time.monotonic()))
    assert node_pending(app) == 3
    router.update_load("external-0", EngineLoad(running=2, read_at=time.monotonic() - 60))  # stale: engine gone
    assert node_pending(app) == 0

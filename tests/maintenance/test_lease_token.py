"""Node pods take restart leases with a token that opens nothing else (``gateway.lease_token``), so that they hold
no admin token: their engines run as their user and could read it. A node's own gateway serves no /v1 (it holds no
API key to check), and its /admin takes a token of the pod's own."""

from __future__ import annotations

import asyncio
import stat
import threading

import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.composition.maintenance import restart_coordinator
from appliance.maintenance.coordination import LEASE_PATH, GatewayLeaseCoordinator
from appliance.serve import with_node_admin_token
from appliance.settings import Settings
from tests.doubles import FakeReplica, RestartableReplica

LEASE, ADMIN = "lease-t0ken", "admin-t0ken"
BODY = {"holder": "node-1", "address": "10.0.0.1", "ports": [8100], "ttl_seconds": 30}


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def gateway(stubs):
    views = [FakeReplica("10.0.0.1:8100", stubs[0].url), FakeReplica("10.0.0.2:8100", stubs[1].url)]
    settings = Settings(served_model_name="demo", role="gateway", admin_token=ADMIN, gateway={"lease_token": LEASE},
                        discovery={"name": "engines.test"}, collectors={"enabled": False})
    with TestClient(create_app(settings, replicas=lambda: views, registry=CollectorRegistry()),
                    raise_server_exceptions=False) as client:
        yield client


def test_the_lease_token_takes_the_lease_and_opens_nothing_else(gateway):
    assert LEASE_PATH == "/maintenance/lease"
    granted = gateway.post(LEASE_PATH, json=BODY, headers=_bearer(LEASE))
    assert granted.status_code == 200 and granted.json()["engines"] == ["10.0.0.1:8100"]
    assert gateway.get(LEASE_PATH, headers=_bearer(LEASE)).json()["holder"] == "node-1"
    assert gateway.delete(LEASE_PATH, params={"holder": "node-1"}, headers=_bearer(LEASE)).json() == \
        {"released": True}
    for method, path in (("get", "/admin/status"), ("post", "/admin/maintenance/lease"),
                         ("post", "/admin/replicas/10.0.0.1:8100/drain"), ("post", "/admin/reload"),
                         ("get", "/admin/requests"), ("post", "/admin/alerts")):
        refused = gateway.request(method.upper(), path, json=BODY, headers=_bearer(LEASE))
        assert refused.status_code == 401, (path, refused.status_code)


def test_the_lease_takes_the_admin_token_too_and_no_other(gateway):
    assert gateway.post(LEASE_PATH, json=BODY, headers=_bearer(ADMIN)).status_code == 200  # nodes before the token
    assert gateway.post("/admin/maintenance/lease", json={**BODY, "holder": "node-1"},
                        headers=_bearer(ADMIN)).status_code == 200  # the admin route stays, for older nodes
    for headers in ({}, _bearer("nope"), {"authorization": LEASE}):
        refused = gateway.post(LEASE_PATH, json=BODY, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_lease_token", headers


def test_without_a_lease_or_admin_token_nobody_takes_a_lease(stubs):
    settings = Settings(served_model_name="demo", role="gateway", discovery={"name": "engines.test"},
                        collectors={"enabled": False})
    app = create_app(settings, replicas=lambda: [FakeReplica("10.0.0.1:8100", stubs[0].url)],
                     registry=CollectorRegistry())
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post(LEASE_PATH, json=BODY, headers=_bearer(LEASE)).status_code == 403


def test_a_node_sends_the_lease_token_when_it_has_one():
    maintenance = {"enabled": True, "coordinator_url": "http://gw:8000"}
    node = restart_coordinator(Settings(role="node", gateway={"lease_token": LEASE}, maintenance=maintenance))
    assert isinstance(node, GatewayLeaseCoordinator) and node._headers == _bearer(LEASE)
    earlier = restart_coordinator(Settings(role="node", admin_token=ADMIN, maintenance=maintenance))
    assert isinstance(earlier, GatewayLeaseCoordinator) and earlier._headers == _bearer(ADMIN)


def test_a_node_holding_only_the_lease_token_takes_and_releases_a_lease(gateway):
    """The node's client against the gateway's real routes, over a socket (uvicorn on a thread, same app)."""
    server = uvicorn.Server(uvicorn.Config(gateway.app, host="127.0.0.1", port=0, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    async def scenario() -> None:
        node = GatewayLeaseCoordinator(url, LEASE, holder="node-1", address="10.0.0.1", lease_seconds=30,
                                       timeout_seconds=5)
        try:
            replica = RestartableReplica("replica-0", "http://10.0.0.1:8100")
            assert (await node.peek()).granted
            assert (await node.acquire(replica)).granted
            assert await node.renew(replica)
            await node.release(replica)
        finally:
            await node.close()

    try:
        asyncio.run(scenario())
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_node_serves_no_v1_and_keeps_its_health_and_metrics(stubs):
    """A node holds no API key: an open /v1 on its own gateway would bypass the gateways' keys and quotas."""
    settings = Settings(served_model_name="demo", role="node", collectors={"enabled": False})
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0", stubs[0].url)],
                     registry=CollectorRegistry())
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/completions", json={"model": "demo", "prompt": "hi"}).status_code == 404
        assert client.get("/v1/models").status_code == 404
        assert client.get("/health/live").status_code == 200 and client.get("/metrics").status_code == 200
    assert not [r for stub in stubs for r in stub.received]


def test_a_node_makes_an_admin_token_of_its_own(tmp_path):
    node = with_node_admin_token(Settings(role="node", state_dir=tmp_path))
    token_file = tmp_path / "admin-token"
    assert node.gateway.admin_token and token_file.read_text().strip() == node.gateway.admin_token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert with_node_admin_token(Settings(role="node", state_dir=tmp_path)).gateway.admin_token == \
        node.gateway.admin_token  # the pod's commands read it there (appliance status)
    assert with_node_admin_token(Settings(state_dir=tmp_path / "all")).gateway.admin_token is None
    configured = Settings(role="node", admin_token=ADMIN, state_dir=tmp_path)
    assert with_node_admin_token(configured).gateway.admin_token == ADMIN

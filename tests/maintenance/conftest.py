import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.settings import Settings
from tests.maintenance.support import fleet


@pytest.fixture
def make_app(stubs):
    """A gateway over restartable stub replicas, admin token ``t0ken``; returns (client, replicas, registry)."""
    clients = []

    def make(replica_count: int = 2, **overrides):
        replicas = fleet([s.url for s in stubs[:replica_count]])
        registry = CollectorRegistry()
        overrides.setdefault("collectors", {"enabled": False})
        overrides.setdefault("admin_token", "t0ken")
        settings = Settings(served_model_name="demo", **overrides)
        client = TestClient(create_app(settings, replicas=lambda: replicas, registry=registry),
                            raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client, replicas, registry

    yield make
    for client in clients:
        client.__exit__(None, None, None)

import pytest
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.settings import Settings
from tests.doubles import FakeReplica


@pytest.fixture
def replicas(stubs):
    return [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]


@pytest.fixture
def make_client(replicas):
    clients = []

    def make(**overrides) -> TestClient:
        settings = Settings(served_model_name="demo", **overrides)
        client = TestClient(create_app(settings, replicas=lambda: replicas), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client):
    return make_client()

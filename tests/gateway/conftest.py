import pytest

from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.live import app_clients


@pytest.fixture
def replicas(stubs):
    return [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]


@pytest.fixture
def make_client(replicas):
    yield from app_clients(replicas, lambda **overrides: Settings(served_model_name="demo", **overrides))


@pytest.fixture
def client(make_client):
    return make_client()

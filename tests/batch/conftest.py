"""The Batch API's tests: an appliance with batches on (its state in a temporary folder), two tenants, and the fake
engines of tests/conftest.py (``stubs``); helpers to write input files and wait for a batch to end."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from appliance.batch.postgres import PostgresBatchStore
from appliance.settings import Settings
from tests.batch.postgres_server import PostgresServer
from tests.doubles import FakeReplica
from tests.gateway.live import app_clients

KEYS = {"team-a": "key-a", "team-b": "key-b"}
ADMIN = "batch-admin"
ENDED = ("completed", "failed", "cancelled", "expired")


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def chat_line(custom_id: str, content: str = "hello", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **body}}


def jsonl(lines: Iterable[dict[str, Any] | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client: TestClient, data: bytes, tenant: str = "team-a", purpose: str = "batch") -> Any:
    return client.post("/v1/files", files={"file": ("input.jsonl", data)}, data={"purpose": purpose},
                       headers=auth(tenant))


def create(client: TestClient, file_id: str, tenant: str = "team-a", endpoint: str = "/v1/chat/completions",
           **extra: Any) -> Any:
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                            "completion_window": "24h", **extra}, headers=auth(tenant))


def run_batch(client: TestClient, lines: Iterable[dict[str, Any] | str], tenant: str = "team-a",
              timeout: float = 20.0) -> dict[str, Any]:
    """Upload, create, and wait until the batch ends; returns the ended batch."""
    uploaded = upload(client, jsonl(lines), tenant)
    assert uploaded.status_code == 200, uploaded.text
    created = create(client, uploaded.json()["id"], tenant)
    assert created.status_code == 200, created.text
    return wait_for(client, created.json()["id"], tenant, timeout=timeout)


def wait_for(client: TestClient, batch_id: str, tenant: str = "team-a", statuses: tuple[str, ...] = ENDED,
             timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth(tenant)).json()
        if batch["status"] in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch['status']}: {batch}"
        time.sleep(0.02)


def result_lines(client: TestClient, file_id: str | None, tenant: str = "team-a") -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content", headers=auth(tenant))
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def settings(tmp_path: Any, **overrides: Any) -> Settings:
    batch = {"enabled": True, "poll_seconds": 0.02, "backoff_seconds": 0.05, **overrides.pop("batch", {})}
    return Settings(served_model_name="demo", state_dir=tmp_path,
                    tenants=[{"name": name, "api_keys": [key]} for name, key in KEYS.items()],
                    gateway={"admin_token": ADMIN, **overrides.pop("gateway", {})}, batch=batch, **overrides)


@pytest.fixture
def make_batch_client(replicas: list[FakeReplica], tmp_path: Any) -> Iterable[Callable[..., TestClient]]:
    yield from app_clients(replicas, lambda **overrides: settings(tmp_path, **overrides))


@pytest.fixture
def replicas(stubs: list[Any]) -> list[FakeReplica]:
    return [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]


@pytest.fixture
def client(make_batch_client: Callable[..., TestClient]) -> TestClient:
    return make_batch_client()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session (skips, naming the package, where it is not installed)."""
    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


def postgres_store(server: PostgresServer, schema: str | None = None, **options: Any) -> PostgresBatchStore:
    """A store on ``server`` in ``schema`` (a new one of its own unless named: another store naming it shares its
    batches, as a second gateway does)."""
    return PostgresBatchStore(server.url, password=server.password_file.read_text().strip(),
                              schema=schema or f"test_{secrets.token_hex(6)}", **options)

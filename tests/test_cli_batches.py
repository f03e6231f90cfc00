"""``appliance batches`` against a running gateway (uvicorn in a thread, batches on, its state in a temporary
folder): the list, one batch in full, a cancel, and the exit codes of exit_codes.py."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from appliance.app import create_app
from appliance.cli import batches as cli_batches
from appliance.cli import main
from appliance.gateway.routes import batches as routes_batches
from appliance.settings import Settings
from tests.batch.conftest import chat_line, jsonl
from tests.doubles import FakeReplica
from tests.gateway.live import LiveGateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """No replica is routable, so a batch stays in progress (no idle capacity to run it on)."""
    settings = Settings(served_model_name="demo", state_dir=tmp_path_factory.mktemp("state"),
                        tenants=[{"name": "team-a", "api_keys": ["key-a"]}, {"name": "team-b", "api_keys": ["key-b"]}],
                        gateway={"admin_token": "t0ken"}, collectors={"probe_bandwidth": False},
                        batch={"enabled": True})
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0", routable=False)])
    with LiveGateway(app) as live:
        for tenant in ("team-a", "team-b"):
            headers = {"authorization": f"Bearer key-{tenant[-1]}"}
            file = httpx.post(f"{live.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat_line("x"), "bad"]))},
                              data={"purpose": "batch"}, headers=headers).json()
            created = httpx.post(f"{live.url}/v1/batches", headers=headers, json={
                "input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            assert created.status_code == 200, created.text
        yield live


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t0ken")


def test_lists_every_tenants_batches_newest_first(gateway, token, capsys):
    assert main(["batches", "list", "--url", gateway.url]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("batch_")]
    assert [row.split()[1] for row in rows] == ["team-b", "team-a"]
    assert re.search(r"team-a\s+(validating|in_progress)\s+/v1/chat/completions\s+0\s+1\s+2\s+\d+s", rows[1]), out
    assert main(["batches", "list", "--url", gateway.url, "--tenant", "team-a", "--json"]) == 0
    assert [b["tenant"] for b in json.loads(capsys.readouterr().out)["data"]] == ["team-a"]
    assert main(["batches", "list", "--url", gateway.url, "--status", "completed"]) == 0
    assert "no batch matches" in capsys.readouterr().out


def test_shows_one_batch_and_cancels_it(gateway, token, capsys):
    assert main(["batches", "list", "--url", gateway.url, "--tenant", "team-b", "--json"]) == 0
    batch_id = json.loads(capsys.readouterr().out)["data"][0]["id"]
    assert main(["batches", "show", batch_id, "--url", gateway.url]) == 0
    out = capsys.readouterr().out
    assert f"batch {batch_id}  tenant team-b" in out and "0 completed, 1 failed of 2 lines" in out
    assert "created at" in out and "expires at" in out
    assert main(["batches", "cancel", batch_id, "--url", gateway.url]) == 0
    assert re.search(rf"{batch_id}: (cancelling|cancelled)", capsys.readouterr().out)
    assert main(["batches", "show", batch_id, "--url", gateway.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] in ("cancelling", "cancelled")


def test_an_unknown_batch_is_exit_1_and_bad_input_exit_2(gateway, token, capsys, monkeypatch, tmp_path):
    assert main(["batches", "show", "batch_nope", "--url", gateway.url]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    for argv in (["list", "--limit", "0"], ["list", "--status", "asleep"], ["show"], ["list", "--limit", "101"]):
        with pytest.raises(SystemExit) as exited:
            main(["batches", *argv])
        assert exited.value.code == 2, argv
    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN")
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    assert main(["batches", "--url", gateway.url]) == 2  # no admin token: nothing was sent
    assert "APPLIANCE_ADMIN_TOKEN" in capsys.readouterr().err


def test_the_bare_command_lists(gateway, token, capsys):
    assert main(["batches", "--url", gateway.url]) == 0
    assert capsys.readouterr().out.count("batch_") == 2


def test_the_cli_checks_statuses_as_the_route_does():
    assert re.fullmatch(routes_batches.STATUS, "|".join(cli_batches.STATUSES)) is None
    assert all(re.fullmatch(routes_batches.STATUS, status) for status in cli_batches.STATUSES)

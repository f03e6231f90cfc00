"""``appliance requests`` against a running gateway (uvicorn in a thread, records put into its ring by hand): the
table, the filters, one request in full, and the exit codes of exit_codes.py."""

from __future__ import annotations

import json
import re

import pytest

from appliance.admin_client import format_request, format_requests
from appliance.app import create_app
from appliance.cli import admin as cli_admin
from appliance.cli import main
from appliance.context import context_of
from appliance.gateway.observation.records import AttemptRecord, MigrationRecord, RequestRecord
from appliance.gateway.routes import requests as routes_requests
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Router
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.live import LiveGateway

NOW = 2000.0


def explained_decision():
    """A real decision on two replicas, one of them full."""
    replicas = [FakeReplica("replica-0"), FakeReplica("replica-1")]
    router = Router(lambda: replicas, limit_for=lambda _name: 1)
    router.outstanding["replica-0"] = 1
    request = RoutingRequest("a prompt")
    router.try_acquire(request=request)
    return request.decision


def fill(records) -> None:
    slow = RequestRecord("slow-one", "/v1/chat/completions", "team-a", True, NOW - 30, 1.5)
    slow.attempts.append(AttemptRecord("replica-0", None, 0.0, "failure", "retry: HTTP 503", NOW - 30))
    slow.attempts.append(AttemptRecord("replica-1", explained_decision(), 1.5, "success", None, NOW - 28.5))
    slow.migrations.append(MigrationRecord("replica-1", "replica-0", "drain", 7, "continued"))
    slow.ttft_seconds, slow.e2e_seconds, slow.status, slow.outcome = 2.1, 6.0, 200, "success"
    records.add(slow)
    fast = RequestRecord("fast-one", "/v1/completions", "team-b", False, NOW - 5, 0.0)
    fast.attempts.append(AttemptRecord("replica-0", None, 0.0, "success", None, NOW - 5))
    fast.ttft_seconds, fast.e2e_seconds, fast.status, fast.outcome = 0.05, 0.2, 200, "success"
    records.add(fast)


@pytest.fixture(scope="module")
def gateway():
    settings = Settings(served_model_name="demo", gateway={"admin_token": "t0ken"},
                        collectors={"probe_bandwidth": False})
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0"), FakeReplica("replica-1")])
    with LiveGateway(app) as live:
        fill(context_of(app).gateway.records)
        yield live


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t0ken")


def test_lists_the_records_newest_first(gateway, token, capsys):
    assert main(["requests", "--url", gateway.url]) == 0
    out = capsys.readouterr().out
    assert out.index("fast-one") < out.index("slow-one")
    slow = next(line for line in out.splitlines() if line.startswith("slow-one"))
    assert re.search(r"team-a\s+chat/completions\s+replica-0\s+single\s+1.50s\s+2.10s\s+6.00s\s+200 success\s+1/1",
                     slow), slow
    assert "holds the last 2 of at most 1000" in out


def test_filters_reach_the_gateway(gateway, token, capsys):
    assert main(["requests", "--url", gateway.url, "--slow", "1", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in body["requests"]] == ["slow-one"]
    assert main(["requests", "--url", gateway.url, "--tenant", "team-b", "--replica", "replica-0", "--limit", "1",
                 "--status", "2xx", "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["requests"]] == ["fast-one"]
    assert main(["requests", "--url", gateway.url, "--tenant", "nobody"]) == 0
    assert "no request matches" in capsys.readouterr().out


def test_one_request_in_full_with_its_routing_decision(gateway, token, capsys):
    assert main(["requests", "--url", gateway.url, "--id", "slow-one"]) == 0
    out = capsys.readouterr().out
    assert "attempt 1: replica-0" in out and "failure (retry: HTTP 503)" in out
    assert "picked replica-1, decided by single" in out
    assert re.search(r"replica-0\s+under_limit", out), out
    assert re.search(r"replica-1\*\s+-\s+[0-9.]+", out), out  # the pick, with its scores
    assert "migration 1: replica-1 -> replica-0 (drain, 7 tokens already sent): continued" in out
    assert main(["requests", "--url", gateway.url, "--id", "slow-one", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attempts"][1]["decision"]["removed"] == {"replica-0": "under_limit"}


def test_an_unknown_id_is_exit_1_with_the_gateways_message(gateway, token, capsys):
    assert main(["requests", "--url", gateway.url, "--id", "nope/../x"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "no record of request 'nope/../x'" in err


def test_bad_input_exits_2(gateway, token, tmp_path, monkeypatch, capsys):
    for argv in (["--limit", "0"], ["--limit", "1001"], ["--slow", "-1"], ["--status", "5XX!"]):
        with pytest.raises(SystemExit) as exited:
            main(["requests", "--url", gateway.url, *argv])
        assert exited.value.code == 2, argv
    assert main(["requests", "--url", gateway.url, "--id", "x", "--tenant", "t"]) == 2
    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN")
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    assert main(["requests", "--url", gateway.url]) == 2  # no admin token: nothing was sent
    assert "APPLIANCE_ADMIN_TOKEN" in capsys.readouterr().err


def test_an_unreachable_appliance_is_exit_1(token, capsys):
    assert main(["requests", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_the_cli_checks_statuses_as_the_route_does():
    assert cli_admin.STATUS_PATTERN == routes_requests.STATUS_PATTERN


def test_formats_say_when_records_are_off_and_show_unknown_scores():
    assert "off" in format_requests({"capacity": 0, "held": 0, "requests": []})
    decision = explained_decision().to_json()
    decision["scores"]["replica-1"]["kv_cache"] = None
    record = {"id": "x", "route": "/v1/completions", "tenant": None, "stream": False, "arrived_at": NOW,
              "queue_wait_seconds": 0.0, "ttft_seconds": None, "e2e_seconds": None, "status": None, "outcome": None,
              "attempts": [{"replica": "replica-1", "started_after_seconds": 0.0, "queue_wait_seconds": 0.0,
                            "outcome": None, "reason": None, "decision": decision}], "migrations": []}
    out = format_request(record, now=NOW)
    assert "attempt 1: replica-1 at +0ms (queue wait 0ms): running" in out
    assert re.search(r"replica-1\*.*\s\?\s", out), out  # unknown score

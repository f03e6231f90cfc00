"""`POST /admin/reload` and `appliance reload`: re-read the start configuration, roll engine changes one replica at
a time, refuse what cannot roll (listing the keys), reject an invalid file; over restartable doubles."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.engine.settings import EngineSettings
from appliance.maintenance.reload import changed_keys
from appliance.settings import Settings, load_settings
from tests.maintenance.support import AUTH, actions, fleet, wait_idle

BASE = {"served_model_name": "demo", "replicas": 2, "admin_token": "t0ken", "collectors": {"enabled": False},
        "engine": {"max_num_seqs": 16}, "maintenance": {"restart_ready_timeout_seconds": 1}}


class StagingFleet:
    """The restartable doubles as a Reconfigurable fleet: records what each reload staged and unstaged."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas
        self.staged: list[EngineSettings] = []
        self.unstaged = 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stage(self, engine: EngineSettings) -> None:
        self.staged.append(engine)

    def unstage(self) -> None:
        self.unstaged += 1


@pytest.fixture
def reloadable(stubs, tmp_path):
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump(BASE))
    doubles = fleet([s.url for s in stubs])
    stager = StagingFleet(doubles)
    registry = CollectorRegistry()
    app = create_app(load_settings(config), fleet=stager, registry=registry)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, config, stager, registry


def edit(config: Path, **changes) -> None:
    data = yaml.safe_load(config.read_text())
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub:
            data.setdefault(section, {})[sub] = value
        else:
            data[section] = value
    config.write_text(yaml.safe_dump(data))


def test_engine_changes_roll_one_replica_at_a_time(reloadable):
    client, config, stager, registry = reloadable
    edit(config, engine__max_num_seqs=8, engine__extra_args=["--enforce-eager"])
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 202, response.text
    assert response.json()["changed"] == ["engine.extra_args", "engine.max_num_seqs"]
    wait_idle(client)
    assert [r.status.restarts for r in stager.replicas] == [1, 1]
    restarts = [e for e in stager.replicas[0].events if e[0] == "restart"]
    assert all(routable_others >= 1 for _, _, routable_others, _ in restarts)  # one at a time
    assert stager.staged[-1].max_num_seqs == 8
    assert actions(registry, "rolling_restart", "ok", trigger="admin") == 1
    # the same file again: nothing changed, nothing restarted
    again = client.post("/admin/reload", headers=AUTH)
    assert again.status_code == 200 and again.json()["changed"] == []
    wait_idle(client)
    assert [r.status.restarts for r in stager.replicas] == [1, 1]


def test_a_reload_whose_roll_stops_unstages_what_it_staged(reloadable):
    """Otherwise the bad settings the roll stopped on wait on every replica for its next crash or admin restart."""
    client, config, stager, registry = reloadable
    stager.replicas[0].comes_back = False  # the new extra_args keep the engine from starting
    edit(config, engine__extra_args=["--bad-flag"])
    assert client.post("/admin/reload", headers=AUTH).status_code == 202
    wait_idle(client)
    assert actions(registry, "rolling_restart", "aborted", trigger="admin") == 1
    assert len(stager.staged) == 1 and stager.unstaged == 1
    assert [r.status.restarts for r in stager.replicas] == [1, 0]
    # the running configuration is the previous one again: the same file is a change still to roll, not "nothing"
    assert context_of(client.app).maintenance.reloader.current.engine.extra_args == []
    stager.replicas[0].comes_back = True
    again = client.post("/admin/reload", headers=AUTH)
    assert again.status_code == 202 and again.json()["changed"] == ["engine.extra_args"]
    wait_idle(client)
    assert stager.unstaged == 1 and actions(registry, "rolling_restart", "ok", trigger="admin") == 1


@pytest.mark.parametrize(("changes", "keys"), [
    ({"port": 9001}, "port"),
    ({"replicas": 3}, "replicas"),
    ({"host": "0.0.0.0", "engine__max_num_seqs": 8}, "host"),
    ({"engine__tensor_parallel_size": 2}, "engine.tensor_parallel_size"),
    ({"engine__kv_events": "local"}, "engine.kv_events"),  # the gateway subscribed (or not) at start
    ({"admission__max_queue": 3}, "admission.max_queue"),
])
def test_changes_that_cannot_roll_are_refused_with_the_keys(reloadable, changes, keys):
    client, config, stager, _registry = reloadable
    edit(config, **changes)
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "reload_refused" and keys in error["message"] and "Nothing changed" in error["message"]
    assert "engine.max_num_seqs" not in error["message"]  # rollable keys are not listed as blockers
    assert stager.staged == [] and [r.status.restarts for r in stager.replicas] == [0, 0]


def test_an_invalid_file_is_a_400_and_changes_nothing(reloadable):
    client, config, stager, _registry = reloadable
    edit(config, engine__max_num_seqs=0)
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_config"
    assert "engine.max_num_seqs" in response.json()["error"]["message"]
    config.write_text("{not: yaml: [")
    assert client.post("/admin/reload", headers=AUTH).status_code == 400
    assert stager.staged == []


def test_reload_needs_the_admin_token_and_a_configuration_source(reloadable, make_app):
    client, *_ = reloadable
    assert client.post("/admin/reload").status_code == 401
    built_in_code, _replicas, _registry = make_app()  # settings not loaded from a source, engines not ours
    response = built_in_code.post("/admin/reload", headers=AUTH)
    assert response.status_code == 409 and response.json()["error"]["code"] == "reload_unavailable"


def test_values_the_start_command_filled_in_are_kept(stubs, tmp_path):
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "admin_token"}))
    settings = load_settings(config).replaced({"gateway.admin_token": "t0ken", "model": tmp_path})  # `up` does
    stager = StagingFleet(fleet([s.url for s in stubs]))
    with TestClient(create_app(settings, fleet=stager, registry=CollectorRegistry())) as client:
        edit(config, engine__max_num_seqs=4)
        response = client.post("/admin/reload", headers=AUTH)
        assert response.status_code == 202 and response.json()["changed"] == ["engine.max_num_seqs"]
        assert stager.staged[-1].max_num_seqs == 4  # the fleet stages the engine section alone
        current = context_of(client.app).maintenance.reloader.current
        assert current.model == tmp_path and current.gateway.admin_token == "t0ken"
        wait_idle(client)


def test_changed_keys_names_nested_keys():
    old, new = Settings(), Settings(engine={"max_num_seqs": 3}, port=9000)
    assert changed_keys(old, new) == ["engine.max_num_seqs", "gateway.port"]


def test_cli_reload_prints_what_changed(reloadable, monkeypatch, capsys):
    from appliance import admin_client
    from appliance.cli import admin as cli

    client, config, _stager, _registry = reloadable
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t0ken")
    monkeypatch.setattr(admin_client, "call",
                        lambda _url, method, path: client.request(method, path, headers=AUTH).json())
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    edit(config, engine__max_num_seqs=8)
    args = parser.parse_args(["reload"])
    assert args.handler(args) == 0
    assert "engine.max_num_seqs changed; rolling restart accepted" in capsys.readouterr().out
    wait_idle(client)


# -- tenants and keys: applied at once, quota levels kept ------------------------------------------------------------

TENANTS = [{"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 2},
           {"name": "team-b", "api_keys": ["key-b"]}]
COMPLETION = {"model": "demo", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def with_tenants(stubs, tmp_path):
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({**BASE, "tenants": TENANTS}))
    stager = StagingFleet(fleet([s.url for s in stubs]))
    with TestClient(create_app(load_settings(config), fleet=stager, registry=CollectorRegistry()),
                    raise_server_exceptions=False) as client:
        yield client, config, stager


def complete(client: TestClient, key: str) -> int:
    return client.post("/v1/completions", json=COMPLETION, headers={"authorization": f"Bearer {key}"}).status_code


def test_tenants_apply_at_once_and_quota_levels_survive(with_tenants):
    client, config, stager = with_tenants
    assert [complete(client, "key-a") for _ in range(3)] == [200, 200, 429]  # team-a's bucket is spent
    assert complete(client, "key-b") == 200
    edit(config, tenants=[{"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 3, "priority": 5},
                          {"name": "team-c", "api_keys": ["key-c"], "tokens_per_minute": 1000}])
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json() == {"action": "reload", "changed": ["tenants"], "rolling_restart": False}
    assert stager.staged == [] and [r.status.restarts for r in stager.replicas] == [0, 0]  # no restart
    assert complete(client, "key-a") == 429  # still spent: its level survived the new rate
    assert complete(client, "key-b") == 401  # a removed tenant's key is refused at once
    assert complete(client, "key-c") == 200  # a new one works at once
    ctx = context_of(client.app)
    assert ctx.gateway.tenants.get("team-a").priority == 5 and ctx.gateway.tenants.get("team-b") is None
    assert ctx.gateway.quotas.get("team-a").requests.capacity == 3
    assert [t.name for t in ctx.live.settings.tenants] == ["team-a", "team-c"]
    assert ctx.maintenance.reloader.current.tenants == ctx.live.settings.tenants
    # the same file again: nothing changed
    assert client.post("/admin/reload", headers=AUTH).json()["changed"] == []


def test_a_debt_survives_a_reload(with_tenants):
    client, config, _stager = with_tenants
    edit(config, tenants=[{"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 600}])
    assert client.post("/admin/reload", headers=AUTH).status_code == 200
    quotas = context_of(client.app).gateway.quotas
    quotas.get("team-a").tokens.charge(1000)  # the engine reported more than a minute's worth
    edit(config, tenants=[{"name": "team-a", "api_keys": ["key-a", "key-a2"], "tokens_per_minute": 1200}])
    assert client.post("/admin/reload", headers=AUTH).status_code == 200
    assert quotas.get("team-a").tokens.level < 0  # a tenant in debt stays in debt
    refused = client.post("/v1/completions", json=COMPLETION, headers={"authorization": "Bearer key-a2"})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_flat_api_keys_reload_at_once(with_tenants):
    client, config, _stager = with_tenants
    edit(config, api_keys=["flat-key"])
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 200 and response.json()["changed"] == ["gateway.api_keys"]
    assert complete(client, "flat-key") == 200
    assert context_of(client.app).gateway.tenants.identify("flat-key").name == "default"


def test_a_mixed_reload_applies_tenants_and_still_rolls(with_tenants):
    client, config, stager = with_tenants
    edit(config, engine__max_num_seqs=8, tenants=[{"name": "team-c", "api_keys": ["key-c"]}])
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 202, response.text
    assert response.json()["changed"] == ["engine.max_num_seqs", "tenants"]
    assert complete(client, "key-c") == 200 and complete(client, "key-a") == 401
    wait_idle(client)
    assert [r.status.restarts for r in stager.replicas] == [1, 1]
    assert stager.staged[-1].max_num_seqs == 8


def test_a_tenant_reload_with_a_key_that_cannot_roll_changes_nothing(with_tenants):
    client, config, stager = with_tenants
    edit(config, port=9001, tenants=[{"name": "team-c", "api_keys": ["key-c"]}])
    response = client.post("/admin/reload", headers=AUTH)
    assert response.status_code == 409 and "port" in response.json()["error"]["message"]
    assert response.json()["error"]["message"].startswith("cannot roll gateway.port onto")  # tenants are not a blocker
    assert complete(client, "key-c") == 401 and complete(client, "key-b") == 200


def test_cli_reload_says_tenants_applied_at_once(with_tenants, monkeypatch, capsys):
    from appliance import admin_client
    from appliance.cli import admin as cli

    client, config, _stager = with_tenants
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t0ken")
    monkeypatch.setattr(admin_client, "call",
                        lambda _url, method, path: client.request(method, path, headers=AUTH).json())
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    edit(config, tenants=[{"name": "team-c", "api_keys": ["key-c"]}])
    args = parser.parse_args(["reload"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "tenants changed; applied at once (no restart)" in out and "rolling" not in out

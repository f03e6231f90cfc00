"""Tenants in the settings and the directory that names a key's tenant: the foundation of accounting, quotas and
fair share, so its rules (one key one tenant, names fit for labels, default for the flat keys) are checked here."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from appliance.context import context_of
from appliance.gateway.tenants.directory import DEFAULT, TenantDirectory
from appliance.gateway.tenants.settings import DEFAULT_TENANT, TenantSettings
from appliance.settings import ConfigError, Settings, load_settings


def tenant(name: str, *keys: str, **extra) -> dict:
    return {"name": name, "api_keys": list(keys), **extra}


def test_tenants_from_json_in_the_environment(monkeypatch):
    monkeypatch.setenv("APPLIANCE_TENANTS", json.dumps([tenant("team-a", "ka", weight=2, tokens_per_minute=1000)]))
    settings = Settings()
    assert settings.tenants[0].name == "team-a" and settings.tenants[0].weight == 2
    assert settings.all_api_keys == ["ka"]


def test_keys_from_a_file_comments_and_blank_lines_skipped(tmp_path):
    keys = tmp_path / "team-a.keys"
    keys.write_text("# team a\nka1\n\nka2\n")
    settings = Settings(tenants=[{"name": "team-a", "api_keys_file": str(keys)}])
    assert settings.tenants[0].api_keys == ["ka1", "ka2"]


@pytest.mark.parametrize(("tenants", "flat", "why"), [
    ([tenant("a", "k"), tenant("a", "k2")], [], "unique"),
    ([tenant("a", "k"), tenant("b", "k")], [], "both a and b"),
    ([tenant("a", "k")], ["k"], "both default and a"),
    ([tenant("default", "k")], ["k0"], "flat api_keys"),
    ([tenant("a")], [], "no API key"),
    ([tenant("Team A", "k")], [], "pattern"),
    ([tenant("a", "k", weight=0)], [], "greater than 0"),
    ([tenant("a", "k", api_keys_file="/nonexistent/keys")], [], "both set"),
])
def test_conflicts_are_refused_naming_the_tenant_never_the_key(tenants, flat, why):
    with pytest.raises(ConfigError) as caught:
        load_settings(tenants=tenants, api_keys=flat)  # what `appliance` prints: keys and messages, no values
    assert why in str(caught.value)
    assert "'k'" not in str(caught.value) and "k0" not in str(caught.value)


def test_a_missing_keys_file_names_the_file(tmp_path):
    with pytest.raises(ValidationError, match="does not exist"):
        Settings(tenants=[{"name": "a", "api_keys_file": str(tmp_path / "nope")}])


def test_open_api_everyone_is_default():
    directory = TenantDirectory()
    assert directory.open and directory.identify(None) is DEFAULT and directory.identify("anything") is DEFAULT
    assert [t.name for t in directory.tenants()] == [DEFAULT_TENANT]


def test_flat_keys_are_the_default_tenant_and_tenants_their_own():
    directory = TenantDirectory([TenantSettings(name="team-a", api_keys=["ka"], priority=3, weight=2)], ["k0"])
    assert not directory.open
    assert directory.identify("k0") is DEFAULT
    team = directory.identify("ka")
    assert team is not None and (team.name, team.priority, team.weight) == ("team-a", 3, 2.0)
    assert directory.identify("nope") is None and directory.identify(None) is None
    assert [t.name for t in directory.tenants()] == ["default", "team-a"]


def test_without_flat_keys_there_is_no_default_tenant():
    directory = TenantDirectory([TenantSettings(name="team-a", api_keys=["ka"])])
    assert [t.name for t in directory.tenants()] == ["team-a"] and directory.identify("k0") is None


def test_update_replaces_keys_and_quotas():
    directory = TenantDirectory([TenantSettings(name="team-a", api_keys=["ka"])])
    directory.update([TenantSettings(name="team-b", api_keys=["kb"], requests_per_minute=5)])
    assert directory.identify("ka") is None
    assert directory.identify("kb").requests_per_minute == 5  # type: ignore[union-attr]


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                       st.lists(st.text(alphabet="xyz0123", min_size=1, max_size=6), min_size=1, max_size=4,
                                unique=True), min_size=1))
def test_every_key_names_exactly_its_tenant(assignment):
    """Whatever the keys, a valid configuration names each key's one tenant, and nothing else is a key."""
    owners: dict[str, str] = {}
    for name, keys in assignment.items():
        for key in keys:
            owners.setdefault(key, name)
    entries = [{"name": name, "api_keys": [k for k in keys if owners[k] == name] or [f"own-{name}"]}
               for name, keys in assignment.items()]
    directory = TenantDirectory([TenantSettings(**entry) for entry in entries])
    for entry in entries:
        for key in entry["api_keys"]:
            assert directory.identify(key).name == entry["name"]  # type: ignore[union-attr]
    assert directory.identify("not-a-key-!") is None


def test_the_api_names_the_tenant_of_the_key(make_client):
    """A request's tenant is its key's: admission is asked for a slot on that tenant's behalf (what fair share and
    accounting build on); an unknown key is a 401 before anything is queued."""
    client = make_client(tenants=[tenant("team-a", "ka")], api_keys=["k0"])
    admission = context_of(client.app).gateway.admission
    seen: list[str] = []
    acquire = admission.acquire

    async def recording(*args, tenant=DEFAULT, **kwargs):
        seen.append(tenant.name)
        return await acquire(*args, tenant=tenant, **kwargs)

    admission.acquire = recording
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    for key in ("ka", "k0"):
        response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    refused = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert seen == ["team-a", "default"]


def test_a_replaced_key_names_its_tenant_within_the_overlap_then_not():
    """A reload that gives a tenant a new key keeps the old one for ``overlap_seconds`` (its clients move over
    without a refused request); a removed tenant's keys are refused at once."""
    from tests.doubles import FakeClock

    clock = FakeClock()
    directory = TenantDirectory([TenantSettings(**tenant("team-a", "old-a")),
                                 TenantSettings(**tenant("team-b", "key-b"))], clock=clock)
    directory.update([TenantSettings(**tenant("team-a", "new-a", priority=3))], overlap_seconds=60)
    assert directory.identify("new-a").name == "team-a"
    assert directory.identify("old-a") == directory.get("team-a")  # the tenant as configured now (priority 3)
    assert directory.identify("old-a").priority == 3
    assert directory.identify("key-b") is None  # team-b was removed: revoked, not rotated
    clock.advance(61)
    assert directory.identify("old-a") is None and directory.identify("new-a").name == "team-a"


def test_without_overlap_a_replaced_key_is_refused_at_once():
    directory = TenantDirectory([TenantSettings(**tenant("team-a", "old-a"))])
    directory.update([TenantSettings(**tenant("team-a", "new-a"))], overlap_seconds=0)
    assert directory.identify("old-a") is None

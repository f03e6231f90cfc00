"""The admin token file is owner-only whatever was lying around in the state dir."""

from __future__ import annotations

import os
import stat

from appliance.admin_token import TOKEN_FILE, ensure_admin_token


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def mount_token_file(tmp_path, monkeypatch, variable: str, token: str) -> None:
    """``token`` in a file that ``variable`` names, the way compose and Kubernetes mount a secret."""
    mounted = tmp_path / "mounted-secret"
    mounted.write_text(token + "\n")
    monkeypatch.setenv(variable, str(mounted))


def test_a_stale_world_readable_temp_file_does_not_make_the_token_world_readable(tmp_path):
    stale = tmp_path / f".{TOKEN_FILE}.tmp"  # what an interrupted earlier write left behind
    stale.write_text("old\n")
    stale.chmod(0o644)
    token = ensure_admin_token(tmp_path)
    assert mode(tmp_path / TOKEN_FILE) == 0o600
    assert (tmp_path / TOKEN_FILE).read_text() == token + "\n" and len(token) == 32
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{TOKEN_FILE}.") and p != stale] == []


def test_an_existing_token_is_kept_and_narrowed_to_the_owner(tmp_path):
    path = tmp_path / TOKEN_FILE
    path.write_text("abc123\n")
    path.chmod(0o644)
    assert ensure_admin_token(tmp_path) == "abc123"
    assert mode(path) == 0o600


def test_an_empty_file_gets_a_new_token_under_a_permissive_umask(tmp_path):
    (tmp_path / TOKEN_FILE).write_text("")
    old = os.umask(0)
    try:
        token = ensure_admin_token(tmp_path)
    finally:
        os.umask(old)
    assert token and mode(tmp_path / TOKEN_FILE) == 0o600


def test_operator_commands_read_the_token_file_the_appliance_reads(tmp_path, monkeypatch) -> None:
    """Issue 21: compose and Kubernetes mount the admin token as a file (APPLIANCE_ADMIN_TOKEN_FILE): `appliance
    status` inside the container must find it there, before any token `appliance up` generated."""
    from appliance import admin_client

    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    (tmp_path / TOKEN_FILE).write_text("generated-by-up\n")
    mount_token_file(tmp_path, monkeypatch, "APPLIANCE_ADMIN_TOKEN_FILE", "from-secret-file")
    assert admin_client.admin_token() == "from-secret-file"
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "from-env")
    assert admin_client.admin_token() == "from-env"


def test_operator_commands_read_the_sectioned_token_variables_too(tmp_path, monkeypatch) -> None:
    """Issue 22: the appliance reads APPLIANCE_GATEWAY__ADMIN_TOKEN(_FILE) as well as the earlier names; so do
    `appliance status/drain/restart`, or an operator using the new names would be told there is no token."""
    from appliance import admin_client

    for name in ("APPLIANCE_ADMIN_TOKEN", "APPLIANCE_ADMIN_TOKEN_FILE", "APPLIANCE_METRICS_TOKEN",
                 "APPLIANCE_METRICS_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    mount_token_file(tmp_path, monkeypatch, "APPLIANCE_GATEWAY__ADMIN_TOKEN_FILE", "from-sectioned-file")
    assert admin_client.admin_token() == "from-sectioned-file"
    monkeypatch.setenv("APPLIANCE_GATEWAY__ADMIN_TOKEN", "from-sectioned-env")
    assert admin_client.admin_token() == "from-sectioned-env"
    monkeypatch.setenv("APPLIANCE_GATEWAY__METRICS_TOKEN", "metrics-sectioned")
    assert admin_client.metrics_token() == "metrics-sectioned"

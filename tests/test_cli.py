"""The command line's own logic: the embedded default's admin token, and how operator commands find it."""

from __future__ import annotations

import stat

from appliance import admin_client
from appliance.cli import ensure_admin_token, main


def test_up_generates_one_private_admin_token_and_keeps_it(tmp_path) -> None:
    token = ensure_admin_token(tmp_path / "state")
    path = tmp_path / "state" / "admin-token"
    assert len(token) == 32 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_admin_token(tmp_path / "state") == token  # reused across restarts
    assert not list((tmp_path / "state").glob(".*"))


def test_operator_commands_prefer_the_environment_then_the_state_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))
    assert admin_client.admin_token() is None
    (tmp_path / "admin-token").write_text("from-file\n")
    assert admin_client.admin_token() == "from-file"
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "from-env")
    assert admin_client.admin_token() == "from-env"


def test_restart_wants_a_replica_or_rolling_not_both(capsys) -> None:
    assert main(["restart"]) == 2
    assert main(["restart", "replica-0", "--rolling"]) == 2
    assert "REPLICA or --rolling" in capsys.readouterr().err


def test_monitoring_config_renders_a_bundle(tmp_path, capsys) -> None:
    assert main(["monitoring-config", "--out", str(tmp_path), "--gateway", "appliance:8000",
                 "--alertmanager", "alertmanager:9093"]) == 0
    assert "appliance:8000/sd/targets" in (tmp_path / "prometheus.yml").read_text()
    assert (tmp_path / "rules" / "alerts.rules.yaml").is_file()

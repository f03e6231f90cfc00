"""The command line's own logic: the embedded default's admin token, and how operator commands find it."""

from __future__ import annotations

import stat

from appliance import admin_client
from appliance.admin_token import ensure_admin_token
from appliance.cli import main


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


def test_the_token_file_is_found_from_any_directory(tmp_path, monkeypatch) -> None:
    from appliance import paths

    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("APPLIANCE_STATE_DIR", raising=False)
    monkeypatch.setattr(paths, "DEFAULT_STATE_DIR", tmp_path / "var")
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin-token").write_text("written-by-up\n")
    monkeypatch.chdir(tmp_path / "var")  # not the source tree's root: no ./var here
    assert admin_client.admin_token() == "written-by-up"


def test_user_errors_are_one_line_not_a_traceback(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("APPLIANCE_MODEL", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["config", "--engines"]) == 1  # no GPU on this host: a PlacementError
    err = capsys.readouterr().err
    assert err.startswith("appliance config: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["demo-model", "/proc/no/such/dir"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("appliance demo-model: ")
    assert main(["demo-model", "/proc/demo"]) == 1  # the parent exists, the folder cannot be made in it
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["appliance demo-model: cannot create /proc/demo: No such file or directory"]  # not the temp name


def test_demo_model_refuses_a_negative_budget_and_names_the_flag_to_overwrite(tmp_path, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["demo-model", str(tmp_path / "m"), "--train-seconds", "-1"])
    assert exited.value.code == 2
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert main(["demo-model", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err


def test_version_and_every_flag_of_every_command_has_help(capsys) -> None:
    import argparse

    import pytest

    from appliance.cli import build_parser

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("appliance ")
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"serve", "up", "status", "demo-model", "quantize", "plan", "bench", "capacity", "snapshot"} <= set(commands)
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.items() for action in sub._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []


def test_engine_extra_args_from_the_environment_split_like_a_shell(monkeypatch) -> None:
    from appliance.settings import load_settings

    monkeypatch.setenv("APPLIANCE_ENGINE__EXTRA_ARGS", "--enforce-eager --served-model-name 'a b'")
    assert load_settings(None).engine.extra_args == ["--enforce-eager", "--served-model-name", "a b"]
    monkeypatch.setenv("APPLIANCE_ENGINE__EXTRA_ARGS", '["--seed", "1"]')
    assert load_settings(None).engine.extra_args == ["--seed", "1"]

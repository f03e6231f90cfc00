"""The command line's own logic: the embedded default's admin token, and how operator commands find it."""

from __future__ import annotations

import stat

import pytest

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
    (tmp_path / "config.json").write_text("{}")  # a checkpoint: its max_model_len is read from it
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
    assert main(["demo-model", str(tmp_path / "m")]) == 2
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


def _commands() -> dict:
    import argparse

    from appliance.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_has_a_description_and_its_help_no_empty_or_misleading_defaults() -> None:
    import argparse

    problems = []
    for name, parser in _commands().items():
        if not (parser.description or "").strip():
            problems.append(f"{name}: no description")
        text = parser.format_help()
        if "(default: None)" in text:
            problems.append(f"{name}: (default: None)")
        for action in parser._actions:  # a flag's default is the opposite of what giving it does: say nothing
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                flag = action.option_strings[-1]
                line = next(line for line in text.splitlines() if flag in line)
                after = text[text.index(line):].split("\n  -")[0]
                if "(default: " in after:
                    problems.append(f"{name} {flag}: {after.split('(default: ')[1].split(')')[0]}")
    assert problems == []


def test_every_url_option_takes_the_shared_url_type() -> None:
    from appliance.cli import argtypes

    shared = {argtypes.http_url, argtypes.host_port, argtypes.optional_host_port}
    untyped = [f"{name} {action.option_strings[0]}" for name, parser in _commands().items()
               for action in parser._actions
               if action.dest in {"url", "gateway", "alertmanager", "metrics_url"} and action.type not in shared]
    assert untyped == []


@pytest.mark.parametrize("url", ["nonsense", "http://", "ftp://h:1", "h:99999"])
def test_a_bad_url_is_a_usage_error_not_a_traceback(url, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--url", url])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--url" in err


def test_urls_take_the_form_monitoring_config_takes(tmp_path, monkeypatch, capsys) -> None:
    from appliance import admin_client

    seen = []
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t")
    monkeypatch.setattr(admin_client, "call", lambda url, method, path: seen.append(url) or {"changed": []})
    assert main(["reload", "--url", "localhost:8000"]) == 0
    assert seen == ["http://localhost:8000"]
    assert main(["monitoring-config", "--out", str(tmp_path), "--gateway", "http://appliance:8000",
                 "--alertmanager", ""]) == 0
    assert "appliance:8000/sd/targets" in (tmp_path / "prometheus.yml").read_text()


def test_bad_input_exits_2_as_exit_codes_says(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("APPLIANCE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path / "nowhere"))
    assert main(["status"]) == 2  # no admin token: nothing was sent
    assert "APPLIANCE_ADMIN_TOKEN" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "nothere"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance quantize: ") and "nothere" in err and not (tmp_path / "dst").exists()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("")
    assert main(["demo-model", str(tmp_path / "m")]) == 2


def test_an_unreachable_appliance_is_exit_1(monkeypatch, capsys) -> None:
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "t")
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err

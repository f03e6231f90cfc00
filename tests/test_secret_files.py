"""Secrets from files: each *_file setting fills its secret, read whenever settings are built; a secret
set both ways, or a file that cannot give one, stops the appliance at start (exit 2) naming the file, never
printing its content."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.secret_files import SECRET_PAIRS, SecretPair
from appliance.settings import ConfigError, Settings, load_settings

REPO = Path(__file__).resolve().parents[1]


def secret(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def given(pair: SecretPair, values: dict[str, object]) -> dict[str, object]:
    """Settings arguments for keys of ``pair``: top-level for the keys that were (earlier names), else sectioned."""
    return values if pair.flat else {"gateway": values}


@pytest.mark.parametrize("pair", SECRET_PAIRS, ids=lambda p: p.value)
def test_every_secret_comes_from_its_file_and_the_file_wins_nothing_when_both_are_set(tmp_path, pair) -> None:
    path = secret(tmp_path, pair.file, "  s3cret-value\n")
    loaded = load_settings(**given(pair, {pair.file: path}))
    assert getattr(loaded.gateway, pair.value) == (["s3cret-value"] if pair.many else "s3cret-value")
    with pytest.raises(ConfigError) as both:
        load_settings(**given(pair, {pair.file: path, pair.value: ["other"] if pair.many else "other"}))
    assert pair.value in str(both.value) and pair.file in str(both.value) and "s3cret" not in str(both.value)
    assert pair.env in str(both.value)  # the variable the operator sets it with


@pytest.mark.parametrize("pair", SECRET_PAIRS, ids=lambda p: p.value)
def test_a_missing_empty_or_unreadable_file_is_a_config_error_naming_it(tmp_path, pair) -> None:
    missing = tmp_path / "nope"
    empty = secret(tmp_path, "empty", "\n  \n")
    directory = tmp_path / "a-directory"
    directory.mkdir()
    for path, why in ((missing, "does not exist"), (empty, "empty"), (directory, "cannot be read")):
        with pytest.raises(ConfigError) as error:
            load_settings(**given(pair, {pair.file: path}))
        assert str(path) in str(error.value) and why in str(error.value) and pair.file in str(error.value)


def test_the_api_keys_file_holds_one_key_a_line_with_comments_and_blank_lines_ignored(tmp_path) -> None:
    path = secret(tmp_path, "keys", "# the team's keys\nkey-one\n\n  key-two  \n# key-three (revoked)\n")
    assert Settings(api_keys_file=path).gateway.api_keys == ["key-one", "key-two"]
    with pytest.raises(ConfigError, match="holds no key"):
        load_settings(api_keys_file=secret(tmp_path, "only-comments", "# none yet\n"))


def test_files_are_read_again_when_the_configuration_is(tmp_path) -> None:
    """`appliance reload` rebuilds the settings from their source: a rotated file is what it sees."""
    path = secret(tmp_path, "token", "first")
    loaded = load_settings(admin_token_file=path)
    path.write_text("second\n")
    assert loaded.source is not None and loaded.source.load().gateway.admin_token == "second"


def test_the_environment_names_files_and_the_cli_exits_2_with_a_clear_message(tmp_path) -> None:
    path = secret(tmp_path, "token", "s3cret-in-file")
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    cli = str(Path(sys.executable).parent / "appliance")
    run = lambda extra: subprocess.run([cli, "config"], env={**env, **extra},  # noqa: E731
                                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    ok = run({"APPLIANCE_METRICS_TOKEN_FILE": str(path), "APPLIANCE_STATE_DIR": str(tmp_path)})
    assert ok.returncode == 0, ok.stderr
    assert "s3cret-in-file" not in ok.stdout and "metrics_token: <redacted>" in ok.stdout
    both = run({"APPLIANCE_ALERTS_TOKEN": "x", "APPLIANCE_ALERTS_TOKEN_FILE": str(path)})
    assert both.returncode == 2
    assert "alerts_token and alerts_token_file are both set" in both.stderr and "s3cret" not in both.stderr
    gone = run({"APPLIANCE_ADMIN_TOKEN_FILE": str(tmp_path / "gone")})
    assert gone.returncode == 2 and f"admin_token_file: {tmp_path / 'gone'} does not exist" in gone.stderr


def test_an_empty_file_setting_is_unset_like_an_empty_model(monkeypatch) -> None:
    """Compose passes an unset variable as "": that names no file (it would read the current folder)."""
    monkeypatch.setenv("APPLIANCE_API_KEYS_FILE", "")
    assert load_settings().gateway.api_keys_file is None

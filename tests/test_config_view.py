"""`appliance config` redacts secrets wherever they are: named keys, URLs with credentials, vLLM flags."""

from __future__ import annotations

import yaml

from appliance.config_view import REDACTED, config_dump, redact_argv
from appliance.settings import Settings

SECRETS = ("s3cr3t", "hunter2", "tok-xyz", "hf_abc", "k1")


def settings() -> Settings:
    return Settings(
        api_keys=["k1"], admin_token="tok-xyz",
        engine_urls=["http://user:hunter2@127.0.0.1:8100"],
        otlp_traces_endpoint="http://otel:s3cr3t@127.0.0.1:4318/v1/traces?access_token=s3cr3t&x=1",
        engine={"extra_args": ["--api-key", "s3cr3t", "--hf-token=hf_abc", "--enforce-eager"]},
        maintenance={"grafana_url": "http://admin:hunter2@127.0.0.1:3000", "grafana_token": "tok-xyz"},
    )


def test_no_secret_is_printed_by_default():
    text = yaml.safe_dump(config_dump(settings()))
    assert not [s for s in SECRETS if s in text], text
    data = config_dump(settings())
    assert data["engine"]["extra_args"] == ["--api-key", REDACTED, f"--hf-token={REDACTED}", "--enforce-eager"]
    assert data["engine_urls"] == [f"http://user:{REDACTED}@127.0.0.1:8100"]
    assert data["otlp_traces_endpoint"].endswith(f"/v1/traces?access_token={REDACTED}&x=1")
    assert data["maintenance"]["grafana_url"] == f"http://admin:{REDACTED}@127.0.0.1:3000"


def test_show_secrets_prints_them():
    text = yaml.safe_dump(config_dump(settings(), show_secrets=True))
    assert all(s in text for s in SECRETS)


def test_plain_values_are_untouched():
    assert redact_argv(["--max-num-seqs", "8", "http://127.0.0.1:8100/x?y=1"]) == \
        ["--max-num-seqs", "8", "http://127.0.0.1:8100/x?y=1"]


def test_appliance_config_prints_the_effective_served_name_and_length(tmp_path, monkeypatch, capsys):
    """Issue 19: unset, they default as vLLM's do; `appliance config` shows the values the engines get."""
    from appliance.cli import main

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    for key in [k for k in __import__("os").environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("APPLIANCE_MODEL", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_DEVICE", "cpu")
    assert main(["config", "--engines"]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    assert shown["served_model_name"] == str(tmp_path) and shown["engine"]["max_model_len"] == 4096
    assert f"--served-model-name {tmp_path} " in out and "--max-model-len 4096 " in out

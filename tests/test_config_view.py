"""`appliance config` redacts secrets wherever they are: named keys, URLs with credentials, vLLM flags."""

from __future__ import annotations

import json

import yaml

from appliance.config_view import REDACTED, config_dump, redact_argv
from appliance.settings import Settings

SECRETS = ("s3cr3t", "hunter2", "tok-xyz", "hf_abc", "k1", "team-key-9")


def settings() -> Settings:
    return Settings(
        api_keys=["k1"], admin_token="tok-xyz", tenants=[{"name": "team-a", "api_keys": ["team-key-9"]}],
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
    assert data["discovery"]["engine_urls"] == [f"http://user:{REDACTED}@127.0.0.1:8100"]
    assert data["gateway"]["otlp_traces_endpoint"].endswith(f"/v1/traces?access_token={REDACTED}&x=1")
    assert data["maintenance"]["grafana_url"] == f"http://admin:{REDACTED}@127.0.0.1:3000"
    assert data["tenants"][0] == {**data["tenants"][0], "name": "team-a", "api_keys": [REDACTED]}


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


def test_role_tokens_and_secret_files_are_redacted_but_the_file_paths_shown(tmp_path):
    """Issue 21: the alerts and metrics tokens are secrets like the admin token; a *_file setting is only a path."""
    (tmp_path / "metrics").write_text("m-s3cr3t\n")
    data = config_dump(Settings(alerts_token="a-s3cr3t", metrics_token_file=tmp_path / "metrics"))
    assert data["gateway"]["alerts_token"] == REDACTED and data["gateway"]["metrics_token"] == REDACTED
    assert data["gateway"]["metrics_token_file"] == str(tmp_path / "metrics")
    assert "s3cr3t" not in yaml.safe_dump(data)


def test_a_token_used_as_a_url_user_name_is_redacted():
    """Issue 21: ``http://tok@host`` (a token as the user name, no password) printed the token."""
    data = config_dump(Settings(otlp_traces_endpoint="http://tok-xyz@127.0.0.1:4318/v1/traces",
                                engine_urls=["http://u:hunter2@127.0.0.1:8100"]))
    assert data["gateway"]["otlp_traces_endpoint"] == f"http://{REDACTED}@127.0.0.1:4318/v1/traces"
    assert data["discovery"]["engine_urls"] == [f"http://u:{REDACTED}@127.0.0.1:8100"]


def test_credentials_inside_k_v_arguments_and_urls_inside_flags_are_redacted():
    argv = ["--api-key=s3cr3t", "token=tok-xyz", "--hf-overrides=user=me,password=hunter2", "secret: hf_abc",
            "--otlp-traces-endpoint=http://tok-xyz@otel:4318", "--header", "Authorization: Bearer s3cr3t",
            "--max-num-batched-tokens=4096", "--tokenizer=/models/tok", "--max-num-seqs", "8"]
    shown = redact_argv(argv)
    assert not [s for s in SECRETS if s in " ".join(shown)], shown
    assert shown[0] == f"--api-key={REDACTED}" and shown[1] == f"token={REDACTED}"
    assert shown[2] == f"--hf-overrides=user=me,password={REDACTED}"
    assert shown[4] == f"--otlp-traces-endpoint=http://{REDACTED}@otel:4318"
    assert shown[-4:] == ["--max-num-batched-tokens=4096", "--tokenizer=/models/tok", "--max-num-seqs", "8"]


def test_json_values_in_extra_args_keep_their_shape_with_secret_values_redacted():
    import json

    config = {"kv_connector": "x", "kv_connector_extra_config": {"api_key": "s3cr3t", "url": "http://u:hunter2@h",
                                                                   "nested": [{"password": "hunter2"}], "size": 3}}
    plain = '{"max_loras": 2}'
    extra = ["--kv-transfer-config", json.dumps(config), f"--hf-overrides={plain}", f"--speculative-config={plain}"]
    data = config_dump(Settings(engine={"extra_args": extra}))
    shown = data["engine"]["extra_args"]
    assert not [s for s in SECRETS if s in " ".join(shown)], shown
    redacted = json.loads(shown[1])
    assert redacted["kv_connector_extra_config"]["api_key"] == REDACTED
    assert redacted["kv_connector_extra_config"]["nested"] == [{"password": REDACTED}]
    assert redacted["kv_connector_extra_config"]["size"] == 3 and redacted["kv_connector"] == "x"
    assert shown[2:] == [f"--hf-overrides={plain}", f"--speculative-config={plain}"]  # untouched, byte for byte


def test_redaction_never_leaks_a_secret_whatever_the_flag_shape():
    """Invariant: a secret in any of the shapes a flag can take never survives redact_argv."""
    secret = "Zq9-s3cr3t"
    shapes = [["--api-key", secret], [f"--api-key={secret}"], [f"api_key={secret}"], [f"--x=token={secret}"],
              [f"http://{secret}@h:1"], [f"http://u:{secret}@h:1/p"], [f"http://h/p?access_token={secret}"],
              ["--cfg", json.dumps({"auth": {"password": secret}})], [f"--cfg={json.dumps({'token': secret})}"],
              [f"--endpoint=https://user:{secret}@h"], ["--x", f"password: {secret}"]]
    for argv in shapes:
        assert secret not in " ".join(redact_argv(argv)), argv


def test_the_lease_token_and_the_engine_key_are_secrets_too(tmp_path, monkeypatch, capsys):
    """The engine key is redacted as a setting and where the engines get it (VLLM_API_KEY in `--engines`), and
    never on their command line, which any local user reads in /proc/<pid>/cmdline."""
    from appliance.cli import main

    data = config_dump(Settings(gateway={"lease_token": "lease-s3cr3t", "engine_key": "engine-s3cr3t"}))
    assert data["gateway"]["lease_token"] == REDACTED and data["gateway"]["engine_key"] == REDACTED
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    (tmp_path / "engine-key").write_text("engine-s3cr3t\n")
    for key in [k for k in __import__("os").environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("APPLIANCE_MODEL", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_DEVICE", "cpu")
    monkeypatch.setenv("APPLIANCE_GATEWAY__ENGINE_KEY_FILE", str(tmp_path / "engine-key"))
    assert main(["config", "--engines"]) == 0
    out = capsys.readouterr().out
    assert "engine-s3cr3t" not in out and f"VLLM_API_KEY={REDACTED}" in out
    assert "--middleware appliance.engine.guard.EngineKeyGuard" in out
    assert main(["config", "--engines", "--show-secrets"]) == 0
    shown = capsys.readouterr().out
    assert "VLLM_API_KEY=engine-s3cr3t" in shown and "--api-key" not in shown

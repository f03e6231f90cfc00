from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.settings import FLAT_ALIASES, ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("APPLIANCE_"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "appliance.yaml"
    path.write_text(text)
    return path


def test_defaults_match_the_contract():
    settings = load_settings()
    assert settings.gateway.port == 8000
    assert settings.gateway.host == "127.0.0.1"
    assert settings.gateway.api_keys == []
    assert settings.engine.max_model_len > 0


def test_yaml_then_environment_wins(tmp_path, monkeypatch):
    config = write(tmp_path, "replicas: 2\nengine:\n  max_model_len: 512\n  max_num_seqs: 4\n")
    monkeypatch.setenv("APPLIANCE_ENGINE__MAX_MODEL_LEN", "256")
    monkeypatch.setenv("APPLIANCE_API_KEYS", "k1, k2")
    settings = load_settings(config)
    assert settings.replicas == 2
    assert settings.engine.max_model_len == 256
    assert settings.engine.max_num_seqs == 4
    assert settings.gateway.api_keys == ["k1", "k2"]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("replicas: 0\n", "replicas"),
        ("engine:\n  max_model_len: many\n", "engine.max_model_len"),
        ("no_such_key: 1\n", "no_such_key"),
        ("engine:\n  typo_len: 1\n", "typo_len"),
        ("port: 8100\nengine_base_port: 8100\n", "collides"),
        ("- a list\n", "mapping"),
        ("replicas: [\n", "not valid YAML"),
    ],
)
def test_invalid_config_is_a_clear_error(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_settings(write(tmp_path, text))


SECRET = "s3cret-Do-Not-Echo"


@pytest.mark.parametrize("text", [
    f'admin_token: "{SECRET}\nreplicas: [\n',  # an unterminated quote: PyYAML quotes the line
    f"api_keys: [{SECRET}\nport: 80: 81\n",
    f"metrics_token: {SECRET}: x\n",
    f"admin_token: *{SECRET}\n",  # an undefined alias: PyYAML names it
    f"admin_token: {SECRET}\n\tport: 1\n",  # a tab: PyYAML quotes the character and the line
])
def test_a_yaml_error_names_file_line_and_column_never_the_text(tmp_path, text):
    """Its message goes to the CLI, the logs and /admin/reload's answer: it must not carry a secret."""
    with pytest.raises(ConfigError) as raised:
        load_settings(write(tmp_path, text))
    message = str(raised.value)
    assert SECRET not in message and "s3cret" not in message
    assert "appliance.yaml is not valid YAML" in message and "line " in message and "column " in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize("text", [
    f"admin_token: [{SECRET}]\n",
    f"gateway:\n  metrics_token: {{x: {SECRET}}}\n",
    f"api_keys: {{{SECRET}: 1}}\n",
    f"tenants: [{{name: a, api_keys: [{SECRET}], weight: heavy}}]\n",
    f"tenants: [{{name: {SECRET}!, api_keys: [k]}}]\n",
    f"gateway:\n  alerts_token: {SECRET}\n  secret_overlap_seconds: -{SECRET}\n",
])
def test_a_validation_error_never_echoes_an_input_value(tmp_path, text):
    with pytest.raises(ConfigError) as raised:
        load_settings(write(tmp_path, text))
    assert SECRET not in str(raised.value) and raised.value.__cause__ is None


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.yaml")


def test_invalid_environment_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("APPLIANCE_PORT", "eighty")
    with pytest.raises(ConfigError, match="port"):
        load_settings()


def test_an_fp8_kv_cache_is_one_byte_per_element_for_the_collectors(monkeypatch):
    monkeypatch.setenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE", "fp8")
    assert load_settings(None).collectors.kv_cache_dtype_bytes == 1
    monkeypatch.setenv("APPLIANCE_COLLECTORS__KV_CACHE_DTYPE_BYTES", "2")  # the operator's word wins
    assert load_settings(None).collectors.kv_cache_dtype_bytes == 2
    monkeypatch.delenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE")
    monkeypatch.delenv("APPLIANCE_COLLECTORS__KV_CACHE_DTYPE_BYTES")
    assert load_settings(None).collectors.kv_cache_dtype_bytes is None


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_model_variable_is_no_model_not_the_current_folder(monkeypatch, value):
    monkeypatch.setenv("APPLIANCE_MODEL", value)  # compose passes an unset ${APPLIANCE_MODEL} as ""
    assert load_settings().model is None


def test_engine_log_limits_are_bounded(monkeypatch):
    monkeypatch.setenv("APPLIANCE_ENGINE_LOG_MAX_BYTES", "100")
    with pytest.raises(ConfigError, match="engine_log_max_bytes"):
        load_settings()


# -- served name and max_model_len default as vLLM's do ------------------------------------------------

def _checkpoint(tmp_path: Path, **config) -> Path:
    import json

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return model


def test_without_a_model_the_demo_defaults_hold():
    settings = load_settings()
    assert settings.served_model_name == "demo"
    assert settings.engine.max_model_len == 1024


def test_with_a_model_the_served_name_is_its_path_and_the_length_its_own(tmp_path, monkeypatch):
    model = _checkpoint(tmp_path, max_position_embeddings=8192)
    monkeypatch.setenv("APPLIANCE_MODEL", str(model))
    settings = load_settings()
    assert settings.served_model_name == str(model)  # vLLM: --served-model-name defaults to --model
    assert settings.engine.max_model_len == 8192  # vLLM: the model's own limit


def test_explicit_values_win_over_the_derived_ones(tmp_path, monkeypatch):
    model = _checkpoint(tmp_path, max_position_embeddings=8192)
    config = write(tmp_path, f"model: {model}\nserved_model_name: llama\nengine:\n  max_model_len: 2048\n")
    settings = load_settings(config)
    assert (settings.served_model_name, settings.engine.max_model_len) == ("llama", 2048)
    monkeypatch.setenv("APPLIANCE_ENGINE__MAX_MODEL_LEN", "4096")
    assert load_settings(config).engine.max_model_len == 4096


@pytest.mark.parametrize(("config", "expected"), [
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),  # vLLM takes the smallest limit given
    ({"n_positions": 1024}, 1024),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8192),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"max_position_embeddings": 32768,
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
    ({"text_config": {"max_position_embeddings": 16384}}, 16384),
    ({}, 2048),  # no limit in the config: vLLM's fallback
])
def test_the_derived_length_follows_vllm(tmp_path, monkeypatch, config, expected):
    monkeypatch.setenv("APPLIANCE_MODEL", str(_checkpoint(tmp_path, **config)))
    assert load_settings().engine.max_model_len == expected


def test_an_unreadable_model_config_with_no_length_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_MODEL", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="engine.max_model_len"):
        load_settings()
    monkeypatch.setenv("APPLIANCE_ENGINE__MAX_MODEL_LEN", "512")  # given explicitly, nothing needs reading
    settings = load_settings()
    assert settings.engine.max_model_len == 512 and settings.served_model_name == str(tmp_path / "missing")


def test_reload_sees_the_derived_values_unchanged(tmp_path, monkeypatch):
    from appliance.maintenance.reload import changed_keys

    monkeypatch.setenv("APPLIANCE_MODEL", str(_checkpoint(tmp_path, max_position_embeddings=8192)))
    settings = load_settings()
    assert changed_keys(settings, settings.source.load()) == []


# -- sections follow the package map; the earlier top-level names keep working ---------------------------

# A valid value for each earlier key, as the environment would give it, and as the section then holds it.
SAMPLES: dict[str, tuple[str, object]] = {
    "host": ("0.0.0.0", "0.0.0.0"), "port": ("8001", 8001), "api_keys": ("k1,k2", ["k1", "k2"]),
    "admin_token": ("adm", "adm"), "alerts_token": ("al", "al"), "metrics_token": ("met", "met"),
    "slo_ttft_p95_seconds": ("0.5", 0.5), "drain_timeout_seconds": ("30", 30.0),
    "request_timeout_seconds": ("90", 90.0), "upstream_idle_timeout_seconds": ("20", 20.0),
    "max_request_bytes": ("4096", 4096), "otlp_traces_endpoint": ("http://otel:4318/v1/traces",
                                                                  "http://otel:4318/v1/traces"),
    "trace_sample_ratio": ("0.25", 0.25), "engine_base_port": ("9100", 9100), "engine_host": ("0.0.0.0", "0.0.0.0"),
    "engine_advertise_host": ("appliance", "appliance"), "engine_log_max_bytes": ("4096", 4096),
    "engine_log_backups": ("2", 2), "engine_log_stdout": ("true", True),
    "restart_backoff_initial_seconds": ("2", 2.0), "restart_backoff_max_seconds": ("30", 30.0),
    "engine_urls": ("http://a:8100, http://b:8100", ["http://a:8100", "http://b:8100"]),
}
FILE_KEYS = {"api_keys_file", "admin_token_file", "alerts_token_file", "metrics_token_file"}  # test_secret_files


def test_every_earlier_name_has_a_sample_or_is_a_secret_file():
    assert set(FLAT_ALIASES) == set(SAMPLES) | FILE_KEYS


@pytest.mark.parametrize("flat", sorted(SAMPLES))
def test_every_earlier_name_works_in_the_environment_and_the_file(flat, tmp_path, monkeypatch):
    section, key = FLAT_ALIASES[flat]
    raw, expected = SAMPLES[flat]
    monkeypatch.setenv(f"APPLIANCE_{flat.upper()}", raw)
    assert getattr(getattr(load_settings(), section), key) == expected
    monkeypatch.delenv(f"APPLIANCE_{flat.upper()}")
    import yaml

    loaded = load_settings(write(tmp_path, yaml.safe_dump({flat: expected})))
    assert getattr(getattr(loaded, section), key) == expected
    assert getattr(getattr(Settings(**{flat: expected}), section), key) == expected


def test_both_spellings_in_one_source_are_refused_naming_both(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"port and gateway\.port are both set in .*appliance\.yaml"):
        load_settings(write(tmp_path, "port: 8001\ngateway:\n  port: 8002\n"))
    monkeypatch.setenv("APPLIANCE_ENGINE_BASE_PORT", "9100")
    monkeypatch.setenv("APPLIANCE_ENGINE__BASE_PORT", "9200")
    with pytest.raises(ConfigError, match=r"engine_base_port and engine\.base_port are both set in the environment"):
        load_settings()


def test_an_invalid_value_names_the_key_and_its_earlier_name(monkeypatch):
    monkeypatch.setenv("APPLIANCE_PORT", "0")
    with pytest.raises(ConfigError, match=r"gateway\.port \(earlier name port\)"):
        load_settings()


PRECEDENCE = ("file", "env", "argument")  # lowest first


@given(st.lists(st.tuples(st.sampled_from(PRECEDENCE), st.booleans()), min_size=1, max_size=6,
                unique_by=lambda given: given[0]),
       st.sampled_from(["port", "engine_base_port", "drain_timeout_seconds", "engine_log_backups"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_highest_source_wins_whichever_spelling_each_uses(tmp_path, monkeypatch, givens, flat):
    """Invariant: each source gives the key once, under its earlier or its sectioned name; the value read is the
    one of the highest source that gave it, whatever names the others used."""
    import yaml

    section, key = FLAT_ALIASES[flat]
    values = {source: 9000 + 7 * index + 2 for index, source in enumerate(PRECEDENCE)}  # far from each other
    file: dict[str, object] = {}
    arguments: dict[str, object] = {}
    with monkeypatch.context() as env:
        for source, earlier in givens:
            value = values[source]
            if source == "env":
                env.setenv(f"APPLIANCE_{flat.upper()}" if earlier else f"APPLIANCE_{section.upper()}__{key.upper()}",
                           str(value))
            else:
                target = file if source == "file" else arguments
                if earlier:
                    target[flat] = value
                else:
                    target[section] = {key: value}
        path = write(tmp_path, yaml.safe_dump(file)) if file else None
        loaded = load_settings(path, **arguments)
    winner = max((source for source, _ in givens), key=PRECEDENCE.index)
    assert getattr(getattr(loaded, section), key) == values[winner]


def test_a_copy_refuses_keys_that_are_not_settings():
    """Issue 22: `appliance up` filled its generated admin token with model_copy(update={"admin_token": ...}) after
    the key moved into the gateway section: pydantic kept a stray attribute and /admin stayed off. A copy now
    refuses such a key; a section's key goes through replaced()."""
    settings = Settings()
    with pytest.raises(KeyError, match="admin_token"):
        settings.model_copy(update={"admin_token": "t0ken"})
    with pytest.raises(KeyError, match="not keys of gateway: admin_tokn"):
        settings.replaced({"gateway.admin_tokn": "t0ken"})
    filled = settings.replaced({"gateway.admin_token": "t0ken", "replicas": 2})
    assert filled.gateway.admin_token == "t0ken" and filled.replicas == 2 and settings.gateway.admin_token is None
    assert filled.credentials.admin_token == "t0ken"

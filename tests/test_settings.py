from pathlib import Path

import pytest

from appliance.settings import ConfigError, load_settings


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
    assert settings.port == 8000
    assert settings.host == "127.0.0.1"
    assert settings.api_keys == []
    assert settings.engine.max_model_len > 0


def test_yaml_then_environment_wins(tmp_path, monkeypatch):
    config = write(tmp_path, "replicas: 2\nengine:\n  max_model_len: 512\n  max_num_seqs: 4\n")
    monkeypatch.setenv("APPLIANCE_ENGINE__MAX_MODEL_LEN", "256")
    monkeypatch.setenv("APPLIANCE_API_KEYS", "k1, k2")
    settings = load_settings(config)
    assert settings.replicas == 2
    assert settings.engine.max_model_len == 256
    assert settings.engine.max_num_seqs == 4
    assert settings.api_keys == ["k1", "k2"]


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


# -- issue 19: served name and max_model_len default as vLLM's do ------------------------------------------------

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

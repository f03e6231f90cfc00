"""The one model-shape reader, shared by the planner and the roofline collector."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.model.shape import (
    KV_CACHE_DTYPES,
    ShapeError,
    dtype_bytes,
    kv_cache_dtype_bytes,
    load_model_shape,
    shape_from_config,
)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "torch_dtype": "bfloat16"}


def test_llama_shape_and_kv_bytes() -> None:
    shape = shape_from_config(LLAMA3_8B, "llama")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (32, 8, 128, 2)
    assert shape.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert shape.kv_bytes_per_token(1) == 2 * 32 * 8 * 128
    assert shape.kv_bytes_per_token(2, tensor_parallel_size=2) == 2 * 32 * 4 * 128 * 2
    assert shape.kv_bytes_per_token(2, tensor_parallel_size=16) == 2 * 32 * 1 * 128 * 2  # heads replicated


def test_fields_a_config_may_spell_differently() -> None:
    fp32 = shape_from_config({**LLAMA3_8B, "torch_dtype": "float32"})
    assert fp32.dtype_bytes == 4 and fp32.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 4
    assert shape_from_config({**LLAMA3_8B, "torch_dtype": None, "dtype": "float16"}).dtype_bytes == 2
    nested = shape_from_config({"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA3_8B})
    assert nested.num_layers == 32 and nested.vocab_size == 128256
    mha = shape_from_config({"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8})
    assert mha.num_kv_heads == 8 and mha.head_dim == 64 and mha.vocab_size == 0  # vocab: the planner checks
    quantized = shape_from_config({**LLAMA3_8B, "quantization_config": {"quant_method": "compressed-tensors"}})
    assert quantized.quantized == "compressed-tensors"


def test_dtype_tables() -> None:
    assert [dtype_bytes(n) for n in ("float32", "bf16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")] == [4, 2, 2, 1,
                                                                                                       1, 1]
    assert kv_cache_dtype_bytes("auto", 2) == 2 and kv_cache_dtype_bytes("auto", 4) == 4
    assert all(kv_cache_dtype_bytes(name, 2) == 1 for name in KV_CACHE_DTYPES[1:])
    with pytest.raises(ShapeError, match="unknown dtype 'int4'"):
        dtype_bytes("int4")


def test_engine_setting_accepts_exactly_the_readers_kv_dtypes() -> None:
    from typing import get_args

    from appliance.engine.settings import EngineSettings

    assert get_args(EngineSettings.model_fields["kv_cache_dtype"].annotation) == KV_CACHE_DTYPES


def test_load_model_shape_from_dir_or_file(tmp_path: Path) -> None:
    model = tmp_path / "Meta-Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_model_shape(model).name == "Meta-Llama-3-8B"
    assert load_model_shape(model / "config.json") == load_model_shape(model)
    other = tmp_path / "llama.json"
    other.write_text(json.dumps(LLAMA3_8B))
    assert load_model_shape(other).name == "llama"


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (b"\xff\xfe", "not UTF-8"),
    ("{}", "lacks a decoder shape field"),
    ('{"hidden_size": 64, "num_hidden_layers": 2}', "lacks a decoder shape field"),
])
def test_bad_configs_raise_shape_errors(tmp_path: Path, content: str | bytes | None, message: str) -> None:
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ShapeError, match=message):
        load_model_shape(path)

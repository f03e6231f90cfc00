"""What a model takes in memory, against hand-computed numbers for Meta-Llama-3-8B's config.json (the
llama_config fixture): its parameters, its weights at BF16 and INT8 W8A8, its KV cache per token."""

from __future__ import annotations

from pathlib import Path

from appliance.loadtest.footprint import kv_bytes_per_token, param_count, weight_bytes
from appliance.model.shape import load_model_shape

# By hand: embeddings and LM head 128256 x 4096 each; per layer q and o 4096 x 4096, k and v 4096 x 1024
# (8 KV heads x 128), MLP 3 x 4096 x 14336, two norms of 4096; one final norm.
EMBED = 128256 * 4096  # 525,336,576
ATTN_PER_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024  # 41,943,040
MLP_PER_LAYER = 3 * 4096 * 14336  # 176,160,768
NORMS = 32 * 2 * 4096 + 4096
TOTAL = 2 * EMBED + 32 * (ATTN_PER_LAYER + MLP_PER_LAYER) + NORMS


def test_llama3_8b_parameters(llama_config: Path) -> None:
    shape = load_model_shape(llama_config)
    assert shape.head_dim == 128 and shape.num_kv_heads == 8
    params = param_count(shape)
    assert TOTAL == 8_030_261_248  # the published 8.03 B
    assert params.total == TOTAL
    assert params.embedding == params.lm_head == EMBED
    assert params.attention == 32 * ATTN_PER_LAYER and params.mlp == 32 * MLP_PER_LAYER


def test_llama3_8b_weight_bytes(llama_config: Path) -> None:
    shape = load_model_shape(llama_config)
    assert weight_bytes(shape, "bf16") == TOTAL * 2 == 16_060_522_496
    linear = 32 * (ATTN_PER_LAYER + MLP_PER_LAYER)
    out_channels = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # q k v o gate up down
    expected_int8 = linear * 1 + out_channels * 4 + (TOTAL - linear) * 2  # fp32 scales; embeddings/head/norms BF16
    assert weight_bytes(shape, "int8") == expected_int8 == 9_086_705_664


def test_llama3_8b_kv_bytes_per_token(llama_config: Path) -> None:
    shape = load_model_shape(llama_config)
    assert kv_bytes_per_token(shape, "bf16") == 32 * 8 * 128 * 2 * 2 == 131072
    assert kv_bytes_per_token(shape, "fp8") == 65536
    assert kv_bytes_per_token(shape, "bf16", tensor_parallel_size=2) == 65536
    assert kv_bytes_per_token(shape, "bf16", tensor_parallel_size=16) == 32 * 1 * 128 * 2 * 2  # heads replicated

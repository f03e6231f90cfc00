"""The memory planner against hand-computed numbers for a Llama-3-8B-shaped config.json."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from appliance.loadtest.plan import (
    GIB,
    KNOWN_SHAPES,
    PlanError,
    PlanInputs,
    kv_bytes_per_token,
    load_shape,
    make_plan,
    param_count,
    render_plan,
    shape_from_config,
    weight_bytes,
)

REPO = Path(__file__).resolve().parents[2]

# Meta-Llama-3-8B's published config.json (the fields memory depends on, as published).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "attention_bias": False,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}

# By hand: embeddings and LM head 128256 x 4096 each; per layer q and o 4096 x 4096, k and v 4096 x 1024
# (8 KV heads x 128), MLP 3 x 4096 x 14336, two norms of 4096; one final norm.
EMBED = 128256 * 4096  # 525,336,576
ATTN_PER_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024  # 41,943,040
MLP_PER_LAYER = 3 * 4096 * 14336  # 176,160,768
NORMS = 32 * 2 * 4096 + 4096
TOTAL = 2 * EMBED + 32 * (ATTN_PER_LAYER + MLP_PER_LAYER) + NORMS


@pytest.fixture
def llama_config(tmp_path: Path) -> Path:
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_llama3_8b_parameters(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    assert shape.head_dim == 128 and shape.num_kv_heads == 8
    params = param_count(shape)
    assert TOTAL == 8_030_261_248  # the published 8.03 B
    assert params.total == TOTAL
    assert params.embedding == params.lm_head == EMBED
    assert params.attention == 32 * ATTN_PER_LAYER and params.mlp == 32 * MLP_PER_LAYER


def test_llama3_8b_weight_bytes(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    assert weight_bytes(shape, "bf16") == TOTAL * 2 == 16_060_522_496
    linear = 32 * (ATTN_PER_LAYER + MLP_PER_LAYER)
    out_channels = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # q k v o gate up down
    expected_int8 = linear * 1 + out_channels * 4 + (TOTAL - linear) * 2  # fp32 scales; embeddings/head/norms BF16
    assert weight_bytes(shape, "int8") == expected_int8 == 9_086_705_664


def test_llama3_8b_kv_bytes_per_token(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    assert kv_bytes_per_token(shape, "bf16") == 32 * 8 * 128 * 2 * 2 == 131072
    assert kv_bytes_per_token(shape, "fp8") == 65536
    assert kv_bytes_per_token(shape, "bf16", tensor_parallel_size=2) == 65536
    assert kv_bytes_per_token(shape, "bf16", tensor_parallel_size=16) == 32 * 1 * 128 * 2 * 2  # heads replicated


def test_llama3_8b_plan_on_80_gib(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    plan = make_plan(shape, PlanInputs(memory_gib=80, max_len=8192, reserve_gib=2, context_lens=(2048,)))
    usable = int(80 * GIB * 0.9)
    kv_budget = usable - 16_060_522_496 - 2 * GIB
    tokens = kv_budget // (131072 * 16) * 16
    assert plan.kv["capacity_tokens"] == tokens
    assert plan.concurrency == [{"context_len": 2048, "max_sequences": tokens // 2048},
                                {"context_len": 8192, "max_sequences": tokens // 8192}]
    assert plan.fits and not plan.warnings
    flags = plan.engine_flags
    assert flags[flags.index("--max-model-len") + 1] == "8192"
    assert flags[flags.index("--max-num-seqs") + 1] == str(tokens // 8192)
    assert flags[flags.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "131072 B/token" in render_plan(plan)


def test_plan_tensor_parallel_splits_weights_and_kv(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    plan = make_plan(shape, PlanInputs(memory_gib=24, max_len=8192, tensor_parallel_size=2, reserve_gib=1))
    assert plan.weights["bytes_per_device"] == 16_060_522_496 // 2
    assert plan.kv["bytes_per_token_per_device"] == 65536


def test_plan_warns_when_it_cannot_fit() -> None:
    plan = make_plan(KNOWN_SHAPES["llama-3-70b"], PlanInputs(memory_gib=80, max_len=8192))
    assert not plan.fits
    assert plan.warnings[0].startswith("cannot fit: weights")
    tight = make_plan(KNOWN_SHAPES["llama-3-8b"], PlanInputs(memory_gib=18, max_len=8192, reserve_gib=1))
    assert not tight.fits and "less than one sequence" in tight.warnings[0]
    bad_tp = make_plan(KNOWN_SHAPES["llama-3-8b"], PlanInputs(memory_gib=80, max_len=8192, tensor_parallel_size=3))
    assert not bad_tp.fits and any("cannot shard" in w for w in bad_tp.warnings)


def test_plan_int8_fits_where_bf16_does_not() -> None:
    shape = KNOWN_SHAPES["llama-3-8b"]
    assert not make_plan(shape, PlanInputs(memory_gib=16, max_len=4096, dtype="bf16")).fits
    assert make_plan(shape, PlanInputs(memory_gib=16, max_len=4096, dtype="int8")).fits


def test_plan_cpu_uses_whole_gib_kv_space() -> None:
    plan = make_plan(KNOWN_SHAPES["demo"], PlanInputs(memory_gib=4.5, max_len=1024, device="cpu", reserve_gib=1))
    weights = weight_bytes(KNOWN_SHAPES["demo"], "bf16")
    expected_gib = (int(4.5 * GIB) - weights - GIB) // GIB
    assert plan.settings["kv_cache_space_gib"] == expected_gib == 3
    assert plan.environment == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    assert "--gpu-memory-utilization" not in plan.engine_flags
    assert plan.kv["bytes_per_token"] == 4 * 2 * 64 * 2 * 2


def test_known_sizes_match_published_counts() -> None:
    assert param_count(KNOWN_SHAPES["llama-3-70b"]).total == 70_553_706_496
    assert param_count(KNOWN_SHAPES["llama-3.2-1b"]).total == 1_235_814_400
    assert param_count(KNOWN_SHAPES["mistral-7b"]).total == 7_241_732_096
    assert param_count(KNOWN_SHAPES["qwen2.5-7b"]).total == 7_615_616_512


def test_demo_shape_matches_the_demo_builder() -> None:
    """The demo entry mirrors appliance/model/demo.py's constants (read without importing torch)."""
    source = REPO / "appliance" / "model" / "demo.py"
    if not source.is_file():
        pytest.skip("no demo model builder in this checkout")
    consts = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    consts[target.id] = node.value.value
    demo = KNOWN_SHAPES["demo"]
    assert demo.hidden_size == consts["HIDDEN_SIZE"] and demo.num_layers == consts["NUM_LAYERS"]
    assert demo.num_heads == consts["NUM_HEADS"] and demo.num_kv_heads == consts["NUM_KV_HEADS"]
    assert demo.intermediate_size == consts["INTERMEDIATE_SIZE"] and demo.vocab_size == consts["VOCAB_SIZE"]
    assert demo.head_dim == consts["HIDDEN_SIZE"] // consts["NUM_HEADS"]


def test_shape_defaults_and_quantized_checkpoint() -> None:
    cfg = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 1024,
           "vocab_size": 1000, "quantization_config": {"quant_method": "compressed-tensors"}}
    shape = shape_from_config(cfg)
    assert shape.num_kv_heads == 8 and shape.head_dim == 64 and shape.quantized == "compressed-tensors"
    plan = make_plan(shape, PlanInputs(memory_gib=8, max_len=512))
    assert plan.weights["dtype"] == "int8"


def test_load_shape_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not known"):
        load_shape(None, "gpt-5")
    with pytest.raises(PlanError, match="No such file"):
        load_shape(tmp_path / "missing.json", None)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        load_shape(bad, None)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(PlanError, match="lacks"):
        load_shape(empty, None)

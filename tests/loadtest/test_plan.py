"""The memory planner against hand-computed numbers for a Llama-3-8B-shaped config.json."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from appliance.loadtest.footprint import GIB, param_count, weight_bytes
from appliance.loadtest.plan import (
    KNOWN_SHAPES,
    PlanError,
    PlanInputs,
    default_batched_tokens,
    load_shape,
    make_plan,
    render_plan,
    shape_from_config,
)
from tests.loadtest.support import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_llama3_8b_plan_on_80_gib(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    plan = make_plan(shape, PlanInputs(memory_gib=80, max_len=8192, reserve_gib=2, context_lens=(2048,)))
    usable = int(80 * GIB * 0.9)
    kv_budget = usable - 16_060_522_496 - 2 * GIB
    tokens = kv_budget // (131072 * 16) * 16
    fp8_tokens = kv_budget // (65536 * 16) * 16  # the same bytes at one byte per element
    assert plan.kv["capacity_tokens"] == tokens
    assert plan.kv["by_dtype"]["fp8"]["capacity_tokens"] == fp8_tokens
    assert plan.concurrency == [
        {"context_len": 2048, "max_sequences": tokens // 2048, "max_sequences_16bit_kv": tokens // 2048,
         "max_sequences_fp8_kv": fp8_tokens // 2048},
        {"context_len": 8192, "max_sequences": tokens // 8192, "max_sequences_16bit_kv": tokens // 8192,
         "max_sequences_fp8_kv": fp8_tokens // 8192}]
    assert "--kv-cache-dtype" not in plan.engine_flags and "kv_cache_dtype" not in plan.settings
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
    plan = make_plan(KNOWN_SHAPES["demo"], PlanInputs(memory_gib=6.5, max_len=1024, device="cpu", reserve_gib=1))
    weights = weight_bytes(KNOWN_SHAPES["demo"], "bf16")
    expected_gib = (int(6.5 * GIB) - 2 * GIB - weights - GIB) // GIB  # 2 GiB left to the OS
    assert plan.settings["kv_cache_space_gib"] == expected_gib == 3
    assert plan.environment == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    assert "--gpu-memory-utilization" not in plan.engine_flags
    assert plan.kv["bytes_per_token"] == 4 * 2 * 64 * 2 * 2


def test_cpu_plan_leaves_memory_to_the_os() -> None:
    """10% of RAM, at least 2 GiB: on 64 GiB the OS keeps 6.4 GiB, not the half GiB whole-GiB rounding left."""
    demo = KNOWN_SHAPES["demo"]
    big = make_plan(demo, PlanInputs(memory_gib=64, max_len=1024, device="cpu", reserve_gib=1))
    assert big.memory["os_reserve_bytes"] == int(64 * GIB * 0.1)
    assert big.memory["usable_bytes"] == 64 * GIB - int(64 * GIB * 0.1)
    assert big.settings["kv_cache_space_gib"] == 56  # 64 - 6.4 - 1 reserve - 7 MiB weights, whole GiB
    small = make_plan(demo, PlanInputs(memory_gib=8, max_len=1024, device="cpu", reserve_gib=1))
    assert small.memory["os_reserve_bytes"] == 2 * GIB
    given = make_plan(demo, PlanInputs(memory_gib=64, max_len=1024, device="cpu", reserve_gib=1, os_reserve_gib=0.5))
    assert given.memory["os_reserve_bytes"] == GIB // 2 and given.settings["kv_cache_space_gib"] == 62
    gpu = make_plan(demo, PlanInputs(memory_gib=64, max_len=1024, reserve_gib=1))
    assert gpu.memory["os_reserve_bytes"] == 0  # a GPU's memory is the device's: gpu_memory_utilization rules
    assert "left to the OS" in render_plan(big) and "left to the OS" not in render_plan(gpu)


def test_block_size_defaults_to_vllms_per_device() -> None:
    demo = KNOWN_SHAPES["demo"]
    cpu = make_plan(demo, PlanInputs(memory_gib=8, max_len=1024, device="cpu"))
    assert cpu.kv["block_size"] == 128 and cpu.settings["block_size"] == 128
    assert cpu.engine_flags[cpu.engine_flags.index("--block-size") + 1] == "128"
    assert not any("multiple of 32" in w for w in cpu.warnings)
    gpu = make_plan(demo, PlanInputs(memory_gib=8, max_len=1024))
    assert gpu.kv["block_size"] == 16 and not gpu.warnings
    odd = make_plan(demo, PlanInputs(memory_gib=8, max_len=1024, device="cpu", block_size=48))
    assert odd.fits and any("--block-size 48 is not a multiple of 32" in w for w in odd.warnings)
    assert not any("multiple" in w for w in make_plan(demo, PlanInputs(memory_gib=8, max_len=1024, device="cpu",
                                                                       block_size=64)).warnings)


@pytest.mark.parametrize(("memory_gib", "gpu_name", "device", "tp", "expected"), [
    (80, "NVIDIA H100 80GB HBM3", "gpu", 1, 8192),
    (141, "NVIDIA H200", "gpu", 1, 8192),
    (80, "NVIDIA A100-SXM4-80GB", "gpu", 1, 2048),  # vLLM keeps A100s at 2048 (larger steps cost them)
    (80, None, "gpu", 1, 8192),
    (180, "NVIDIA B200", "gpu", 1, 16384),
    (24, "NVIDIA L4", "gpu", 1, 2048),
    (40, "NVIDIA A100-SXM4-40GB", "gpu", 1, 2048),
    (64, None, "cpu", 1, 2048),
    (64, None, "cpu", 2, 4096),
])
def test_default_batched_tokens_follow_vllm(memory_gib: float, gpu_name: str | None, device: str, tp: int,
                                            expected: int) -> None:
    tokens, why = default_batched_tokens(memory_gib, device, gpu_name, max_num_seqs=256, max_len=8192,
                                         tensor_parallel_size=tp)
    assert tokens == expected, why
    assert default_batched_tokens(memory_gib, device, gpu_name, max_num_seqs=2, max_len=512,
                                  tensor_parallel_size=tp)[0] == min(expected, 1024)  # capped at seqs x len


def test_default_batched_tokens_match_vllms_own_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ask the installed vLLM (EngineArgs.get_batch_defaults) for its defaults on each GPU, through a stand-in
    platform that reports the GPU's name and memory: a vLLM upgrade that changes them fails here."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.usage.usage_lib import UsageContext

    class Gpu:
        def __init__(self, name: str, gib: float) -> None:
            self.name, self.gib = name, gib

        def get_device_total_memory(self) -> int:
            return int(self.gib * GIB)

        def get_device_name(self) -> str:
            return self.name

        def is_tpu(self) -> bool:
            return False

        def is_cpu(self) -> bool:
            return False

    for name, gib in [("NVIDIA H100 80GB HBM3", 79.1), ("NVIDIA A100-SXM4-80GB", 79.2), ("NVIDIA B200", 178.4),
                      ("NVIDIA L4", 22.0), ("NVIDIA H200", 139.8)]:
        monkeypatch.setattr(arg_utils, "current_platform", Gpu(name, gib))
        tokens, _ = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
        ours, _ = default_batched_tokens(gib, "gpu", name, max_num_seqs=10**6, max_len=10**6)
        assert ours == tokens[UsageContext.OPENAI_API_SERVER], name


def test_fp8_kv_doubles_concurrency_at_the_same_budget(llama_config: Path) -> None:
    shape = load_shape(llama_config, None)
    auto = make_plan(shape, PlanInputs(memory_gib=80, max_len=8192, reserve_gib=2))
    fp8 = make_plan(shape, PlanInputs(memory_gib=80, max_len=8192, reserve_gib=2, kv_dtype="fp8"))
    assert fp8.memory["kv_bytes"] == auto.memory["kv_bytes"]
    assert fp8.kv["bytes_per_token"] == 65536 and fp8.kv["kv_cache_dtype"] == "fp8"
    assert fp8.kv["capacity_tokens"] == auto.kv["by_dtype"]["fp8"]["capacity_tokens"]
    assert fp8.concurrency[0]["max_sequences"] == fp8.concurrency[0]["max_sequences_fp8_kv"]
    assert fp8.concurrency == [{**row, "max_sequences": row["max_sequences_fp8_kv"]} for row in auto.concurrency]
    assert 0 <= fp8.kv["capacity_tokens"] - 2 * auto.kv["capacity_tokens"] < 2 * 16  # twice, to a block
    flags = fp8.engine_flags
    assert flags[flags.index("--kv-cache-dtype") + 1] == "fp8" and fp8.settings["kv_cache_dtype"] == "fp8"
    e5m2 = make_plan(shape, PlanInputs(memory_gib=80, max_len=8192, reserve_gib=2, kv_dtype="fp8_e5m2"))
    assert e5m2.settings["kv_cache_dtype"] == "fp8_e5m2" and e5m2.kv["bytes_per_token"] == 65536
    text = render_plan(fp8).splitlines()
    header = next(line for line in text if line.startswith("max concurrent sequences"))
    assert "16-bit KV" in header and "fp8 KV (planned)" in header
    row = next(line for line in text if "at    8192 tokens" in line)
    assert row.split()[-2:] == [str(auto.concurrency[0]["max_sequences"]), str(fp8.concurrency[0]["max_sequences"])]


def test_over_long_max_len_does_not_fit() -> None:
    plan = make_plan(KNOWN_SHAPES["llama-3-8b"], PlanInputs(memory_gib=80, max_len=16384))
    assert not plan.fits
    assert any(w.startswith("cannot serve --max-len 16384") for w in plan.warnings)
    assert "fits: NO" in render_plan(plan)


def test_plan_cli_kv_dtype_from_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model-size", "demo", "--memory-gib", "8", "--max-len", "1024", "--device", "cpu", "--json"]
    monkeypatch.delenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE", raising=False)
    assert run_cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["kv"]["kv_cache_dtype"] == "auto"
    monkeypatch.setenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE", "fp8")
    assert run_cli(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["kv_dtype"] == "fp8" and "--kv-cache-dtype" in plan["engine_flags"]
    assert plan["concurrency"][0]["max_sequences_16bit_kv"] * 2 == plan["concurrency"][0]["max_sequences_fp8_kv"]
    assert run_cli([*argv, "--kv-dtype", "auto"]) == 0  # the flag wins over the setting
    assert json.loads(capsys.readouterr().out)["kv"]["kv_cache_dtype"] == "auto"
    monkeypatch.delenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE")
    config = tmp_path / "appliance.yaml"
    config.write_text("engine:\n  kv_cache_dtype: fp8_e5m2\n")
    assert run_cli([*argv, "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["kv_cache_dtype"] == "fp8_e5m2"
    config.write_text("engine:\n  kv_cache_dtype: int4\n")
    assert run_cli([*argv, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "engine.kv_cache_dtype" in err and "Traceback" not in err


def test_plan_cli_over_long_max_len_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plan", "--model-size", "demo", "--memory-gib", "8", "--max-len", "4096", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "fits: NO" in out and "max_position_embeddings 1024" in out


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


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_text_plan_speaks_the_appliances_keys_first(device: str) -> None:
    """The text plan's first recommendation is an `engine:` block to paste into the configuration file and the
    matching APPLIANCE_ENGINE__* variables; vLLM's flags come after it, as a secondary view."""
    import yaml

    from appliance.engine.settings import EngineSettings

    plan = make_plan(KNOWN_SHAPES["demo"], PlanInputs(memory_gib=6.5, max_len=1024, device=device, reserve_gib=1,
                                                      kv_dtype="fp8"))
    text = render_plan(plan)
    lines = text.splitlines()
    start = lines.index("engine:")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    pasted = yaml.safe_load("\n".join(block))["engine"]
    assert pasted == plan.settings
    assert EngineSettings(**pasted).max_num_seqs == plan.settings["max_num_seqs"]  # keys the appliance reads
    for key, value in plan.settings.items():
        assert f"APPLIANCE_ENGINE__{key.upper()}={value}" in text
    first_flag = min(i for i, line in enumerate(lines) if "--max-num-seqs" in line)
    assert start < first_flag and "vLLM flags" in lines[first_flag - 1] + lines[first_flag]
    assert not any(line.startswith("VLLM_CPU_KVCACHE_SPACE=") or line.startswith("environment: VLLM")
                   for line in lines)  # the appliance sets it from engine.kv_cache_space_gib
    if device == "cpu":
        assert "kv_cache_space_gib: 3" in text

import sys
from pathlib import Path

import pytest

from appliance.engine.command import engine_argv, engine_env, engine_memory_argv, launcher_command
from appliance.engine.placement import Placement
from appliance.engine.settings import EngineSettings
from appliance.settings import ConfigError, load_settings


def test_engine_flags_use_vllm_names():
    engine = EngineSettings(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024, block_size=16,
                            shutdown_timeout_seconds=7, extra_args=["--seed", "1"])
    argv = engine_argv(Path("/m"), "demo", 8101, engine)
    flags = {flag: value for flag, value in zip(argv, argv[1:], strict=False) if flag.startswith("--")}
    assert flags["--model"] == "/m"
    assert flags["--port"] == "8101"
    assert flags["--host"] == "127.0.0.1"
    assert flags["--max-model-len"] == "512"
    assert flags["--max-num-seqs"] == "8"
    assert flags["--max-num-batched-tokens"] == "1024"
    assert flags["--block-size"] == "16"
    assert flags["--shutdown-timeout"] == "7"
    assert argv[-2:] == ["--seed", "1"]
    assert "--quantization" not in argv  # read from the checkpoint unless configured
    assert "--enable-prompt-tokens-details" in argv  # cached prompt tokens in usage, for per-tenant accounting


def test_cpu_memory_budget_goes_to_the_environment():
    engine = EngineSettings(kv_cache_space_gib=3)
    cpu = Placement("cpu", cores=(1,))
    assert engine_env(cpu, engine) == {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert engine_memory_argv(cpu, engine) == []
    gpu = Placement("cuda", gpus=(0,))
    assert engine_env(gpu, engine) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    assert engine_memory_argv(gpu, EngineSettings(gpu_memory_utilization=0.8)) == ["--gpu-memory-utilization",
                                                                                  "0.8"]


def test_engines_run_under_the_orphan_proof_launcher():
    command = launcher_command(["--port", "1"])
    assert command[:4] == [sys.executable, "-m", "appliance.engine.launch", "--"]
    assert command[4:] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", "1"]


def test_kv_cache_dtype_is_passed_under_vllms_name():
    assert "--kv-cache-dtype" not in engine_argv(Path("/m"), "demo", 8101, EngineSettings())  # auto: vLLM's own
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        argv = engine_argv(Path("/m"), "demo", 8101, EngineSettings(kv_cache_dtype=dtype))
        assert argv[argv.index("--kv-cache-dtype") + 1] == dtype


def test_the_scheduling_policy_is_passed_under_vllms_name_when_not_its_default():
    assert "--scheduling-policy" not in engine_argv(Path("/m"), "demo", 8101, EngineSettings())  # fcfs: vLLM's own
    argv = engine_argv(Path("/m"), "demo", 8101, EngineSettings(scheduling_policy="priority"))
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(ValueError, match="set engine.scheduling_policy instead"):
        EngineSettings(extra_args=["--scheduling-policy=priority"])
    with pytest.raises(ValueError):
        EngineSettings(scheduling_policy="lottery")


def test_kv_cache_dtype_is_validated(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineSettings(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="set engine.kv_cache_dtype instead"):
        EngineSettings(extra_args=["--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="set engine.kv_cache_dtype instead"):
        EngineSettings(extra_args="--seed 1 --kv-cache-dtype=fp8")
    monkeypatch.setenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE", "fp8_e5m2")
    assert load_settings().engine.kv_cache_dtype == "fp8_e5m2"
    monkeypatch.setenv("APPLIANCE_ENGINE__KV_CACHE_DTYPE", "fp4")
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype"):
        load_settings()

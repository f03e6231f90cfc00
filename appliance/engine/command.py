"""The vLLM command line and environment of one replica, derived from the settings alone.

Keeping this a pure function means `appliance config` can print exactly what will run, and tests can check it
without starting anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.engine.kv_events import kv_events_argv, kv_events_env
from appliance.engine.placement import Placement
from appliance.engine.settings import EngineSettings

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Refuses every request but /health and /metrics without the engine key (vLLM's own check covers /v1 and a few
# other prefixes only): appliance/engine/guard.py. A module path, no secret: the key comes from VLLM_API_KEY.
ENGINE_GUARD = "appliance.engine.guard.EngineKeyGuard"


def engine_argv(
    model: Path, served_model_name: str, port: int, engine: EngineSettings, *, host: str = "127.0.0.1"
) -> list[str]:
    """vLLM OpenAI-server arguments (without the interpreter), using vLLM's own flag names."""
    argv = [
        "--model", str(model),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        # Settings always fill it (the model's own limit when unset); an EngineSettings built alone may leave it
        # unset, and vLLM then derives the same limit itself.
        *(["--max-model-len", str(engine.max_model_len)] if engine.max_model_len is not None else []),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--dtype", engine.dtype,
        "--shutdown-timeout", str(engine.shutdown_timeout_seconds),
        "--disable-uvicorn-access-log",
        # usage.prompt_tokens_details.cached_tokens: per-tenant cached prompt tokens (gateway/tenants/accounting)
        "--enable-prompt-tokens-details",
        "--middleware", ENGINE_GUARD,
    ]
    optional = {
        "--max-num-batched-tokens": engine.max_num_batched_tokens,
        "--block-size": engine.block_size,
        "--quantization": engine.quantization,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if engine.kv_cache_dtype != "auto":  # vLLM's default; k/v scales are the checkpoint's, else 1.0
        argv += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.scheduling_policy != "fcfs":  # vLLM's default
        argv += ["--scheduling-policy", engine.scheduling_policy]
    if engine.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    argv += kv_events_argv(port, engine)  # precise prefix routing (appliance/engine/kv_events.py)
    return argv + list(engine.extra_args)


def engine_env(placement: Placement, engine: EngineSettings) -> dict[str, str]:
    """Environment additions: device pinning, the memory budget of the KV cache, the block hash's seed."""
    env = placement.env() | kv_events_env(engine)
    if placement.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine.kv_cache_space_gib)
    return env


def engine_memory_argv(placement: Placement, engine: EngineSettings) -> list[str]:
    """On GPUs the KV-cache budget is a fraction of device memory; CPUs take it from the environment."""
    if placement.device == "cuda":
        return ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    return []


def launcher_command(vllm_argv: list[str]) -> list[str]:
    """The process the supervisor starts: the orphan-proof launcher wrapping the vLLM server."""
    return [sys.executable, "-m", "appliance.engine.launch", "--", sys.executable, "-m", VLLM_SERVER_MODULE,
            *vllm_argv]


"""``appliance plan``: will this model fit, and how many sequences at which context lengths?

What the model takes per device (weights, KV cache per token, the reserve for activations and overhead) is
appliance.loadtest.footprint's. The plan shows the KV cache at 16-bit and at fp8 side by side, the planned one from
``--kv-dtype`` or ``engine.kv_cache_dtype``; ``--reserve-gib`` replaces the reserve's estimate with a measured number
(vLLM logs its own at start).

On a GPU, vLLM may use ``gpu_memory_utilization`` x device memory; what remains after weights and the
reserve is KV cache, counted in blocks of ``block_size`` tokens. On CPU the KV cache is a fixed size
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB), so the plan gives the largest that fits next to weights and reserve
once the operating system has its share (CPU_OS_RESERVE_FRACTION). Defaults follow vLLM's own where the plan
passes a flag: block size (16 on GPUs, 128 on CPUs) and ``max_num_batched_tokens`` (default_batched_tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.loadtest.footprint import GIB, kv_bytes_per_token, param_count, reserve_bytes, weight_bytes
from appliance.model.shape import KV_CACHE_DTYPES, ModelShape, ShapeError, load_model_shape, shape_from_config

__all__ = ["ModelShape", "shape_from_config"]  # re-exported: the planner's callers read shapes through it

# vLLM's KV block sizes: CacheConfig's default on GPUs, the CPU platform's own default (platforms/cpu.py),
# whose attention kernels want a multiple of 32 (otherwise they fall back to a slower path).
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128
CPU_BLOCK_MULTIPLE = 32
# Left to the operating system on a CPU host before weights and KV cache are planned: the kernel, system
# services, the gateway process and the page cache that holds the model files while the engines load them.
# vLLM allocates its KV cache up front, so a plan that hands all RAM to it leaves the OOM killer to pick a
# victim. 10% of RAM, at least 2 GiB (Kubernetes' tiered node reservation comes to ~5.5 GiB on 64 GiB).
CPU_OS_RESERVE_FRACTION = 0.10
CPU_OS_RESERVE_MIN_BYTES = 2 * GIB
WEIGHT_DTYPES = ("bf16", "fp16", "fp32", "int8", "fp8")
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", *KV_CACHE_DTYPES[1:])
SIXTEEN_BIT, FP8 = "16-bit", "fp8"


class PlanError(ValueError):
    """The model shape or the flags cannot be planned (bad config file, unknown size name); a usage error."""


KNOWN_SHAPES = {
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, False, 0, 8192),
    "llama-3-70b": ModelShape("llama-3-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, False, 0, 8192),
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, True, False, 0, 131072),
    "mistral-7b": ModelShape("mistral-7b", 4096, 32, 32, 8, 128, 14336, 32000, False, False, 0, 32768),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, True, 0, 32768),
    # The demo model `appliance demo-model` builds (appliance/model/demo.py's shape constants).
    "demo": ModelShape("demo", 256, 4, 4, 2, 64, 768, 2048, True, False, 0, 1024),
}


def load_shape(model_config: Path | None, model_size: str | None) -> ModelShape:
    """From ``--model-config`` (a config.json or a checkpoint directory) or ``--model-size`` (a known name)."""
    if model_size is not None:
        if model_size.lower() not in KNOWN_SHAPES:
            raise PlanError(f"--model-size {model_size!r} is not known; known: {', '.join(KNOWN_SHAPES)}")
        return KNOWN_SHAPES[model_size.lower()]
    if model_config is None:
        raise PlanError("give --model-config PATH or --model-size NAME")
    try:
        shape = load_model_shape(model_config)
    except ShapeError as exc:
        raise PlanError(f"--model-config {exc}") from exc
    if shape.vocab_size < 1:
        raise PlanError(f"--model-config {model_config}: config.json lacks vocab_size")
    return shape


# --- what vLLM and the host take -------------------------------------------------------------------------------


def kv_flag(kv_dtype: str) -> str:
    """vLLM's --kv-cache-dtype for a planned KV dtype: 16/32-bit caches are the model's own dtype ("auto")."""
    return kv_dtype if kv_dtype in KV_CACHE_DTYPES else "auto"


def default_batched_tokens(memory_gib: float, device: str, gpu_name: str | None = None, *, max_num_seqs: int,
                           max_len: int, tensor_parallel_size: int = 1) -> tuple[int, str]:
    """vLLM's default ``max_num_batched_tokens`` for its OpenAI server (EngineArgs.get_batch_defaults, chunked
    prefill on), and why: 16384 on GPUs of 160 GiB or more; 8192 on GPUs of 70 GiB or more unless the device is
    an A100 (larger steps cost A100s throughput); 2048 on other GPUs; 2048 per device on CPU. vLLM then caps
    it at max_num_seqs x max_model_len."""
    if device == "cpu":
        tokens, why = 2048 * tensor_parallel_size, "vLLM's CPU default"
    elif memory_gib >= 160:
        tokens, why = 16384, "vLLM's default for GPUs of 160 GiB or more"
    elif memory_gib >= 70 and "a100" not in (gpu_name or "").lower():
        tokens, why = 8192, "vLLM's default for GPUs of 70 GiB or more other than A100"
        if not gpu_name:
            why += "; an A100 gets 2048: give --gpu-name"
    elif memory_gib >= 70:
        tokens, why = 2048, "vLLM's default for A100s"
    else:
        tokens, why = 2048, "vLLM's default for GPUs under 70 GiB"
    if max_num_seqs * max_len < tokens:
        tokens, why = max_num_seqs * max_len, why + ", capped at max_num_seqs x max_len"
    return tokens, why


def os_reserve_bytes(device_bytes: int, given_gib: float | None) -> int:
    """Memory a CPU plan leaves to the operating system (see CPU_OS_RESERVE_FRACTION)."""
    if given_gib is not None:
        return int(given_gib * GIB)
    return max(CPU_OS_RESERVE_MIN_BYTES, int(device_bytes * CPU_OS_RESERVE_FRACTION))


# --- the plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    memory_gib: float
    max_len: int
    dtype: str = "auto"
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    device: str = "gpu"
    block_size: int | None = None  # default: vLLM's for the device (16 on GPUs, 128 on CPUs)
    max_num_batched_tokens: int | None = None
    max_num_seqs_cap: int = 256
    typical_len: int | None = None
    context_lens: tuple[int, ...] = ()
    reserve_gib: float | None = None
    gpu_name: str | None = None
    os_reserve_gib: float | None = None  # CPU: default CPU_OS_RESERVE_FRACTION of RAM, at least 2 GiB

    @property
    def blocks(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if self.device == "cpu" else GPU_BLOCK_SIZE

    def validate(self) -> None:
        checks = [(self.memory_gib > 0, "--memory-gib must be positive"), (self.max_len >= 1, "--max-len must be >= 1"),
                  (0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be within (0, 1]"),
                  (self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1"),
                  (self.block_size is None or self.block_size >= 1, "--block-size must be >= 1"),
                  (self.reserve_gib is None or self.reserve_gib >= 0, "--reserve-gib cannot be negative"),
                  (self.os_reserve_gib is None or self.os_reserve_gib >= 0, "--os-reserve-gib cannot be negative"),
                  (all(c >= 1 for c in self.context_lens), "--context-lens must be positive"),
                  (self.typical_len is None or self.typical_len >= 1, "--typical-len must be >= 1"),
                  (self.dtype in ("auto", *WEIGHT_DTYPES), f"--dtype must be one of auto, {', '.join(WEIGHT_DTYPES)}"),
                  (self.kv_dtype in KV_DTYPES, f"--kv-dtype must be one of {', '.join(KV_DTYPES)}"),
                  (self.device in ("gpu", "cpu"), "--device must be gpu or cpu")]
        for ok, message in checks:
            if not ok:
                raise PlanError(message)


@dataclass
class Plan:
    model: ModelShape
    inputs: PlanInputs
    params: dict[str, int]
    weights: dict[str, Any]
    kv: dict[str, Any]
    memory: dict[str, Any]
    concurrency: list[dict[str, int]]
    engine_flags: list[str]
    settings: dict[str, Any]
    environment: dict[str, str]
    fits: bool
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"model": asdict(self.model), "inputs": asdict(self.inputs), "params": self.params,
                "weights": self.weights, "kv": self.kv, "memory": self.memory, "concurrency": self.concurrency,
                "engine_flags": self.engine_flags, "settings": self.settings,
                "settings_env": settings_env(self.settings), "environment": self.environment,
                "fits": self.fits,
                "warnings": self.warnings}


def _weight_dtype(shape: ModelShape, dtype: str) -> str:
    """auto: int8 for an already quantized checkpoint, else bf16."""
    if dtype != "auto":
        return dtype
    return "int8" if shape.quantized else "bf16"


def _kv_label(shape: ModelShape, kv_dtype: str) -> str:
    """The planned KV dtype by name: "auto" shows the model dtype it stands for."""
    return f"auto ({shape.dtype_bytes * 8}-bit)" if kv_dtype == "auto" else kv_dtype


def _sequences(tokens: int, context_len: int, block_size: int) -> int:
    """Whole sequences of ``context_len`` tokens that fit in ``tokens`` of KV cache (block-granular)."""
    return tokens // (math.ceil(context_len / block_size) * block_size)


def _kv_capacity(kv_budget: int, bytes_per_token: int, block_size: int) -> tuple[int, int]:
    """(blocks, tokens) of KV cache in ``kv_budget`` bytes."""
    blocks = max(0, kv_budget) // (bytes_per_token * block_size)
    return blocks, blocks * block_size


def _usable_bytes(inputs: PlanInputs, device_bytes: int) -> tuple[int, int]:
    """(bytes vLLM may use, bytes left to the OS): a fraction of a GPU; a CPU's RAM less the OS reserve."""
    if inputs.device == "gpu":
        return int(device_bytes * inputs.gpu_memory_utilization), 0
    os_reserve = os_reserve_bytes(device_bytes, inputs.os_reserve_gib)
    return device_bytes - os_reserve, os_reserve


def make_plan(shape: ModelShape, inputs: PlanInputs) -> Plan:
    """Weights, KV bytes per token, the KV budget, max concurrent sequences (16-bit and fp8 KV side by side)
    and engine flags."""
    inputs.validate()
    tp, dev, block = inputs.tensor_parallel_size, inputs.device, inputs.blocks
    wdtype = _weight_dtype(shape, inputs.dtype)
    params = param_count(shape)
    weights_total = weight_bytes(shape, wdtype)
    weights_dev = math.ceil(weights_total / tp)
    kv_token = kv_bytes_per_token(shape, inputs.kv_dtype, tp)
    if inputs.max_num_batched_tokens:
        batched, batched_why = inputs.max_num_batched_tokens, "given"
    else:
        batched, batched_why = default_batched_tokens(inputs.memory_gib, dev, inputs.gpu_name,
                                                      max_num_seqs=inputs.max_num_seqs_cap, max_len=inputs.max_len,
                                                      tensor_parallel_size=tp)
    reserve = reserve_bytes(shape, batched, inputs.max_num_seqs_cap, tp)
    if inputs.reserve_gib is not None:
        reserve = {"given": int(inputs.reserve_gib * GIB), "total": int(inputs.reserve_gib * GIB)}
    device_bytes = int(inputs.memory_gib * GIB)
    usable, os_reserve = _usable_bytes(inputs, device_bytes)
    kv_budget = usable - weights_dev - reserve["total"]
    if dev == "cpu":
        kv_budget = max(0, kv_budget) // GIB * GIB  # VLLM_CPU_KVCACHE_SPACE is whole GiB
    kv_blocks, kv_tokens = _kv_capacity(kv_budget, kv_token, block)
    by_dtype = {label: _kv_capacity(kv_budget, shape.kv_bytes_per_token(element, tp), block)
                for label, element in ((SIXTEEN_BIT, 2), (FP8, 1))}
    lens = sorted({inputs.max_len, *inputs.context_lens, *([inputs.typical_len] if inputs.typical_len else [])})
    concurrency = [{"context_len": n, "max_sequences": _sequences(kv_tokens, n, block),
                    "max_sequences_16bit_kv": _sequences(by_dtype[SIXTEEN_BIT][1], n, block),
                    "max_sequences_fp8_kv": _sequences(by_dtype[FP8][1], n, block)} for n in lens]
    typical = inputs.typical_len or inputs.max_len
    max_seqs = min(inputs.max_num_seqs_cap, _sequences(kv_tokens, typical, block))
    warnings = _warnings(shape, inputs, wdtype, weights_dev, usable, reserve["total"], kv_tokens)
    fits = kv_tokens >= inputs.max_len and not any(w.startswith("cannot") for w in warnings)
    flags, settings = _engine_flags(inputs, wdtype, max(1, max_seqs), batched, kv_budget)
    return Plan(
        model=shape, inputs=inputs,
        params={**asdict(params), "linear": params.linear, "total": params.total},
        weights={"dtype": wdtype, "bytes": weights_total, "bytes_per_device": weights_dev,
                 "bf16_bytes": weight_bytes(shape, "bf16"), "int8_bytes": weight_bytes(shape, "int8")},
        kv={"dtype": _kv_label(shape, inputs.kv_dtype), "kv_cache_dtype": kv_flag(inputs.kv_dtype),
            "bytes_per_token": kv_bytes_per_token(shape, inputs.kv_dtype),
            "bytes_per_token_per_device": kv_token, "budget_bytes_per_device": kv_budget, "blocks": kv_blocks,
            "block_size": block, "capacity_tokens": kv_tokens,
            "by_dtype": {label: {"bytes_per_token_per_device": shape.kv_bytes_per_token(element, tp),
                                 "blocks": by_dtype[label][0], "capacity_tokens": by_dtype[label][1]}
                         for label, element in ((SIXTEEN_BIT, 2), (FP8, 1))}},
        memory={"device_bytes": device_bytes, "usable_bytes": usable, "os_reserve_bytes": os_reserve,
                "weights_bytes": weights_dev, "reserve": reserve, "kv_bytes": max(0, kv_budget),
                "max_num_batched_tokens": batched, "max_num_batched_tokens_source": batched_why},
        concurrency=concurrency, engine_flags=flags, settings=settings, fits=fits, warnings=warnings,
        environment={"VLLM_CPU_KVCACHE_SPACE": str(settings["kv_cache_space_gib"])} if inputs.device == "cpu" else {},
    )


def _warnings(shape: ModelShape, inputs: PlanInputs, wdtype: str, weights_dev: int, usable: int, reserve: int,
              kv_tokens: int) -> list[str]:
    """Problems, most serious first; those starting with "cannot" make the plan not fit."""
    out = []
    tp = inputs.tensor_parallel_size
    if weights_dev + reserve > usable:
        out.append(f"cannot fit: weights ({weights_dev / GIB:.2f} GiB per device at {wdtype}) plus reserve "
                   f"({reserve / GIB:.2f} GiB) exceed the usable {usable / GIB:.2f} GiB; use INT8, more devices "
                   "(--tensor-parallel-size) or a bigger device")
    elif kv_tokens < inputs.max_len:
        out.append(f"cannot fit: the KV cache holds {kv_tokens} tokens, less than one sequence of --max-len "
                   f"{inputs.max_len}; lower --max-len or free memory")
    if shape.max_position_embeddings and inputs.max_len > shape.max_position_embeddings:
        out.append(f"cannot serve --max-len {inputs.max_len}: it exceeds the model's max_position_embeddings "
                   f"{shape.max_position_embeddings}, which vLLM refuses without rope scaling")
    if shape.num_heads % tp:
        out.append(f"cannot shard: {shape.num_heads} attention heads are not divisible by tensor parallel size {tp}")
    if shape.num_kv_heads < tp:
        out.append(f"{shape.num_kv_heads} KV heads over {tp} devices: heads are replicated, KV memory per device "
                   "does not shrink further")
    if inputs.device == "cpu" and inputs.blocks % CPU_BLOCK_MULTIPLE:
        out.append(f"--block-size {inputs.blocks} is not a multiple of {CPU_BLOCK_MULTIPLE}: vLLM's CPU attention "
                   f"then runs a slower path (its default is {CPU_BLOCK_SIZE})")
    if shape.quantized and wdtype not in ("int8", "fp8"):
        out.append(f"the checkpoint is already quantized ({shape.quantized}); --dtype {wdtype} overstates weights")
    return out


def _engine_flags(inputs: PlanInputs, wdtype: str, max_seqs: int, batched: int,
                  kv_budget: int) -> tuple[list[str], dict[str, Any]]:
    """vLLM flags, and the same as the appliance's ``engine`` settings section."""
    block = inputs.blocks
    flags = ["--max-model-len", str(inputs.max_len), "--max-num-seqs", str(max_seqs),
             "--max-num-batched-tokens", str(batched), "--block-size", str(block)]
    settings: dict[str, Any] = {"max_model_len": inputs.max_len, "max_num_seqs": max_seqs,
                                "max_num_batched_tokens": batched, "block_size": block}
    if inputs.device == "gpu":
        flags += ["--gpu-memory-utilization", f"{inputs.gpu_memory_utilization:g}",
                  "--tensor-parallel-size", str(inputs.tensor_parallel_size)]
        settings.update(gpu_memory_utilization=inputs.gpu_memory_utilization,
                        tensor_parallel_size=inputs.tensor_parallel_size)
    else:
        settings["kv_cache_space_gib"] = max(1, kv_budget // GIB)
    if wdtype in ("bf16", "fp16", "fp32"):
        name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[wdtype]
        flags += ["--dtype", name]
        settings["dtype"] = name
    if kv_flag(inputs.kv_dtype) != "auto":
        flags += ["--kv-cache-dtype", kv_flag(inputs.kv_dtype)]
        settings["kv_cache_dtype"] = kv_flag(inputs.kv_dtype)
    return flags, settings


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gib(n: int) -> str:
    """GiB with two decimals, or MiB for the small models (the demo's weights are a few MiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / 2**20:.2f} MiB"


def _concurrency_table(plan: Plan) -> list[str]:
    """Max concurrent sequences per context length, 16-bit and fp8 KV side by side; the planned one marked."""
    planned = FP8 if plan.kv["kv_cache_dtype"] != "auto" else SIXTEEN_BIT
    mark = {label: " (planned)" if label == planned else "" for label in (SIXTEEN_BIT, FP8)}
    head = f"{'16-bit KV' + mark[SIXTEEN_BIT]:>20} {'fp8 KV' + mark[FP8]:>17}"
    lines = [f"max concurrent sequences {head}"]
    for row in plan.concurrency:
        lines.append(f"  at {row['context_len']:>7} tokens{'':7}{row['max_sequences_16bit_kv']:>20} "
                     f"{row['max_sequences_fp8_kv']:>17}")
    return lines


def render_plan(plan: Plan) -> str:
    """The plan for people: every number with its unit, then the appliance's ``engine:`` settings to paste (and
    their APPLIANCE_ENGINE__* variables), then the same as vLLM flags."""
    w, kv, m, s = plan.weights, plan.kv, plan.memory, plan.model
    os_line = f", {_gib(m['os_reserve_bytes'])} left to the OS" if m["os_reserve_bytes"] else ""
    other = SIXTEEN_BIT if kv["kv_cache_dtype"] != "auto" else FP8
    lines = [
        f"model {s.name}: {_count(plan.params['total'])} parameters; {s.num_layers} layers, "
        f"hidden {s.hidden_size}, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads of {s.head_dim}, MLP {s.intermediate_size}, "
        f"vocab {s.vocab_size}{' (tied)' if s.tie_word_embeddings else ''}",
        f"weights: BF16 {_gib(w['bf16_bytes'])} ({w['bf16_bytes']} B), INT8 W8A8 {_gib(w['int8_bytes'])} "
        f"({w['int8_bytes']} B); planned at {w['dtype']}: {_gib(w['bytes_per_device'])} per device",
        f"KV cache: {kv['bytes_per_token']} B/token at {kv['dtype']} "
        f"({kv['bytes_per_token_per_device']} B/token per device; 16-bit "
        f"{kv['by_dtype'][SIXTEEN_BIT]['bytes_per_token_per_device']}, fp8 "
        f"{kv['by_dtype'][FP8]['bytes_per_token_per_device']})",
        f"device: {_gib(m['device_bytes'])}{os_line}, usable {_gib(m['usable_bytes'])}; reserve (activations + "
        f"overhead) {_gib(m['reserve']['total'])} at {m['max_num_batched_tokens']} tokens/step "
        f"({m['max_num_batched_tokens_source']})",
        f"KV budget: {_gib(m['kv_bytes'])} = {kv['blocks']} blocks of {kv['block_size']} "
        f"= {kv['capacity_tokens']} tokens at {kv['dtype']} ({other}: {kv['by_dtype'][other]['capacity_tokens']})",
        *_concurrency_table(plan),
        f"fits: {'yes' if plan.fits else 'NO'}",
        *[f"warning: {x}" for x in plan.warnings],
        "",
        "# the appliance's settings: paste into the configuration file (--config) ...",
        *settings_yaml(plan.settings),
        "# ... or set them in the environment:",
        *[f"{k}={v}" for k, v in settings_env(plan.settings).items()],
        "",
        "# the same as vLLM flags (what the appliance passes each engine; for vLLM run by hand):",
        "# " + " ".join(plan.engine_flags),
        *[f"# {k}={v}  (the appliance sets it from engine.{_ENV_SETTING[k]})" for k, v in plan.environment.items()],
    ]
    return "\n".join(lines) + "\n"


# vLLM's environment variables the plan names, and the appliance setting each comes from.
_ENV_SETTING = {"VLLM_CPU_KVCACHE_SPACE": "kv_cache_space_gib"}


def _yaml_scalar(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_yaml(settings: dict[str, Any]) -> list[str]:
    """The ``engine:`` section of the appliance's configuration file for these settings (YAML, line by line)."""
    return ["engine:", *[f"  {key}: {_yaml_scalar(value)}" for key, value in settings.items()]]


def settings_env(settings: dict[str, Any]) -> dict[str, str]:
    """The same settings as APPLIANCE_ENGINE__* environment variables (the environment wins over the file)."""
    return {f"APPLIANCE_ENGINE__{key.upper()}": _yaml_scalar(value) for key, value in settings.items()}

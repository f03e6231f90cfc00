"""``appliance plan``: will this model fit, and how many sequences at which context lengths?

Memory in the seed's layers, per device:

* weights: parameters from the config's shape (embeddings, attention, MLP, norms; the LM head unless tied)
  times bytes per parameter. BF16 is 2 bytes. INT8 W8A8 (compressed-tensors, as ``appliance quantize``
  writes it) is 1 byte for every decoder Linear weight plus one fp32 scale per output channel; embeddings,
  the LM head and norms stay BF16. Tensor parallelism splits all of it across devices.
* KV cache: layers x KV heads x head dim x 2 (K and V) x bytes per element, per token. With tensor
  parallelism each device holds ceil(KV heads / TP) heads (heads are replicated when TP exceeds them).
* activations and overhead (the reserve): vLLM profiles a forward pass of ``max_num_batched_tokens`` tokens
  and keeps the peak out of the KV budget, and CUDA context, cuBLAS workspaces and CUDA graphs take their
  share. Estimated here as a fixed 1 GiB plus tokens-per-step x (4 x hidden + q/k/v width + 3 x
  intermediate / TP) x 2 bytes, plus fp32 logits (and probabilities) for ``max_num_seqs`` x vocab.
  ``--reserve-gib`` replaces the estimate with a measured number (vLLM logs its own at start).

On a GPU, vLLM may use ``gpu_memory_utilization`` x device memory; what remains after weights and the
reserve is KV cache, counted in blocks of ``block_size`` tokens. On CPU the KV cache is a fixed size
(``VLLM_CPU_KVCACHE_SPACE``, whole GiB), so the plan gives the largest that fits next to weights and reserve.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
FIXED_OVERHEAD_BYTES = 1 * GIB
ACTIVATION_BYTES = 2
LOGITS_BYTES = 4 * 2  # fp32 logits, and the probabilities the sampler derives from them
INT8_SCALE_BYTES = 4
DEFAULT_BLOCK_SIZE = 16
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
KV_FLAG = {"fp8": "fp8", "fp16": "auto", "bf16": "auto", "fp32": "auto"}


class PlanError(ValueError):
    """The model shape or the flags cannot be planned (bad config file, unknown size name); a usage error."""


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder-only transformer's config.json."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    max_position_embeddings: int | None = None
    quantized: str | None = None


KNOWN_SHAPES = {
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, False, 0, 8192),
    "llama-3-70b": ModelShape("llama-3-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, False, 0, 8192),
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, True, False, 0, 131072),
    "mistral-7b": ModelShape("mistral-7b", 4096, 32, 32, 8, 128, 14336, 32000, False, False, 0, 32768),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, True, 0, 32768),
    # The demo model `appliance demo-model` builds (appliance/model/demo.py's shape constants).
    "demo": ModelShape("demo", 256, 4, 4, 2, 64, 768, 2048, True, False, 0, 1024),
}


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def shape_from_config(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """Read a Hugging Face config.json dict (Llama, Mistral, Qwen2, Mixtral and alike)."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    try:
        hidden = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
        layers = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_get(cfg, "num_attention_heads", "n_head"))
        kv_heads = int(_get(cfg, "num_key_value_heads", "num_kv_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
        experts = int(_get(cfg, "num_local_experts", "num_experts", default=0) or 0)
        inter = int(_get(cfg, "moe_intermediate_size", default=None) if experts else 0) or int(
            _get(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
        vocab = int(_get(cfg, "vocab_size"))
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise PlanError(f"{name}: config.json lacks a decoder shape field ({exc})") from exc
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    return ModelShape(
        name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), num_experts=experts,
        max_position_embeddings=_get(cfg, "max_position_embeddings", "n_positions"),
        quantized=(quant.get("quant_method") or quant.get("format") or "yes") if isinstance(quant, dict) else None,
    )


def load_shape(model_config: Path | None, model_size: str | None) -> ModelShape:
    """From ``--model-config`` (a config.json or a checkpoint directory) or ``--model-size`` (a known name)."""
    if model_size is not None:
        if model_size.lower() not in KNOWN_SHAPES:
            raise PlanError(f"--model-size {model_size!r} is not known; known: {', '.join(KNOWN_SHAPES)}")
        return KNOWN_SHAPES[model_size.lower()]
    if model_config is None:
        raise PlanError("give --model-config PATH or --model-size NAME")
    path = model_config / "config.json" if model_config.is_dir() else model_config
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"--model-config {model_config}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise PlanError(f"--model-config {path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise PlanError(f"--model-config {path}: expected a JSON object")
    return shape_from_config(cfg, path.parent.name if path.name == "config.json" else path.stem)


# --- parameters and bytes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """Parameter counts by kind; ``linear`` (decoder Linear weights) is what INT8 quantizes."""

    embedding: int
    lm_head: int
    attention: int
    attention_bias: int
    mlp: int
    router: int
    norms: int
    linear_out_channels: int

    @property
    def linear(self) -> int:
        return self.attention + self.mlp

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.attention_bias + self.mlp + self.router
                + self.norms)


def param_count(s: ModelShape) -> Params:
    """Llama-style decoder: q,o are hidden x heads*head_dim; k,v hidden x kv_heads*head_dim; a gated MLP
    (gate, up, down: 3 x hidden x intermediate, per expert for MoE); two RMSNorms per layer plus a final one."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attention = s.num_layers * (2 * s.hidden_size * q + 2 * s.hidden_size * kv)
    experts = max(1, s.num_experts)
    mlp = s.num_layers * experts * 3 * s.hidden_size * s.intermediate_size
    # Output channels (one INT8 scale each): q, k, v, o, then gate, up, down per expert.
    out_channels = s.num_layers * (q + 2 * kv + s.hidden_size + experts * (2 * s.intermediate_size + s.hidden_size))
    return Params(
        embedding=s.vocab_size * s.hidden_size,
        lm_head=0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size,
        attention=attention,
        attention_bias=s.num_layers * (q + 2 * kv) if s.attention_bias else 0,
        mlp=mlp,
        router=s.num_layers * s.hidden_size * s.num_experts,
        norms=(2 * s.num_layers + 1) * s.hidden_size,
        linear_out_channels=out_channels,
    )


def weight_bytes(s: ModelShape, dtype: str) -> int:
    """Checkpoint bytes at ``dtype``: bf16/fp16/fp32 throughout, or int8/fp8 W8A8 (see the module docstring)."""
    p = param_count(s)
    if dtype in ("int8", "fp8"):
        rest = p.total - p.linear
        return p.linear * 1 + p.linear_out_channels * INT8_SCALE_BYTES + rest * DTYPE_BYTES["bf16"]
    return p.total * DTYPE_BYTES[dtype]


def kv_bytes_per_token(s: ModelShape, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
    """layers x KV heads x head dim x 2 (K and V) x bytes; per device with tensor parallelism."""
    heads = math.ceil(s.num_kv_heads / tensor_parallel_size)
    return s.num_layers * heads * s.head_dim * 2 * DTYPE_BYTES[kv_dtype]


def default_batched_tokens(memory_gib: float, device: str) -> int:
    """vLLM's own default for the OpenAI server: 8192 on GPUs of 70 GiB or more, else 2048 (CPU: 2048)."""
    return 8192 if device == "gpu" and memory_gib >= 70 else 2048


def reserve_bytes(s: ModelShape, batched_tokens: int, max_num_seqs: int, tp: int) -> dict[str, int]:
    """Activation peak and fixed overhead kept out of the KV budget (see the module docstring)."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_token = 4 * s.hidden_size + (q + 2 * kv) // tp + 3 * s.intermediate_size // tp
    activations = batched_tokens * per_token * ACTIVATION_BYTES
    logits = max_num_seqs * s.vocab_size * LOGITS_BYTES
    return {"fixed_overhead": FIXED_OVERHEAD_BYTES, "activations": activations, "logits": logits,
            "total": FIXED_OVERHEAD_BYTES + activations + logits}


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
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None
    max_num_seqs_cap: int = 256
    typical_len: int | None = None
    context_lens: tuple[int, ...] = ()
    reserve_gib: float | None = None

    def validate(self) -> None:
        checks = [(self.memory_gib > 0, "--memory-gib must be positive"), (self.max_len >= 1, "--max-len must be >= 1"),
                  (0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be within (0, 1]"),
                  (self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1"),
                  (self.block_size >= 1, "--block-size must be >= 1"),
                  (self.reserve_gib is None or self.reserve_gib >= 0, "--reserve-gib cannot be negative"),
                  (all(c >= 1 for c in self.context_lens), "--context-lens must be positive"),
                  (self.typical_len is None or self.typical_len >= 1, "--typical-len must be >= 1"),
                  (self.dtype in ("auto", *DTYPE_BYTES), f"--dtype must be auto or one of {', '.join(DTYPE_BYTES)}"),
                  (self.kv_dtype in ("auto", *KV_FLAG), f"--kv-dtype must be auto or one of {', '.join(KV_FLAG)}"),
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
                "engine_flags": self.engine_flags, "settings": self.settings, "environment": self.environment,
                "fits": self.fits,
                "warnings": self.warnings}


def _weight_dtype(shape: ModelShape, dtype: str) -> str:
    """auto: int8 for an already quantized checkpoint, else bf16."""
    if dtype != "auto":
        return dtype
    return "int8" if shape.quantized else "bf16"


def _sequences(tokens: int, context_len: int, block_size: int) -> int:
    """Whole sequences of ``context_len`` tokens that fit in ``tokens`` of KV cache (block-granular)."""
    return tokens // (math.ceil(context_len / block_size) * block_size)


def make_plan(shape: ModelShape, inputs: PlanInputs) -> Plan:
    """Weights, KV bytes per token, the KV budget, max concurrent sequences and engine flags."""
    inputs.validate()
    tp, dev = inputs.tensor_parallel_size, inputs.device
    wdtype = _weight_dtype(shape, inputs.dtype)
    kvdtype = "bf16" if inputs.kv_dtype == "auto" else inputs.kv_dtype
    params = param_count(shape)
    weights_total = weight_bytes(shape, wdtype)
    weights_dev = math.ceil(weights_total / tp)
    kv_token = kv_bytes_per_token(shape, kvdtype, tp)
    batched = inputs.max_num_batched_tokens or default_batched_tokens(inputs.memory_gib, dev)
    reserve = reserve_bytes(shape, batched, inputs.max_num_seqs_cap, tp)
    if inputs.reserve_gib is not None:
        reserve = {"given": int(inputs.reserve_gib * GIB), "total": int(inputs.reserve_gib * GIB)}
    device_bytes = int(inputs.memory_gib * GIB)
    usable = int(device_bytes * inputs.gpu_memory_utilization) if dev == "gpu" else device_bytes
    kv_budget = usable - weights_dev - reserve["total"]
    if dev == "cpu":
        kv_budget = max(0, kv_budget) // GIB * GIB  # VLLM_CPU_KVCACHE_SPACE is whole GiB
    kv_blocks = max(0, kv_budget) // (kv_token * inputs.block_size)
    kv_tokens = kv_blocks * inputs.block_size
    lens = sorted({inputs.max_len, *inputs.context_lens, *([inputs.typical_len] if inputs.typical_len else [])})
    concurrency = [{"context_len": n, "max_sequences": _sequences(kv_tokens, n, inputs.block_size)} for n in lens]
    typical = inputs.typical_len or inputs.max_len
    max_seqs = min(inputs.max_num_seqs_cap, _sequences(kv_tokens, typical, inputs.block_size))
    warnings = _warnings(shape, inputs, wdtype, weights_dev, usable, reserve["total"], kv_tokens)
    fits = kv_tokens >= inputs.max_len and not any(w.startswith("cannot") for w in warnings)
    flags, settings = _engine_flags(shape, inputs, wdtype, kvdtype, max(1, max_seqs), batched, kv_budget)
    return Plan(
        model=shape, inputs=inputs,
        params={**asdict(params), "linear": params.linear, "total": params.total},
        weights={"dtype": wdtype, "bytes": weights_total, "bytes_per_device": weights_dev,
                 "bf16_bytes": weight_bytes(shape, "bf16"), "int8_bytes": weight_bytes(shape, "int8")},
        kv={"dtype": kvdtype, "bytes_per_token": kv_bytes_per_token(shape, kvdtype),
            "bytes_per_token_per_device": kv_token, "budget_bytes_per_device": kv_budget, "blocks": kv_blocks,
            "block_size": inputs.block_size, "capacity_tokens": kv_tokens},
        memory={"device_bytes": device_bytes, "usable_bytes": usable, "weights_bytes": weights_dev,
                "reserve": reserve, "kv_bytes": max(0, kv_budget), "max_num_batched_tokens": batched},
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
    if shape.num_heads % tp:
        out.append(f"cannot shard: {shape.num_heads} attention heads are not divisible by tensor parallel size {tp}")
    if shape.max_position_embeddings and inputs.max_len > shape.max_position_embeddings:
        out.append(f"--max-len {inputs.max_len} exceeds the model's max_position_embeddings "
                   f"{shape.max_position_embeddings}; vLLM refuses it without rope scaling")
    if shape.num_kv_heads < tp:
        out.append(f"{shape.num_kv_heads} KV heads over {tp} devices: heads are replicated, KV memory per device "
                   "does not shrink further")
    if shape.quantized and wdtype not in ("int8", "fp8"):
        out.append(f"the checkpoint is already quantized ({shape.quantized}); --dtype {wdtype} overstates weights")
    return out


def _engine_flags(shape: ModelShape, inputs: PlanInputs, wdtype: str, kvdtype: str, max_seqs: int, batched: int,
                  kv_budget: int) -> tuple[list[str], dict[str, Any]]:
    """vLLM flags, and the same as the appliance's ``engine`` settings section."""
    flags = ["--max-model-len", str(inputs.max_len), "--max-num-seqs", str(max_seqs),
             "--max-num-batched-tokens", str(batched), "--block-size", str(inputs.block_size)]
    settings: dict[str, Any] = {"max_model_len": inputs.max_len, "max_num_seqs": max_seqs,
                                "max_num_batched_tokens": batched, "block_size": inputs.block_size}
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
    if KV_FLAG[kvdtype] != "auto":
        flags += ["--kv-cache-dtype", KV_FLAG[kvdtype]]
        settings["extra_args"] = ["--kv-cache-dtype", KV_FLAG[kvdtype]]
    return flags, settings


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gib(n: int) -> str:
    """GiB with two decimals, or MiB for the small models (the demo's weights are a few MiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / 2**20:.2f} MiB"


def render_plan(plan: Plan) -> str:
    """The plan for people: every number with its unit, then the flags to paste."""
    w, kv, m, s = plan.weights, plan.kv, plan.memory, plan.model
    lines = [
        f"model {s.name}: {_count(plan.params['total'])} parameters; {s.num_layers} layers, "
        f"hidden {s.hidden_size}, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads of {s.head_dim}, MLP {s.intermediate_size}, "
        f"vocab {s.vocab_size}{' (tied)' if s.tie_word_embeddings else ''}",
        f"weights: BF16 {_gib(w['bf16_bytes'])} ({w['bf16_bytes']} B), INT8 W8A8 {_gib(w['int8_bytes'])} "
        f"({w['int8_bytes']} B); planned at {w['dtype']}: {_gib(w['bytes_per_device'])} per device",
        f"KV cache: {kv['bytes_per_token']} B/token at {kv['dtype']} "
        f"({kv['bytes_per_token_per_device']} B/token per device)",
        f"device: {_gib(m['device_bytes'])}, usable {_gib(m['usable_bytes'])}; reserve (activations + overhead) "
        f"{_gib(m['reserve']['total'])} at {m['max_num_batched_tokens']} tokens/step",
        f"KV budget: {_gib(m['kv_bytes'])} = {kv['blocks']} blocks of {kv['block_size']} "
        f"= {kv['capacity_tokens']} tokens",
        "max concurrent sequences: " + ", ".join(f"{c['max_sequences']} at {c['context_len']} tokens"
                                                 for c in plan.concurrency),
        "engine flags: " + " ".join(plan.engine_flags),
        *[f"environment: {k}={v}" for k, v in plan.environment.items()],
        f"fits: {'yes' if plan.fits else 'NO'}",
    ]
    lines += [f"warning: {x}" for x in plan.warnings]
    return "\n".join(lines) + "\n"

"""The one reader of a Hugging Face config.json's shape: what memory, bandwidth and the KV cache depend on.

``appliance plan`` (memory budget) and the roofline collector (bytes per decode step) both size the KV cache
from layers x KV heads x head dim x bytes per element, and weights from the same shape; they read it here so
the two can never disagree on a field name, a default or a dtype's width. Standard library only: the
collectors import it inside the gateway process, which must not pay for torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

# Bytes per element, under Hugging Face's torch_dtype names, the planner's short names and vLLM's
# --kv-cache-dtype names.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "int8": 1,
}  # fmt: skip
# vLLM's --kv-cache-dtype values the appliance supports (CPU and CUDA attention both take these); "auto"
# stores K and V in the model's activation dtype. The one list: engine.kv_cache_dtype is typed by it.
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


class ShapeError(ValueError):
    """The config.json cannot be read or lacks a field the shape needs; the message names the file or field."""


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
    dtype_bytes: int = 2  # the checkpoint's activation dtype (torch_dtype), which "auto" KV caches use

    def kv_bytes_per_token(self, element_bytes: int | None = None, tensor_parallel_size: int = 1) -> int:
        """K and V x layers x KV heads x head dim x bytes; per device with tensor parallelism, where each
        device holds ceil(KV heads / TP) heads (heads are replicated when TP exceeds them)."""
        heads = math.ceil(self.num_kv_heads / tensor_parallel_size)
        return 2 * self.num_layers * heads * self.head_dim * (element_bytes or self.dtype_bytes)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named as Hugging Face, the planner or vLLM name it."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ShapeError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per KV element for vLLM's ``--kv-cache-dtype``: "auto" is the model's own dtype."""
    return model_dtype_bytes if kv_cache_dtype == "auto" else dtype_bytes(kv_cache_dtype)


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def shape_from_config(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """Read a Hugging Face config dict (Llama, Mistral, Qwen2, Mixtral and alike; a multimodal model's
    ``text_config`` wins over its top level). A missing ``vocab_size`` reads as 0: the KV cache does not need
    it, the parameter count does (the planner checks)."""
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
        vocab = int(_get(cfg, "vocab_size", default=0))
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ShapeError(f"{name}: config.json lacks a decoder shape field ({exc})") from exc
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    torch_dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")).removeprefix("torch.")
    return ModelShape(
        name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), num_experts=experts,
        max_position_embeddings=_get(cfg, "max_position_embeddings", "n_positions"),
        quantized=(quant.get("quant_method") or quant.get("format") or "yes") if isinstance(quant, dict) else None,
        dtype_bytes=DTYPE_BYTES.get(torch_dtype, 2),
    )


def read_config(path: Path) -> tuple[dict[str, Any], Path]:
    """The parsed config.json of a checkpoint directory (or the file itself), and the file's path."""
    path = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ShapeError(f"{path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ShapeError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise ShapeError(f"{path}: expected a JSON object")
    return cfg, path


def load_model_shape(path: Path) -> ModelShape:
    """The shape of a checkpoint directory or config.json file, named after the directory (or file stem)."""
    cfg, file = read_config(path)
    return shape_from_config(cfg, file.parent.name if file.name == "config.json" else file.stem)


# vLLM's own reading of a model's context limit (vllm/config: _get_and_verify_max_len): the smallest of these keys
# the config (or its text_config) gives, scaled by a RoPE scaling factor, and 2048 when none is given.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")
_UNSCALED_ROPE = ("su", "longrope", "llama3", "mrope", "default")
VLLM_FALLBACK_MAX_MODEL_LEN = 2048


def max_model_len_from_config(cfg: dict[str, Any]) -> int:
    """The max_model_len vLLM derives for a checkpoint when ``--max-model-len`` is not given."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    limits = [int(cfg[key]) for key in _LENGTH_KEYS if isinstance(cfg.get(key), (int, float))]
    if not limits:
        return VLLM_FALLBACK_MAX_MODEL_LEN
    length: float = min(limits)
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _UNSCALED_ROPE and isinstance(rope.get("factor"), (int, float)):
            if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                length = rope["original_max_position_embeddings"]
            length *= rope["factor"]
    return int(length)

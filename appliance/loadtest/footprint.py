"""What a model takes in memory, per device: its weights, its KV cache per token, and the reserve vLLM keeps out of
the KV budget for activations and overhead. ``appliance.loadtest.plan`` puts them on a device.

* weights: parameters from the config's shape (embeddings, attention, MLP, norms; the LM head unless tied)
  times bytes per parameter. BF16 is 2 bytes. INT8 W8A8 (compressed-tensors, as ``appliance quantize``
  writes it) is 1 byte for every decoder Linear weight plus one fp32 scale per output channel; embeddings,
  the LM head and norms stay BF16. Tensor parallelism splits all of it across devices.
* KV cache: layers x KV heads x head dim x 2 (K and V) x bytes per element, per token (the model's dtype for
  vLLM's ``--kv-cache-dtype auto``, 1 byte for fp8). With tensor parallelism each device holds
  ceil(KV heads / TP) heads (heads are replicated when TP exceeds them). The shape comes from
  appliance.model.shape, shared with the roofline collector.
* activations and overhead (the reserve): vLLM profiles a forward pass of ``max_num_batched_tokens`` tokens
  and keeps the peak out of the KV budget, and CUDA context, cuBLAS workspaces and CUDA graphs take their
  share. Estimated here as a fixed 1 GiB plus tokens-per-step x (4 x hidden + q/k/v width + 3 x
  intermediate / TP) x 2 bytes, plus fp32 logits (and probabilities) for ``max_num_seqs`` x vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.model.shape import ModelShape, dtype_bytes, kv_cache_dtype_bytes

GIB = 2**30
FIXED_OVERHEAD_BYTES = 1 * GIB
ACTIVATION_BYTES = 2
LOGITS_BYTES = 4 * 2  # fp32 logits, and the probabilities the sampler derives from them
INT8_SCALE_BYTES = 4


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
        return p.linear * 1 + p.linear_out_channels * INT8_SCALE_BYTES + rest * dtype_bytes("bf16")
    return p.total * dtype_bytes(dtype)


def kv_element_bytes(s: ModelShape, kv_dtype: str) -> int:
    """Bytes per KV element: "auto" is the model's activation dtype, the rest as named."""
    return kv_cache_dtype_bytes(kv_dtype, s.dtype_bytes)


def kv_bytes_per_token(s: ModelShape, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
    """layers x KV heads x head dim x 2 (K and V) x bytes; per device with tensor parallelism."""
    return s.kv_bytes_per_token(kv_element_bytes(s, kv_dtype), tensor_parallel_size)


def reserve_bytes(s: ModelShape, batched_tokens: int, max_num_seqs: int, tp: int) -> dict[str, int]:
    """Activation peak and fixed overhead kept out of the KV budget (see the module docstring)."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_token = 4 * s.hidden_size + (q + 2 * kv) // tp + 3 * s.intermediate_size // tp
    activations = batched_tokens * per_token * ACTIVATION_BYTES
    logits = max_num_seqs * s.vocab_size * LOGITS_BYTES
    return {"fixed_overhead": FIXED_OVERHEAD_BYTES, "activations": activations, "logits": logits,
            "total": FIXED_OVERHEAD_BYTES + activations + logits}

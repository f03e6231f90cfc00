"""The two W8A8 schemes the quantizer writes, and which one a host should get.

Both are compressed-tensors checkpoints that vLLM reads natively, with the same shape of quantization:

* weights: 8 bits, symmetric, one scale per output channel, computed from the weights alone (no calibration);
* activations: 8 bits, symmetric, one scale per token, computed by vLLM at run time (``dynamic``).

INT8 (``int-quantized``) runs on CPUs (oneDNN) and on GPUs before Blackwell; vLLM documents it as unsupported
from compute capability 10.0. FP8 e4m3 (``float-quantized``, compressed-tensors' FP8_DYNAMIC preset) is vLLM's
recommended W8A8 format from Ada/Hopper (8.9) on, where tensor cores multiply FP8 natively. ``auto`` picks FP8
when NVML reports compute capability >= 8.9 on every GPU of this host, and INT8 below that, on CPU hosts and
wherever NVML is absent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SCHEME_NAMES = ("int8", "fp8", "auto")
FP8_MIN_CAPABILITY = (8, 9)
ComputeCapability = tuple[int, int]


@dataclass(frozen=True)
class Scheme:
    """One W8A8 scheme: how its tensors are stored and how the quality check simulates it."""

    name: str  # "int8" or "fp8"
    format: str  # compressed-tensors' format name
    type: str  # compressed-tensors' QuantizationType: "int" or "float"
    dtype: torch.dtype  # of the stored weights
    qmax: float  # largest magnitude the 8-bit type holds
    description: str

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-output-channel quantization: (8-bit weight [out, in], scale [out, 1])."""
        return quantize_weight_int8(weight) if self.name == "int8" else quantize_weight_fp8(weight)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Round activations through this scheme's 8-bit type with one scale per token, as vLLM's dynamic
        activation quantization does."""
        scale = (x.abs().amax(dim=-1, keepdim=True) / self.qmax).clamp(min=1e-12)
        if self.name == "int8":
            return torch.round(x / scale).clamp(-self.qmax - 1, self.qmax) * scale
        return (x / scale).clamp(-self.qmax, self.qmax).to(self.dtype).to(x.dtype) * scale

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` of config.json, field for field as compressed-tensors defines it."""
        args = {"num_bits": 8, "type": self.type, "symmetric": True, "group_size": None, "block_structure": None,
                "actorder": None}
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "minmax",
                                "observer_kwargs": {}},
                    "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None,
                                          "observer_kwargs": {}},
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }


INT8 = Scheme("int8", "int-quantized", "int", torch.int8, 127.0,
              "W8A8-INT8 (compressed-tensors int-quantized: per-channel weights, per-token activations)")
FP8 = Scheme("fp8", "float-quantized", "float", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max),
             "W8A8-FP8 e4m3 (compressed-tensors float-quantized: per-channel weights, per-token activations)")
SCHEMES = {scheme.name: scheme for scheme in (INT8, FP8)}


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 weight [out, in], scale [out, 1] in the weight's dtype).

    The scale is rounded to the source dtype *before* the weight is divided by it, so the stored pair
    dequantizes exactly as computed here (bf16 scales would otherwise differ from the ones used).
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = (absmax / INT8.qmax).clamp(min=torch.finfo(weight.dtype).tiny).to(weight.dtype)
    q = torch.round(w / scale.float()).clamp(-INT8.qmax, INT8.qmax).to(torch.int8)
    return q, scale


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel FP8 e4m3: (float8_e4m3fn weight [out, in], float32 scale [out, 1]).

    scale = absmax / 448, as compressed-tensors computes it; kept in float32 (vLLM holds FP8 weight scales in
    float32), so the largest weight of each row lands exactly on 448. Values are clamped before the cast:
    float8_e4m3fn has no infinity, and an out-of-range cast would give NaN.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8.qmax).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp(-FP8.qmax, FP8.qmax).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight a stored (8-bit weight, per-channel scale) pair stands for."""
    return q.float() * scale.float()


# --- which scheme for this host ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SchemeChoice:
    scheme: Scheme
    reason: str


def nvml_compute_capability() -> tuple[ComputeCapability | None, str]:
    """The lowest CUDA compute capability among this host's GPUs, from NVML; (None, why) without GPUs or NVML.

    The lowest, because a checkpoint written here must serve on every GPU of the host.
    """
    try:
        import pynvml
    except ImportError:
        return None, "NVML is not installed (nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML is unavailable ({exc}): no NVIDIA driver"
    try:
        count = pynvml.nvmlDeviceGetCount()
        capabilities = [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)))
                        for i in range(count)]
    except pynvml.NVMLError as exc:
        return None, f"NVML could not read the GPUs' compute capability ({exc})"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    if not capabilities:
        return None, "NVML sees no GPU"
    low = min(capabilities)
    return (int(low[0]), int(low[1])), f"NVML: {count} GPU(s), lowest compute capability {low[0]}.{low[1]}"


def choose_scheme(requested: str,
                  capability: Callable[[], tuple[ComputeCapability | None, str]] | None = None) -> SchemeChoice:
    """``int8`` and ``fp8`` as asked; ``auto``: FP8 from compute capability 8.9, else INT8 (CPU, no NVML).
    ``capability`` defaults to asking NVML."""
    if requested in SCHEMES:
        return SchemeChoice(SCHEMES[requested], f"--scheme {requested}")
    if requested != "auto":
        raise ValueError(f"unknown scheme {requested!r}; choose one of {', '.join(SCHEME_NAMES)}")
    found, detail = (capability or nvml_compute_capability)()
    if found is None:
        return SchemeChoice(INT8, f"auto: {detail}; INT8 serves on CPUs")
    if found >= FP8_MIN_CAPABILITY:
        return SchemeChoice(FP8, f"auto: {detail} >= 8.9, where FP8 is vLLM's recommended W8A8 format")
    return SchemeChoice(INT8, f"auto: {detail} < 8.9, which has no FP8 tensor cores")


"""The engines' environment: an explicit allow-list taken from the appliance's own, never the whole of it.

Why: an engine is a large third-party program (vLLM, its plugins, its model code with ``trust_remote_code``), and
every child inherits what it is given. The appliance's environment holds its secrets (``APPLIANCE_ADMIN_TOKEN``,
``APPLIANCE_API_KEYS``, ...) and the engines need none of them: they get what vLLM, PyTorch, the GPU stack and the
appliance's launcher and engine plugin read, and nothing else. The replica's own additions (device pinning, the
KV-cache size, the collectors' plugin variables: ``ReplicaSpec.env``) and the launcher's variables are added on
top by the replica.
"""

from __future__ import annotations

from collections.abc import Mapping

# Exact names the engine processes may need.
ALLOWED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
    "TMPDIR", "TMP", "TEMP", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "MALLOC_CONF", "MALLOC_ARENA_MAX", "TOKENIZERS_PARALLELISM", "TIKTOKEN_CACHE_DIR",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
    "COVERAGE_PROCESS_START",
})
# Prefixes of the variable families vLLM, PyTorch, OpenMP, CUDA/NVIDIA/ROCm, Hugging Face, Ray and Python read.
ALLOWED_PREFIXES = (
    "LC_", "VLLM_", "OMP_", "KMP_", "MKL_", "GOMP_", "ONEDNN_", "DNNL_", "CUDA_", "NVIDIA_", "NCCL_", "CUBLAS",
    "CUDNN_", "TORCH", "PYTORCH_", "TRITON_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SAFETENSORS_", "PYTHON",
    "RAY_", "GLOO_", "HIP_", "ROCM_", "ROCR_", "HSA_", "XLA_", "TPU_", "NEURON_", "UCX_", "NVSHMEM_",
)
# The appliance's own variables an engine reads: the launcher's (appliance.engine.launch) and the collectors'
# engine plugin's (appliance.collectors.engine_plugin). Nothing else under APPLIANCE_ passes.
APPLIANCE_ENGINE_PREFIXES = ("APPLIANCE_ENGINE_GRACE_", "APPLIANCE_PARENT_", "APPLIANCE_ENGINE_STATS_")


def allowed(name: str) -> bool:
    """Whether an inherited variable may reach an engine."""
    if name.startswith("APPLIANCE_"):
        return name.startswith(APPLIANCE_ENGINE_PREFIXES)
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def engine_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` an engine inherits."""
    return {name: value for name, value in environ.items() if allowed(name)}

"""The two W8A8 schemes (INT8, FP8 e4m3) and the choice between them from NVML, with and without a GPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from appliance.model.precision import (
    FP8,
    INT8,
    SCHEMES,
    choose_scheme,
    dequantize,
    nvml_compute_capability,
    quantize_weight_fp8,
    quantize_weight_int8,
)


def _weights() -> torch.Tensor:
    torch.manual_seed(0)
    weight = (torch.randn(8, 64) * torch.logspace(-3, 1, 8)[:, None]).to(torch.bfloat16)
    weight[3] = 0
    return weight


def test_int8_weights_are_symmetric_per_channel() -> None:
    weight = _weights()
    q, scale = quantize_weight_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (8, 1)
    assert torch.equal(q[3], torch.zeros(64, dtype=torch.int8))
    nonzero = [i for i in range(8) if i != 3]
    assert (q[nonzero].abs().amax(dim=1) >= 126).all()  # the range is used (bf16 scale rounding allows 126)
    assert ((dequantize(q, scale) - weight.float()).abs() <= scale.float() * 0.51).all()


def test_fp8_weights_are_e4m3_per_channel() -> None:
    weight = _weights()
    q, scale = quantize_weight_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (8, 1)
    assert not torch.isnan(q.float()).any()
    assert torch.equal(q[3].float(), torch.zeros(64))
    nonzero = [i for i in range(8) if i != 3]
    assert torch.equal(q[nonzero].float().abs().amax(dim=1), torch.full((7,), 448.0))  # absmax lands on 448
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a normal value; subnormals (below 2^-6) step by 2^-9
    w = weight.float()
    bound = torch.maximum(w.abs() / 16, scale * 2.0**-10) + 1e-12
    assert ((dequantize(q, scale) - w).abs() <= bound).all()


@pytest.mark.parametrize("scheme", [INT8, FP8])
def test_activations_round_per_token(scheme) -> None:
    x = torch.randn(2, 5, 64) * 3
    x[0, 1] = 0
    y = scheme.fake_quantize(x)
    assert torch.equal(y[0, 1], torch.zeros(64)) and not torch.isnan(y).any()
    step = x.abs().amax(dim=-1, keepdim=True) / scheme.qmax
    bound = step / 2 + 1e-6 if scheme is INT8 else torch.maximum(x.abs() / 16, step * 2.0**-9) + 1e-6
    assert ((y - x).abs() <= bound).all()
    assert torch.allclose(y.abs().amax(dim=-1), x.abs().amax(dim=-1))  # each token's largest value is exact


@pytest.mark.parametrize(("scheme", "preset"), [(INT8, "W8A8"), (FP8, "FP8_DYNAMIC")])
def test_configs_are_compressed_tensors_presets(scheme, preset: str) -> None:
    """Parsed by compressed-tensors itself, and the same quantization as its named preset."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    parsed = ct.QuantizationConfig.model_validate(scheme.quantization_config())
    assert parsed.format == scheme.format
    ours = parsed.config_groups["group_0"]
    theirs = ct.preset_name_to_scheme(preset, ["Linear"])
    for args in ("weights", "input_activations"):
        mine, expected = getattr(ours, args), getattr(theirs, args)
        for field in ("num_bits", "type", "strategy", "symmetric", "dynamic"):
            assert getattr(mine, field) == getattr(expected, field), (args, field)


@pytest.mark.parametrize(("capability", "expected"), [
    ((9, 0), "fp8"),   # Hopper
    ((8, 9), "fp8"),   # Ada
    ((10, 0), "fp8"),  # Blackwell: INT8 W8A8 is unsupported there
    ((8, 6), "int8"),  # Ampere consumer
    ((8, 0), "int8"),  # A100
    ((7, 5), "int8"),  # T4
])
def test_auto_follows_compute_capability(capability: tuple[int, int], expected: str) -> None:
    choice = choose_scheme("auto", lambda: (capability, f"NVML: 1 GPU(s), lowest compute capability {capability}"))
    assert choice.scheme.name == expected and "auto: NVML" in choice.reason


def test_explicit_schemes_and_bad_names() -> None:
    assert choose_scheme("fp8", lambda: pytest.fail("NVML must not be asked")).scheme is FP8
    assert choose_scheme("int8").scheme is INT8
    with pytest.raises(ValueError, match="unknown scheme 'int4'"):
        choose_scheme("int4")
    assert set(SCHEMES) == {"int8", "fp8"}


class _NVMLError(Exception):
    pass


def _fake_pynvml(capabilities: list[tuple[int, int]], init_error: bool = False) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = _NVMLError
    calls = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise _NVMLError("NVML Shared Library Not Found")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(capabilities)
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetCudaComputeCapability = lambda handle: capabilities[handle]
    module.calls = calls
    return module


def test_nvml_lowest_capability_of_all_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml([(9, 0), (8, 0)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    capability, detail = nvml_compute_capability()
    assert capability == (8, 0) and "2 GPU(s)" in detail
    assert fake.calls == ["init", "shutdown"]
    assert choose_scheme("auto").scheme is INT8  # one A100 beside an H100: INT8 serves on both


def test_no_driver_means_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], init_error=True))
    capability, detail = nvml_compute_capability()
    assert capability is None and "no NVIDIA driver" in detail
    choice = choose_scheme("auto")
    assert choice.scheme is INT8 and "INT8 serves on CPUs" in choice.reason


def test_no_nvml_package_means_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert nvml_compute_capability() == (None, "NVML is not installed (nvidia-ml-py)")
    assert choose_scheme("auto").scheme is INT8


def test_no_gpu_means_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([]))
    assert nvml_compute_capability() == (None, "NVML sees no GPU")


def test_this_host() -> None:
    """The real NVML on this host: a CPU machine (no driver) gets INT8; a GPU host gets what its GPUs support."""
    capability, _ = nvml_compute_capability()
    expected = "int8" if capability is None or capability < (8, 9) else "fp8"
    assert choose_scheme("auto").scheme.name == expected


def test_gpu_check_script_exits_cleanly_without_a_gpu() -> None:
    """bench/gpu_check.py, the one script for a lent GPU: where NVML sees none it says so and exits 0."""
    import subprocess
    from pathlib import Path

    if nvml_compute_capability()[0] is not None:
        pytest.skip("this host has a GPU: the script runs its checks instead")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(repo / "bench" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu-check: no NVIDIA GPU here (") and "nothing to check" in done.stdout

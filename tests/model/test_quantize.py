"""The W8A8 quantizer (INT8 and FP8): output layout, size, quality, refusal of bad input, and (slow) serving in
vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from appliance.model import quantize
from appliance.model.quantize import (
    QuantizeError,
    _read_header,
    quantize_checkpoint,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- the happy path --------------------------------------------------------------------------------------------


def test_report_size_and_quality(quantized: tuple[Path, dict], demo_model_dir: Path) -> None:
    dst, report = quantized
    assert report["src"] == str(demo_model_dir) and report["dst"] == str(dst)
    assert report["bytes_before"] == (demo_model_dir / "model.safetensors").stat().st_size
    assert report["bytes_after"] == (dst / "model.safetensors").stat().st_size
    assert report["bytes_after"] <= 0.6 * report["bytes_before"]
    assert report["ratio"] == pytest.approx(report["bytes_after"] / report["bytes_before"], abs=1e-4)
    assert report["quantized_layers"] == 4 * len(LINEARS)
    assert (report["scheme"], report["scheme_reason"]) == ("int8", "--scheme int8")
    assert report["eval_tokens"] >= 256
    assert report["top1_agreement"] >= 0.9
    assert 0 <= report["mean_kl"] < 0.05
    assert report["ppl_after"] == pytest.approx(report["ppl_before"], rel=0.05)
    json.dumps(report)  # the CLI prints it as JSON


def _check_layout(dst: Path, demo_model_dir: Path, weights: torch.dtype, scales: torch.dtype,
                  kept: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """What both schemes write: each linear of a decoder layer as a ``weights`` tensor of its shape with one
    ``scales`` scale per output row, every other tensor (embeddings, norms) as it was (and of dtype ``kept``,
    where given). Returns (original, quantized, scale) of each linear, for the scheme's own checks."""
    original = load_file(demo_model_dir / "model.safetensors")
    tensors = load_file(dst / "model.safetensors")
    linears = []
    for name, tensor in original.items():
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and module.rsplit(".", 1)[-1] in LINEARS:
            q, scale = tensors[name], tensors[module + ".weight_scale"]
            assert q.dtype == weights and q.shape == tensor.shape
            assert scale.dtype == scales and scale.shape == (tensor.shape[0], 1)
            linears.append((tensor, q, scale))
        else:
            assert kept is None or tensors[name].dtype == kept
            assert torch.equal(tensors[name], tensor)
    return linears


def test_tensor_layout(quantized: tuple[Path, dict], demo_model_dir: Path) -> None:
    dst, _ = quantized
    linears = _check_layout(dst, demo_model_dir, torch.int8, torch.bfloat16, kept=torch.bfloat16)
    for tensor, q, scale in linears:
        assert q.abs().max() <= 127
        error = (q.float() * scale.float() - tensor.float()).abs()
        assert (error <= scale.float() * 0.51).all()
    tensors = load_file(dst / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert len(tensors) == len(load_file(demo_model_dir / "model.safetensors")) + 4 * len(LINEARS)


def test_config_and_side_files(quantized: tuple[Path, dict], demo_model_dir: Path) -> None:
    dst, _ = quantized
    config = json.loads((dst / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == json.loads((demo_model_dir / "config.json").read_text())
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
        "compressed-tensors",
        "int-quantized",
        "compressed",
    )
    assert qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    weights, acts = group["weights"], group["input_activations"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (8, "int", True)
    assert (weights["strategy"], weights["dynamic"]) == ("channel", False)
    assert (acts["num_bits"], acts["type"], acts["symmetric"]) == (8, "int", True)
    assert (acts["strategy"], acts["dynamic"]) == ("token", True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (demo_model_dir / name).read_bytes()
    assert not list(dst.parent.glob(".*"))  # the temp dir was renamed, not left behind


def test_config_validates_with_compressed_tensors(quantized: tuple[Path, dict]) -> None:
    ct = pytest.importorskip("compressed_tensors.quantization")
    qc = json.loads((quantized[0] / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    scheme = parsed.config_groups["group_0"]
    assert scheme.weights.strategy == "channel" and scheme.input_activations.dynamic is True


def test_tokenizer_loads_from_quantized_dir(quantized: tuple[Path, dict]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(quantized[0])
    assert tokenizer.decode(tokenizer("def f(): pass")["input_ids"], skip_special_tokens=True) == "def f(): pass"
    assert tokenizer.chat_template


@pytest.mark.parametrize(("dtype", "tag"), [(torch.float16, "F16"), (torch.float32, "F32")])
def test_other_source_dtypes_keep_scales_in_source_dtype(
    demo_model_dir: Path, tmp_path: Path, dtype: torch.dtype, tag: str
) -> None:
    src = _copy(demo_model_dir, tmp_path / "src")
    _rewrite_weights(src, lambda t: t.to(dtype))
    report = quantize_checkpoint(src, tmp_path / "int8", evaluate=False)
    header = _read_header(tmp_path / "int8" / "model.safetensors")
    assert header["model.layers.0.self_attn.q_proj.weight_scale"][0] == tag
    assert header["model.layers.0.self_attn.q_proj.weight"][0] == "I8"
    assert header["model.embed_tokens.weight"][0] == tag
    assert "top1_agreement" not in report


def test_sharded_checkpoint(quantized: tuple[Path, dict], demo_model_dir: Path, tmp_path: Path) -> None:
    src = _copy(demo_model_dir, tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, src / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (src / quantize.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    report = quantize_checkpoint(src, tmp_path / "int8", evaluate=False)
    out = tmp_path / "int8"
    index = json.loads((out / quantize.INDEX_FILE).read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(shards)
    assert index["metadata"]["total_size"] == report["bytes_after"]
    single = load_file(quantized[0] / "model.safetensors")
    assert set(index["weight_map"]) == set(single)
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), single[name])  # same result as the unsharded run


# --- FP8 ------------------------------------------------------------------------------------------------------


def test_fp8_report(quantized_fp8: tuple[Path, dict], demo_model_dir: Path) -> None:
    dst, report = quantized_fp8
    assert report["scheme"] == "fp8" and "float-quantized" in report["format"]
    assert report["bytes_after"] == (dst / "model.safetensors").stat().st_size
    assert report["bytes_after"] <= 0.6 * report["bytes_before"]
    assert report["quantized_layers"] == 4 * len(LINEARS)
    assert report["top1_agreement"] >= 0.9
    assert 0 <= report["mean_kl"] < 0.05
    assert report["ppl_after"] == pytest.approx(report["ppl_before"], rel=0.05)
    json.dumps(report)


def test_fp8_tensor_layout_and_config(quantized_fp8: tuple[Path, dict], demo_model_dir: Path) -> None:
    dst, _ = quantized_fp8
    _check_layout(dst, demo_model_dir, torch.float8_e4m3fn, torch.float32)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "float-quantized")
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("float", "channel")
    assert (group["input_activations"]["type"], group["input_activations"]["strategy"],
            group["input_activations"]["dynamic"]) == ("float", "token", True)


def test_fp8_checkpoint_decompresses_with_compressed_tensors(quantized_fp8: tuple[Path, dict],
                                                            demo_model_dir: Path) -> None:
    """compressed-tensors' own reading of the checkpoint: its config model parses the quantization_config, the
    compressor it registers for the format decompresses every layer to (close to) the original weights."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    dst, _ = quantized_fp8
    config = QuantizationConfig.model_validate(json.loads((dst / "config.json").read_text())["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(config.format)
    assert isinstance(compressor, type) and compressor.__name__ == "FloatQuantizationCompressor", ct.__version__
    scheme = config.config_groups["group_0"]
    assert compressor.can_compress(torch.nn.Linear, scheme)
    original = load_file(demo_model_dir / "model.safetensors")
    tensors = load_file(dst / "model.safetensors")
    checked = 0
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        module = name.removesuffix(".weight_scale")
        state = compressor.decompress({"weight": tensors[module + ".weight"], "weight_scale": tensors[name]}, scheme)
        weight, reference = state["weight"].float(), original[module + ".weight"].float()
        bound = torch.maximum(reference.abs() / 16, tensors[name] * 2.0**-10) + 1e-12  # e4m3: 3 mantissa bits
        assert ((weight - reference).abs() <= bound).all(), module
        checked += 1
    assert checked == 4 * len(LINEARS)


def test_auto_scheme_without_nvml_is_int8(demo_model_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML at all (CPU hosts, containers without a driver)
    report = quantize_checkpoint(demo_model_dir, tmp_path / "auto", scheme="auto", evaluate=False)
    assert report["scheme"] == "int8" and "NVML is not installed" in report["scheme_reason"]
    assert _read_header(tmp_path / "auto" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"][0] == "I8"


def test_auto_scheme_on_hopper_is_fp8(demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.model import precision

    monkeypatch.setattr(precision, "nvml_compute_capability", lambda: ((9, 0), "NVML: 1 GPU(s), 9.0"))
    report = quantize_checkpoint(demo_model_dir, tmp_path / "auto", scheme="auto", evaluate=False)
    assert report["scheme"] == "fp8"
    assert _read_header(tmp_path / "auto" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"][0] == "F8_E4M3"


def test_unknown_scheme_is_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="unknown scheme 'int4'"):
        quantize_checkpoint(demo_model_dir, tmp_path / "x", scheme="int4")
    assert list(tmp_path.iterdir()) == []


# --- refusals --------------------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _rewrite_weights(directory: Path, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    tensors = load_file(directory / "model.safetensors")
    save_file({k: convert(v) for k, v in tensors.items()}, directory / "model.safetensors")


def _missing(demo: Path, tmp: Path) -> Path:
    return tmp / "does-not-exist"


def _a_file(demo: Path, tmp: Path) -> Path:
    path = tmp / "model.safetensors"
    shutil.copy(demo / "model.safetensors", path)
    return path


def _no_config(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    (src / "config.json").unlink()
    return src


def _broken_config(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    (src / "config.json").write_text("{not json")
    return src


def _not_causal(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    _edit_config(src, architectures=["LlamaModel"])
    return src


def _unknown_model_type(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    _edit_config(src, architectures=["MadeUpForCausalLM"], model_type="made-up")
    return src


def _fp8_weights(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    _rewrite_weights(src, lambda t: t.to(torch.float8_e4m3fn))
    return src


def _pytorch_bin_only(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    return src


def _index_missing_shard(demo: Path, tmp: Path) -> Path:
    src = _copy(demo, tmp / "src")
    names = _read_header(src / "model.safetensors")
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(names, "model-00001-of-00002.safetensors")
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (src / quantize.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return src


@pytest.mark.parametrize(
    ("make_src", "message"),
    [
        (_missing, "does not exist"),
        (_a_file, "not a directory"),
        (_no_config, "no config.json"),
        (_broken_config, "not valid JSON"),
        (_not_causal, "not a causal language model"),
        (_unknown_model_type, "cannot load as a causal LM"),
        (_fp8_weights, "F8_E4M3"),
        (_pytorch_bin_only, "no safetensors weights.*pytorch_model.bin"),
        (_index_missing_shard, "missing"),
    ],
)
def test_bad_source_is_refused_and_nothing_written(
    demo_model_dir: Path, tmp_path: Path, make_src: Callable[[Path, Path], Path], message: str
) -> None:
    src = make_src(demo_model_dir, tmp_path)
    dst = tmp_path / "out" / "int8"
    with pytest.raises(QuantizeError, match=message):
        quantize_checkpoint(src, dst)
    assert not (tmp_path / "out").exists()


def test_already_quantized_is_refused(quantized: tuple[Path, dict], tmp_path: Path) -> None:
    dst = tmp_path / "int8-again"
    with pytest.raises(QuantizeError, match="already quantized \\(compressed-tensors\\)"):
        quantize_checkpoint(quantized[0], dst)
    assert list(tmp_path.iterdir()) == []


def test_non_empty_destination_is_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "int8"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint(demo_model_dir, dst)
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8"]


def test_empty_destination_dir_is_used(demo_model_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "int8"
    dst.mkdir()
    quantize_checkpoint(demo_model_dir, dst, evaluate=False)
    assert (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8"]


def test_empty_eval_text_is_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="eval_text is empty"):
        quantize_checkpoint(demo_model_dir, tmp_path / "int8", eval_text="  ")
    assert list(tmp_path.iterdir()) == []


def test_unloadable_tokenizer_fails_the_quality_check_cleanly(demo_model_dir: Path, tmp_path: Path) -> None:
    src = _copy(demo_model_dir, tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink()
    with pytest.raises(QuantizeError, match="evaluate=False"):
        quantize_checkpoint(src, tmp_path / "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    quantize_checkpoint(src, tmp_path / "int8", evaluate=False)  # the weights themselves are fine
    assert (tmp_path / "int8" / "model.safetensors").is_file()


def test_failure_midway_removes_temp_dir(demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(quantize, "evaluate_quality", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        quantize_checkpoint(demo_model_dir, tmp_path / "int8")
    assert list(tmp_path.iterdir()) == []


# --- real vLLM (slow) ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"vLLM not healthy after {timeout:.0f}s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop vLLM's whole process group (API server, engine core, workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # children that outlived the server
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.engine
def test_vllm_serves_the_int8_checkpoint(quantized: tuple[Path, dict], tmp_path: Path) -> None:
    """vLLM CPU loads the checkpoint with its int8 kernel and serves completions and chat completions."""
    pytest.importorskip("vllm")
    model_dir, _ = quantized
    port = _free_port()
    log = tmp_path / "vllm.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "demo-int8",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(port, proc, log, timeout=600)
        completion = _post(
            port, "/v1/completions", {"model": "demo-int8", "prompt": "The class", "max_tokens": 16, "temperature": 0}
        )
        assert completion["usage"]["completion_tokens"] == 16
        assert completion["choices"][0]["text"].strip()
        chat = _post(
            port,
            "/v1/chat/completions",
            {
                "model": "demo-int8",
                "messages": [{"role": "user", "content": "What is a class?"}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] == 16
        # "<s>User: What is a class?\nAssistant:" -- the template's BOS is not doubled by vLLM
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is a class?"}], tokenize=False, add_generation_prompt=True
        )
        assert chat["usage"]["prompt_tokens"] == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    finally:
        _stop(proc)
    text = log.read_text()
    assert "CompressedTensorsW8A8Int8" in text, text[-4000:]

"""Turn a BF16/FP16/FP32 Hugging Face causal LM into a W8A8 compressed-tensors checkpoint (INT8 or FP8).

Why this format: vLLM reads compressed-tensors checkpoints natively, INT8 (``int-quantized``) on CPUs (oneDNN)
and GPUs before Blackwell, FP8 e4m3 (``float-quantized``) on GPUs from Ada/Hopper on (appliance.model.precision
says which scheme suits which host, and picks one for ``--scheme auto``). Neither needs calibration data:

* weights: 8 bits, symmetric, one scale per output channel, computed here from the weights alone;
* activations: 8 bits, symmetric, one scale per token, computed by vLLM at run time (``dynamic``).

Only the Linear layers inside the decoder blocks are quantized. Embeddings, norms and ``lm_head`` stay in the
source dtype: they are a small share of the bytes and the most sensitive to rounding.

The source is processed one safetensors shard at a time, so peak memory is about one shard, not the model.
The optional quality check (appliance.model.quality) runs one decoder layer at a time, so it does not need the
whole model in memory either.

Nothing appears at ``dst`` unless everything succeeded: the checkpoint is assembled in a hidden sibling
directory and renamed into place at the end; on any failure that directory is removed.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appliance.files import replace_folder
from appliance.model import precision
from appliance.model.demo import heldout_text, make_readable, temp_sibling
from appliance.model.precision import Scheme
from appliance.model.quality import QualityError, evaluate_quality

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SOURCE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Weights in other formats: never copied (the output must not carry a second, unquantized copy).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".safetensors")
# A decoder-block parameter: "model.layers.3.mlp.down_proj.weight" and the like (any prefix before "layers").
DECODER_WEIGHT = re.compile(r"(^|\.)layers\.\d+\..+\.weight$")
class QuantizeError(ValueError):
    """The checkpoint cannot be quantized as asked; the message says what is wrong and what to do instead."""


@dataclass(frozen=True)
class _Source:
    """What validation learned about the source checkpoint."""

    path: Path
    config: dict[str, Any]
    shards: list[str]  # safetensors file names, in order
    index: dict[str, Any] | None  # the parsed index file when the checkpoint is sharded


# --- public API ------------------------------------------------------------------------------------------------


def quantize_checkpoint(
    src: Path,
    dst: Path,
    *,
    scheme: str = "int8",
    eval_text: str | None = None,
    evaluate: bool = True,
) -> dict[str, Any]:
    """Write a W8A8 copy of the checkpoint at ``src`` to ``dst`` and report size and quality.

    ``scheme`` is ``int8``, ``fp8`` or ``auto`` (FP8 where NVML reports compute capability >= 8.9, else INT8);
    ``eval_text`` is the text the quality check runs on (default: the demo model's held-out pages);
    ``evaluate=False`` skips the check. Raises QuantizeError, with nothing written to ``dst``, for input that
    cannot work.
    """
    started = time.monotonic()
    src, dst = Path(src), Path(dst)
    try:
        choice = precision.choose_scheme(scheme)
    except ValueError as exc:
        raise QuantizeError(str(exc)) from exc
    source = _inspect_source(src)
    _check_destination(dst)
    if evaluate and eval_text is not None and not eval_text.strip():
        raise QuantizeError("eval_text is empty; pass real text or evaluate=False")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dst)
    try:
        tmp.mkdir()
        quantized = _write_weights(source, tmp, choice.scheme)
        _write_config(source, tmp, choice.scheme)
        _copy_side_files(src, tmp)
        result: dict[str, Any] = {
            "src": str(src),
            "dst": str(dst),
            "scheme": choice.scheme.name,
            "scheme_reason": choice.reason,
            "format": choice.scheme.description,
            "bytes_before": _weights_bytes(src, source.shards),
            "bytes_after": _weights_bytes(tmp, source.shards),
            "quantized_layers": len(quantized),
        }
        result["ratio"] = round(result["bytes_after"] / result["bytes_before"], 4)
        if evaluate:
            text = eval_text if eval_text is not None else heldout_text()
            try:
                result.update(evaluate_quality(src, tmp, text, scheme=choice.scheme))
            except QualityError as exc:
                raise QuantizeError(str(exc)) from exc
        make_readable(tmp)
        replace_folder(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


# --- validation ------------------------------------------------------------------------------------------------


def _inspect_source(src: Path) -> _Source:
    """Check everything that can be checked without writing, so bad input fails before dst is touched."""
    if not src.exists():
        raise QuantizeError(f"source checkpoint {src} does not exist")
    if not src.is_dir():
        raise QuantizeError(f"source {src} is not a directory; pass a Hugging Face checkpoint directory")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise QuantizeError(f"{src} has no config.json, so it is not a Hugging Face model checkpoint")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantizeError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise QuantizeError(f"{config_path} does not hold a JSON object")
    if "quantization_config" in config:
        qconfig = config["quantization_config"]
        method = qconfig.get("quant_method", "unknown method") if isinstance(qconfig, dict) else "unknown method"
        raise QuantizeError(
            f"{src} is already quantized ({method}); quantize the original bf16/fp16 checkpoint instead"
        )
    _check_causal_lm(src, config)
    shards, index = _find_shards(src)
    tensors = {}
    for shard in shards:
        tensors.update(_read_header(src / shard))
    if index is not None:
        missing = sorted(set(index["weight_map"]) - set(tensors))
        if missing:
            raise QuantizeError(f"{src / INDEX_FILE} lists tensors missing from the shards, e.g. {missing[0]}")
    unsupported = sorted({dtype for dtype, _ in tensors.values()} - set(SOURCE_DTYPES))
    if unsupported:
        raise QuantizeError(
            f"{src} has weights in {', '.join(unsupported)}; only bf16, fp16 and fp32 checkpoints can be "
            "quantized (is it already quantized?)"
        )
    targets = [name for name, (_, shape) in tensors.items() if _is_target(name, shape)]
    if not targets:
        raise QuantizeError(f"{src} has no decoder Linear weights (model.layers.N.*.weight) to quantize")
    odd = [name for name, (_, shape) in tensors.items() if DECODER_WEIGHT.search(name) and len(shape) > 2]
    if odd:
        raise QuantizeError(f"{src} has fused/3-D decoder weights ({odd[0]}), which this quantizer does not support")
    return _Source(path=src, config=config, shards=shards, index=index)


def _check_causal_lm(src: Path, config: dict[str, Any]) -> None:
    """Require a *ForCausalLM architecture that this transformers version knows how to build."""
    architectures = config.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures):
        raise QuantizeError(
            f"{src} is not a causal language model (architectures: {architectures or 'none'}); "
            "only *ForCausalLM checkpoints can be served and quantized"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise QuantizeError(
            f"{src} has model_type {model_type!r}, which transformers cannot load as a causal LM "
            "(remote-code models are not supported)"
        )


def _find_shards(src: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The safetensors files that make up the weights (sharded index first, then a single file)."""
    index_path = src / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise QuantizeError(f"{index_path} is not a valid safetensors index: {exc}") from exc
        for shard in shards:
            if not (src / shard).is_file():
                raise QuantizeError(f"{index_path} refers to {shard}, which is missing")
        return shards, index
    if (src / SINGLE_FILE).is_file():
        return [SINGLE_FILE], None
    others = sorted(p.name for p in src.iterdir() if p.suffix in OTHER_WEIGHT_SUFFIXES)
    hint = f" (found {', '.join(others)}; convert it to safetensors first)" if others else ""
    raise QuantizeError(f"{src} has no safetensors weights{hint}")


def _read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor names, dtypes and shapes from a safetensors header, without reading any tensor data."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise QuantizeError(f"{path} is not a readable safetensors file: {exc}") from exc
    return {name: (meta["dtype"], meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def _check_destination(dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        raise QuantizeError(f"destination {dst} already exists and is not empty; choose a new directory")


def _is_target(name: str, shape: list[int]) -> bool:
    """A 2-D weight inside a decoder block is a Linear (norms are 1-D; embeddings live outside the blocks)."""
    return len(shape) == 2 and DECODER_WEIGHT.search(name) is not None


# --- writing ---------------------------------------------------------------------------------------------------


def _write_weights(source: _Source, out: Path, scheme: Scheme) -> list[str]:
    """Quantize shard by shard, keeping shard file names; returns the quantized weight names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    quantized: list[str] = []
    weight_map: dict[str, str] = {}
    for shard in source.shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(source.path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = f.get_tensor(name)
                if _is_target(name, list(tensor.shape)):
                    scale_name = name.removesuffix(".weight") + ".weight_scale"
                    tensors[name], tensors[scale_name] = scheme.quantize_weight(tensor)
                    weight_map[scale_name] = shard
                    quantized.append(name)
                else:
                    tensors[name] = tensor.contiguous()
                weight_map[name] = shard
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        del tensors
    if source.index is not None:
        total = sum(p.stat().st_size for p in (out / s for s in source.shards))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return quantized


def _write_config(source: _Source, out: Path, scheme: Scheme) -> None:
    config = dict(source.config)
    config["quantization_config"] = scheme.quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _copy_side_files(src: Path, out: Path) -> None:
    """Copy tokenizer files, generation_config.json, chat templates, README... (top-level, non-weight files)."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.name in ("config.json", INDEX_FILE):
            continue
        if path.suffix in OTHER_WEIGHT_SUFFIXES:
            continue
        shutil.copy2(path, out / path.name)


def _weights_bytes(directory: Path, shards: list[str]) -> int:
    return sum((directory / shard).stat().st_size for shard in shards)

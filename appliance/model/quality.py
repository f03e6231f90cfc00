"""How much a W8A8 checkpoint changes the model's predictions, computed one decoder layer at a time.

The check compares the source model with a simulation of the quantized one on held-out text, both in float32,
so the only difference is quantization: the simulation swaps every quantized Linear's weight for its
dequantized 8-bit copy (read back from the checkpoint written) and rounds that Linear's input per token
through the scheme's 8-bit type, as vLLM does at run time. It reports top-1 next-token agreement, mean
KL(original || quantized) in nats, and perplexity before and after.

Loading the whole model in float32 would take 4 bytes per parameter (~32 GB for an 8B model). Instead the
calibration windows run through the network layer by layer, as GPTQ-style tools calibrate: a skeleton holding
only what lies outside the decoder layers (embeddings, final norm, LM head) turns tokens into the first
layer's inputs; then each decoder layer is built alone, loaded from the safetensors files, run over every
window twice (original weights on the original stream, quantized weights on the quantized stream, so errors
accumulate as in the served model) and dropped before the next. Peak memory is the skeleton, one layer and
the hidden states: about 5 GB for Llama-3-8B (its untied 128k-token embeddings and LM head are 4 GB of it).

It works for decoder-only models laid out like Llama, Mistral and Qwen2 (``model.layers.N`` between
``model.embed_tokens`` and ``model.norm``), whose layers all take the arguments the first one takes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from appliance.model.precision import Scheme, dequantize

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

EVAL_MAX_TOKENS = 512
EVAL_WINDOW = 128


class QualityError(ValueError):
    """The quality check cannot run on this checkpoint; the message says why and how to skip it."""


class TensorSource:
    """Tensors of a safetensors checkpoint by name, read one at a time (memory-mapped, never the whole file)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._handles = [safe_open(str(path), framework="pt") for path in sorted(directory.glob("*.safetensors"))]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise QualityError(f"the checkpoint has no tensor {name}; cannot evaluate (pass evaluate=False)")
        tensor: torch.Tensor = self._where[name].get_tensor(name)
        return tensor


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the stand-in first layer to stop the forward pass once the layer's inputs are known."""

    def __init__(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.hidden, self.kwargs = hidden, kwargs


class _Catcher(torch.nn.Module):
    """Stands in for the first decoder layer and records what the model passes it."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        if hasattr(layer, "attention_type"):  # models that pick a mask per layer type read it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise QualityError("the decoder layers take positional arguments; cannot evaluate layer by layer")
        raise _Captured(hidden_states, kwargs)


@torch.no_grad()
def evaluate_quality(src: Path, quantized_dir: Path, text: str, *, scheme: Scheme,
                     max_tokens: int = EVAL_MAX_TOKENS, window: int = EVAL_WINDOW) -> dict[str, Any]:
    """Top-1 agreement, mean KL and perplexity of the source vs the quantized checkpoint, layer by layer."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError, KeyError) as exc:
        raise QualityError(f"cannot load {src} with transformers for the quality check ({exc}); "
                           "pass evaluate=False to skip it") from exc
    windows = _token_windows(tokenizer, text, max_tokens=max_tokens, window=window)
    original, quantized = TensorSource(src), TensorSource(quantized_dir)
    skeleton, layers_name, layer_class = _skeleton(config, original)
    config = copy.deepcopy(config)
    config._attn_implementation = skeleton.config._attn_implementation  # as resolved for the model (sdpa...)
    peak = _parameters(skeleton)
    streams = [_layer_inputs(skeleton, layers_name, ids) for ids in windows]
    reference = [hidden for hidden, _ in streams]
    simulated = [hidden.clone() for hidden in reference]
    for index in range(config.num_hidden_layers):
        prefix = f"{layers_name}.{index}."
        with _decoder_layer(layer_class, config, index, original, prefix) as layer:
            peak = max(peak, _parameters(skeleton) + _parameters(layer))
            reference = [_run(layer, hidden, kwargs) for hidden, (_, kwargs) in zip(reference, streams, strict=True)]
            with _simulated(layer, quantized, prefix, scheme):
                simulated = [_run(layer, hidden, kwargs)
                             for hidden, (_, kwargs) in zip(simulated, streams, strict=True)]
    ref_logp = torch.log_softmax(_logits(skeleton, reference), dim=-1)
    sim_logp = torch.log_softmax(_logits(skeleton, simulated), dim=-1)
    targets = torch.cat([ids[1:] for ids in windows])
    return {
        "eval_tokens": int(targets.numel()),
        "top1_agreement": round((ref_logp.argmax(-1) == sim_logp.argmax(-1)).float().mean().item(), 4),
        "mean_kl": round((ref_logp.exp() * (ref_logp - sim_logp)).sum(-1).mean().item(), 6),
        "ppl_before": round(perplexity(ref_logp, targets), 3),
        "ppl_after": round(perplexity(sim_logp, targets), 3),
        "eval_peak_parameters": peak,
    }


def _token_windows(tokenizer: PreTrainedTokenizerBase, text: str, *, max_tokens: int,
                   window: int) -> list[torch.Tensor]:
    """Consecutive windows of the text's tokens, each prefixed with BOS (when the tokenizer has one)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise QualityError("the evaluation text is too short (needs at least 2 tokens)")
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [torch.tensor(prefix + ids[i : i + window]) for i in range(0, len(ids), window) if len(ids[i:]) > 1]


def _skeleton(config: PretrainedConfig, source: TensorSource) -> tuple[PreTrainedModel, str, type[torch.nn.Module]]:
    """The model with its decoder layers reduced to a catcher, everything else loaded in float32; the name of
    its layer list and the class of its layers."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:1]
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    model.tie_weights()  # skipped with the initialisation: a tied LM head must be the embedding itself
    model.eval()
    layers_name, layers = _decoder_layers(model)
    layer_class = type(layers[0])
    layers[0] = _Catcher(layers[0])
    state = model.state_dict()
    tied = {name for name, tensor in state.items()
            for other, shared in state.items() if other != name and tensor.data_ptr() == shared.data_ptr()}
    missing = [name for name in state if name not in source and name not in tied]
    if missing:
        raise QualityError(f"the checkpoint lacks {missing[0]}, which the model expects outside its decoder "
                           "layers; cannot evaluate layer by layer (pass evaluate=False)")
    model.load_state_dict({name: source.get(name) for name in state if name in source}, strict=False)
    return model, layers_name, layer_class


def _decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return name, module
    raise QualityError(f"{type(model).__name__} has no decoder `layers` list; cannot evaluate layer by layer "
                       "(pass evaluate=False)")


def _layer_inputs(model: torch.nn.Module, layers_name: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The first decoder layer's hidden states and keyword arguments (mask, positions) for one window."""
    try:
        model(input_ids=ids[None], use_cache=False)
    except _Captured as captured:
        return captured.hidden, captured.kwargs
    raise QualityError(f"the model never called {layers_name}.0; cannot evaluate layer by layer")


@contextmanager
def _decoder_layer(layer_class: type[torch.nn.Module], config: PretrainedConfig, index: int, source: TensorSource,
                   prefix: str) -> Iterator[torch.nn.Module]:
    """Decoder layer ``index`` alone, in float32, loaded from the checkpoint; dropped on exit."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        layer = layer_class(config, layer_idx=index).float().eval()
    layer.load_state_dict({name: source.get(prefix + name).float() for name in layer.state_dict()})
    try:
        yield layer
    finally:
        del layer


def _run(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    hidden_out: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return hidden_out


@contextmanager
def _simulated(layer: torch.nn.Module, quantized: TensorSource, prefix: str, scheme: Scheme) -> Iterator[None]:
    """The layer as the quantized checkpoint serves it: dequantized 8-bit weights, inputs rounded per token."""
    hooks = []
    for name, module in layer.named_modules():
        scale_name = f"{prefix}{name}.weight_scale"
        if scale_name not in quantized:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise QualityError(f"quantized tensor {prefix}{name} is not a Linear in the model; cannot evaluate "
                               "(pass evaluate=False)")
        module.weight.copy_(dequantize(quantized.get(f"{prefix}{name}.weight"), quantized.get(scale_name)))
        hooks.append(module.register_forward_pre_hook(lambda _m, args: (scheme.fake_quantize(args[0]), *args[1:])))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _logits(model: PreTrainedModel, streams: list[torch.Tensor]) -> torch.Tensor:
    """Final norm and LM head over every window's last hidden states: [positions with a next token, vocab]."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise QualityError(f"{type(model).__name__} has no final `norm`; cannot evaluate layer by layer")
    head = model.get_output_embeddings()
    return torch.cat([head(norm(hidden))[0, :-1].float() for hidden in streams])


def _parameters(module: torch.nn.Module) -> int:
    """Parameters held in memory (tied ones once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def perplexity(logp: torch.Tensor, targets: torch.Tensor) -> float:
    nll = -logp.gather(-1, targets[:, None]).mean().item()
    return math.exp(nll)

"""The layer-by-layer quality check gives the whole-model check's numbers without holding the whole model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from appliance.model import quality
from appliance.model.demo import heldout_text
from appliance.model.precision import FP8, INT8, Scheme, dequantize
from appliance.model.quantize import INDEX_FILE, quantize_checkpoint


@torch.no_grad()
def whole_model_quality(src: Path, quantized_dir: Path, text: str, scheme: Scheme) -> dict:
    """The check as it was before it went layer by layer: the whole model in float32, quantized Linears
    swapped in place and their inputs rounded by hooks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = quality._token_windows(AutoTokenizer.from_pretrained(src), text, max_tokens=quality.EVAL_MAX_TOKENS,
                                     window=quality.EVAL_WINDOW)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    def logits() -> torch.Tensor:
        return torch.cat([model(input_ids=ids[None]).logits[0, :-1].float() for ids in windows])

    reference = logits()
    modules = dict(model.named_modules())
    hooks = []
    for shard in sorted(quantized_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for scale_name in [k for k in f.keys() if k.endswith(".weight_scale")]:  # noqa: SIM118
                module = modules[scale_name.removesuffix(".weight_scale")]
                module.weight.copy_(dequantize(f.get_tensor(scale_name.replace("_scale", "")),
                                               f.get_tensor(scale_name)))
                hooks.append(module.register_forward_pre_hook(lambda _m, a: (scheme.fake_quantize(a[0]),)))
    simulated = logits()
    ref_logp, sim_logp = torch.log_softmax(reference, -1), torch.log_softmax(simulated, -1)
    targets = torch.cat([ids[1:] for ids in windows])
    return {"top1_agreement": (ref_logp.argmax(-1) == sim_logp.argmax(-1)).float().mean().item(),
            "mean_kl": (ref_logp.exp() * (ref_logp - sim_logp)).sum(-1).mean().item(),
            "ppl_before": quality.perplexity(ref_logp, targets), "ppl_after": quality.perplexity(sim_logp, targets)}


@pytest.mark.parametrize(("fixture", "scheme"), [("quantized", INT8), ("quantized_fp8", FP8)])
def test_layer_by_layer_matches_the_whole_model(request: pytest.FixtureRequest, demo_model_dir: Path,
                                                fixture: str, scheme: Scheme) -> None:
    dst, report = request.getfixturevalue(fixture)
    whole = whole_model_quality(demo_model_dir, dst, heldout_text(), scheme)
    assert report["top1_agreement"] == pytest.approx(whole["top1_agreement"], abs=0.004)  # 2 of 512 tokens
    assert report["mean_kl"] == pytest.approx(whole["mean_kl"], rel=0.05, abs=2e-6)
    assert report["ppl_before"] == pytest.approx(whole["ppl_before"], rel=1e-4)
    assert report["ppl_after"] == pytest.approx(whole["ppl_after"], rel=1e-4)


def test_holds_one_decoder_layer_at_a_time(quantized: tuple[Path, dict], demo_model_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak parameters in memory: what lies outside the decoder layers plus one layer, never the whole model
    (which is never loaded: from_pretrained would fail here)."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(demo_model_dir / "model.safetensors")
    total = sum(t.numel() for t in tensors.values())
    layer = sum(t.numel() for n, t in tensors.items() if n.startswith("model.layers.0."))
    outside = sum(t.numel() for n, t in tensors.items() if not n.startswith("model.layers."))

    def refuse(*args, **kwargs):
        raise AssertionError("the quality check loaded the whole model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    result = quality.evaluate_quality(demo_model_dir, quantized[0], heldout_text(), scheme=INT8)
    assert result["eval_peak_parameters"] == outside + layer
    assert result["eval_peak_parameters"] < 0.4 * total  # the demo has 4 layers and tied embeddings
    assert result["top1_agreement"] == quantized[1]["top1_agreement"]


def test_sharded_source_gives_the_same_numbers(quantized: tuple[Path, dict], demo_model_dir: Path,
                                               tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(demo_model_dir, src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, keys in enumerate((names[::2], names[1::2]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in keys}, src / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    report = quantize_checkpoint(src, tmp_path / "int8")
    for key in ("top1_agreement", "mean_kl", "ppl_before", "ppl_after", "eval_tokens"):
        assert report[key] == quantized[1][key], key


def test_too_short_text_is_refused(quantized: tuple[Path, dict], demo_model_dir: Path) -> None:
    with pytest.raises(quality.QualityError, match="too short"):
        quality.evaluate_quality(demo_model_dir, quantized[0], "a", scheme=INT8)

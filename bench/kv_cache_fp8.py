"""FP8 KV cache vs the model's own dtype ("auto"), and FP8 weights, measured through vLLM on the demo model.

One run, one engine at a time (each phase is a child process running vLLM in-process, so that a 2-core host
never holds two engines), then the ratios side by side:

1. KV blocks at the same KV space (``kv_cache_memory_bytes``), fp8 vs auto.
2. Quality with fp8 KV: top-1 agreement with the auto engine, teacher-forced over held-out text (every
   position's greedy next token; vLLM's CPU attention reads K/V back from the cache for prompts too, so the
   fp8 cache is what both prefill and decode see), plus free-running greedy continuations.
3. Decode throughput at batch 1/32/128 (generated tokens/s, best of rounds), fp8 vs auto.
4. A load that overflows the 16-bit KV cache (a closed loop of clients whose sequences need more blocks than a
   small 16-bit cache holds, and fewer than the same bytes hold in fp8): preemptions and TTFT, side by side.
5. FP8 W8A8 weights: the checkpoint ``appliance quantize --scheme fp8`` writes, served by vLLM (the kernel it
   picks), top-1 agreement with the original model computed in torch, next to the INT8 checkpoint's.

Not a test: numbers are printed (and written as JSON with --out), never asserted.

    PYTHONPATH=$PWD .venv/bin/python bench/kv_cache_fp8.py --models-dir var/models [--out var/bench/kv.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT = "RESULT "
MIB = 2**20


# --- child: one engine, one phase ---------------------------------------------------------------------------------


def _windows(model: Path, count: int, length: int) -> list[list[int]]:
    """Held-out text (never trained on) as token windows, BOS first."""
    from transformers import AutoTokenizer

    from appliance.model.demo import heldout_text

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(heldout_text(), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids[i : i + length] for i in range(0, len(ids) - length, length)][:count]


def _engine(spec: dict[str, Any]):
    from vllm import LLM

    return LLM(model=spec["model"], kv_cache_dtype=spec["kv"], kv_cache_memory_bytes=spec["kv_bytes"],
               max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"], seed=0,
               disable_log_stats=False)


def _top1(llm, windows: list[list[int]]) -> list[list[int]]:
    """The engine's greedy next token at every position of every window (teacher-forced)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    tops = []
    for out in outputs:
        positions = out.prompt_logprobs[1:]  # the first position has no logprobs
        tops.append([next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions])
    return tops


def _greedy(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _throughput(llm, prompts: list[list[int]], batches: list[int], tokens: int, rounds: int) -> dict[str, float]:
    """Generated tokens/s for ``batch`` concurrent sequences of ``tokens`` each: the best of the rounds, since on
    a shared host other work only ever slows a round down."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}] * 4, params, use_tqdm=False)  # warm-up
    result = {}
    for batch in batches:
        batch_prompts = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(batch)]
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            outputs = llm.generate(batch_prompts, params, use_tqdm=False)
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            samples.append(generated / (time.perf_counter() - started))
        result[str(batch)] = max(samples)
    return result


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions" and hasattr(m, "value"))


def _overflow(llm, spec: dict[str, Any], windows: list[list[int]]) -> dict[str, Any]:
    """A closed loop of ``concurrency`` clients (each sends its next request when the previous one ends), driven
    through the engine step by step, so the KV demand (concurrency x blocks per request) is the same however
    fast this host runs. TTFT counts from submission to the first token."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=spec["output_tokens"], temperature=0, ignore_eos=True)
    prompts = [windows[i % len(windows)][: spec["prompt_tokens"]] for i in range(spec["requests"])]
    engine = llm.llm_engine
    before = _preemptions(llm)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    preempted: dict[str, int] = {}
    started = time.perf_counter()

    def submit() -> None:
        rid = f"r{len(sent)}"
        engine.add_request(rid, {"prompt_token_ids": prompts[len(sent)]}, params)
        sent[rid] = time.perf_counter()

    for _ in range(min(spec["concurrency"], spec["requests"])):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                if out.metrics is not None:
                    preempted[out.request_id] = out.metrics.num_preemptions
                if len(sent) < spec["requests"]:
                    submit()
    ttft = sorted(first[rid] - sent[rid] for rid in sent)
    return {"preemptions": _preemptions(llm) - before, "requests_preempted": sum(n > 0 for n in preempted.values()),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "seconds": time.perf_counter() - started, "requests": len(ttft)}


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    windows = _windows(Path(spec["tokenizer"]), spec["windows"], spec["window"])
    started = time.perf_counter()
    llm = _engine(spec)
    result: dict[str, Any] = {"start_seconds": time.perf_counter() - started,
                              "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    if spec["phase"] in ("quality", "weights"):
        result["top1"] = _top1(llm, windows)
        result["greedy"] = _greedy(llm, [w[: spec["prompt_tokens"]] for w in windows], spec["greedy_tokens"])
    if spec["phase"] == "quality":
        result["throughput"] = _throughput(llm, [w[:8] for w in windows], spec["batches"], spec["tokens"],
                                           spec["rounds"])
    if spec["phase"] == "overflow":
        result["overflow"] = _overflow(llm, spec, windows)
    return result


# --- parent: run the phases, compare ------------------------------------------------------------------------------


def child(spec: dict[str, Any], logs: Path, timeout: float) -> dict[str, Any]:
    """Run one phase in its own process (its own engine); returns its result and the kernels vLLM picked."""
    name = f"{spec['phase']}-{Path(spec['model']).name}-{spec['kv']}"
    log = logs / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the bytes come from the spec
    print(f"... {name} (log {log})", file=sys.stderr, flush=True)
    with log.open("wb") as sink:  # vLLM logs to stdout and stderr: all of it goes to the log
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=sink,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{name} took longer than {timeout:.0f} s; see {log}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # engine processes the child left behind
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {log}")
    result = json.loads(lines[-1][len(RESULT):])
    result["kernels"] = sorted(set(re.findall(r"Selected (\w+) for (\w+)", text)))
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs), len(pairs)


def torch_top1(model: Path, windows: list[list[int]]) -> list[list[int]]:
    """The original (bf16) model's greedy next tokens in float32 torch: the reference for served weights."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [reference(input_ids=torch.tensor([w])).logits[0, :-1].argmax(-1).tolist() for w in windows]


def round_to_nearest_e4m3(t):
    """K/V through float8_e4m3fn with scale 1.0, rounding to nearest (what CUDA's conversion does)."""
    import torch

    return t.float().clamp(-448, 448).to(torch.float8_e4m3fn).float().to(t.dtype)


def truncate_e4m3(t):
    """K/V through e4m3 with scale 1.0, rounding toward zero: 3 mantissa bits kept, the rest dropped
    (subnormals step by 2^-9 below 2^-6)."""
    import torch

    x = t.float().clamp(-448, 448)
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-9))).clamp(min=-6)
    ulp = 2.0 ** (exponent - 3)
    return (torch.sign(x) * torch.floor(x.abs() / ulp) * ulp).to(t.dtype)


def torch_kv_simulation(model: Path, windows: list[list[int]]) -> dict[str, float]:
    """Top-1 agreement of the original model in float32 with its K/V (after RoPE, as the cache holds them)
    rounded through e4m3, to nearest and toward zero, against the same model with exact K/V."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(round_kv):
        def attention(module, query, key, value, *args, **kwargs):
            return sdpa_attention_forward(module, query, round_kv(key), round_kv(value), *args, **kwargs)
        return attention

    AttentionInterface.register("kv_e4m3_nearest", rounded(round_to_nearest_e4m3))
    AttentionInterface.register("kv_e4m3_toward_zero", rounded(truncate_e4m3))
    tops = {}
    for name in ("sdpa", "kv_e4m3_nearest", "kv_e4m3_toward_zero"):
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=name).eval()
        with torch.no_grad():
            tops[name] = [net(input_ids=torch.tensor([w])).logits[0, :-1].argmax(-1).tolist() for w in windows]
    return {name: agreement(tops[name], tops["sdpa"])[0] for name in ("kv_e4m3_nearest", "kv_e4m3_toward_zero")}


def cpu_fp8_cache_rounding() -> dict[str, float] | None:
    """How vLLM's CPU attention stores K/V in an fp8 cache: a query that attends to one token gets that
    token's V back as the cache holds it; compare with round-to-nearest and round-toward-zero e4m3."""
    import math

    import torch

    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, block = 128, 4, 2, 64, 128
    q, k, v = ((torch.randn(tokens, n, dim) * 0.5).bfloat16() for n in (heads, kv_heads, kv_heads))
    isa = _get_attn_isa(torch.bfloat16, block, dim, "fp8")
    cache = torch.zeros(1, kv_heads, block, 2 * dim, dtype=torch.uint8)
    key_cache, value_cache = cache.view(1, kv_heads, block * 2, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tokens), isa, 1.0, 1.0, "fp8")
    starts, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        kv_cache_dtype="fp8")
    out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
        scale=1 / math.sqrt(dim), causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.zeros(1, 1, dtype=torch.int32), softcap=0.0, scheduler_metadata=metadata, s_aux=None,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8")
    stored = out[0].float()  # query 0 sees token 0 only: the output is V[0] as stored
    v0 = v[0].repeat_interleave(heads // kv_heads, dim=0)
    return {"equals_round_to_nearest": (stored == round_to_nearest_e4m3(v0).float()).float().mean().item(),
            "equals_round_toward_zero": (stored == truncate_e4m3(v0).float()).float().mean().item()}


def ensure_models(models_dir: Path) -> dict[str, Path]:
    from appliance.cli.serve import ensure_demo_model
    from appliance.model.quantize import quantize_checkpoint

    int8 = ensure_demo_model(models_dir)
    fp8 = models_dir / "demo-fp8"
    if not (fp8 / "config.json").is_file():
        print(f"... quantizing {int8.with_name('demo-bf16')} to W8A8 FP8 in {fp8}", file=sys.stderr)
        report = quantize_checkpoint(int8.with_name("demo-bf16"), fp8, scheme="fp8")
        (models_dir / "demo-fp8.quantize.json").write_text(json.dumps(report))
    return {"bf16": int8.with_name("demo-bf16"), "int8": int8, "fp8": fp8}


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = ensure_models(Path(args.models_dir))
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-fp8-"))
    base = {"tokenizer": str(models["int8"]), "windows": args.windows, "window": args.window,
            "prompt_tokens": args.prompt_tokens, "greedy_tokens": args.greedy_tokens, "max_num_seqs": 128,
            "max_model_len": 512, "batches": args.batches,
            "tokens": args.tokens, "rounds": args.rounds}
    space = args.kv_mib * MIB
    overflow = {**base, "phase": "overflow", "kv_bytes": args.overflow_kv_mib * MIB, "requests": args.requests,
                "concurrency": args.concurrency, "output_tokens": args.output_tokens}
    runs: dict[str, dict[str, Any]] = {}
    for kv in ("auto", "fp8"):
        runs[f"quality-{kv}"] = child({**base, "phase": "quality", "model": str(models["int8"]), "kv": kv,
                                       "kv_bytes": space}, logs, args.timeout)
    for kv in ("auto", "fp8"):
        runs[f"overflow-{kv}"] = child({**overflow, "model": str(models["int8"]), "kv": kv}, logs, args.timeout)
    runs["weights-fp8"] = child({**base, "phase": "weights", "model": str(models["fp8"]), "kv": "auto",
                                 "kv_bytes": space}, logs, args.timeout)
    windows = _windows(models["int8"], args.windows, args.window)
    reference = torch_top1(models["bf16"], windows)
    quantize_report = models["fp8"].parent / "demo-fp8.quantize.json"
    return {"settings": {k: v for k, v in vars(args).items()}, "logs": str(logs), "runs": runs,
            "torch_reference_top1": reference, "torch_kv_simulation": torch_kv_simulation(models["bf16"], windows),
            "cpu_fp8_cache_rounding": cpu_fp8_cache_rounding(),
            "fp8_quantize_report": json.loads(quantize_report.read_text()) if quantize_report.is_file() else None}


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    runs = data["runs"]
    auto, fp8 = runs["quality-auto"], runs["quality-fp8"]
    kv_top1, kv_positions = agreement(fp8["top1"], auto["top1"])
    greedy_tokens, _ = agreement(fp8["greedy"], auto["greedy"])
    identical = sum(a == b for a, b in zip(fp8["greedy"], auto["greedy"], strict=True))
    int8_top1, positions = agreement(auto["top1"], data["torch_reference_top1"])
    fp8w_top1, _ = agreement(runs["weights-fp8"]["top1"], data["torch_reference_top1"])
    return {
        "kv_blocks": {"auto": auto["blocks"], "fp8": fp8["blocks"], "ratio": fp8["blocks"] / auto["blocks"]},
        "kv_top1_agreement": kv_top1, "kv_top1_positions": kv_positions,
        "kv_greedy_token_agreement": greedy_tokens, "kv_greedy_identical": [identical, len(auto["greedy"])],
        "kv_top1_vs_torch": {"auto": agreement(auto["top1"], data["torch_reference_top1"])[0],
                             "fp8": agreement(fp8["top1"], data["torch_reference_top1"])[0]},
        "torch_kv_simulation": data["torch_kv_simulation"], "cpu_fp8_cache_rounding": data["cpu_fp8_cache_rounding"],
        "throughput": {b: {"auto": auto["throughput"][b], "fp8": fp8["throughput"][b],
                           "ratio": fp8["throughput"][b] / auto["throughput"][b]} for b in auto["throughput"]},
        "overflow": {kv: runs[f"overflow-{kv}"]["overflow"] | {"blocks": runs[f"overflow-{kv}"]["blocks"]}
                     for kv in ("auto", "fp8")},
        "fp8_weights": {"kernels": runs["weights-fp8"]["kernels"], "served_top1_vs_torch": fp8w_top1,
                        "int8_served_top1_vs_torch": int8_top1, "positions": positions,
                        "quantize_report": data["fp8_quantize_report"]},
    }


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    s = summary
    kv, over = s["kv_blocks"], s["overflow"]
    lines = [
        f"FP8 KV cache vs auto (bf16) on the INT8 demo model, vLLM CPU, {args.kv_mib} MiB of KV space each",
        f"{'':34}{'auto':>10}{'fp8':>10}{'fp8/auto':>10}",
        f"{'KV blocks':34}{kv['auto']:>10}{kv['fp8']:>10}{kv['ratio']:>10.2f}",
    ]
    for batch, row in s["throughput"].items():
        lines.append(f"{'decode tok/s, batch ' + batch:34}{row['auto']:>10.1f}{row['fp8']:>10.1f}{row['ratio']:>10.2f}")
    lines += [
        f"top-1 agreement fp8 vs auto (teacher-forced, {s['kv_top1_positions']} positions): "
        f"{s['kv_top1_agreement']:.4f}",
        f"top-1 agreement with the original model in torch fp32: auto {s['kv_top1_vs_torch']['auto']:.4f}, "
        f"fp8 {s['kv_top1_vs_torch']['fp8']:.4f}",
        f"torch, original model, K/V through e4m3 (scale 1.0) vs exact: round-to-nearest "
        f"{s['torch_kv_simulation']['kv_e4m3_nearest']:.4f}, round-toward-zero "
        f"{s['torch_kv_simulation']['kv_e4m3_toward_zero']:.4f}",
        *([f"vLLM CPU fp8 cache holds round-toward-zero values: "
           f"{s['cpu_fp8_cache_rounding']['equals_round_toward_zero']:.0%} of V elements equal truncation, "
           f"{s['cpu_fp8_cache_rounding']['equals_round_to_nearest']:.0%} round-to-nearest"]
          if s["cpu_fp8_cache_rounding"] else []),
        f"greedy continuations ({args.greedy_tokens} tokens): {s['kv_greedy_identical'][0]}/"
        f"{s['kv_greedy_identical'][1]} identical, token agreement {s['kv_greedy_token_agreement']:.4f}",
        f"overflow load: {args.requests} requests from {args.concurrency} clients in a closed loop, "
        f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens, {args.overflow_kv_mib} MiB of KV space",
        f"{'':34}{'auto':>10}{'fp8':>10}{'fp8/auto':>10}",
        f"{'KV blocks':34}{over['auto']['blocks']:>10}{over['fp8']['blocks']:>10}"
        f"{over['fp8']['blocks'] / over['auto']['blocks']:>10.2f}",
        f"{'preemptions':34}{over['auto']['preemptions']:>10.0f}{over['fp8']['preemptions']:>10.0f}",
        f"{'requests preempted':34}{over['auto']['requests_preempted']:>10}{over['fp8']['requests_preempted']:>10}",
    ]
    for key, label in (("ttft_p50_s", "TTFT p50 (ms)"), ("ttft_p95_s", "TTFT p95 (ms)"),
                       ("seconds", "load duration (s)")):
        scale = 1 if key == "seconds" else 1e3
        a, f = over["auto"][key] * scale, over["fp8"][key] * scale
        lines.append(f"{label:34}{a:>10.1f}{f:>10.1f}{f / a:>10.2f}")
    w = s["fp8_weights"]
    kernels = ", ".join(f"{k} for {scheme}" for k, scheme in w["kernels"]) or "none logged"
    lines += [
        f"FP8 W8A8 weights served by vLLM CPU ({kernels}):",
        f"  top-1 agreement with the original model in torch ({w['positions']} positions): "
        f"FP8 {w['served_top1_vs_torch']:.4f}, INT8 {w['int8_served_top1_vs_torch']:.4f}",
    ]
    if w["quantize_report"]:
        q = w["quantize_report"]
        lines.append(f"  appliance quantize --scheme fp8: {q['bytes_after'] / q['bytes_before']:.3f}x bytes, "
                     f"top-1 {q['top1_agreement']}, KL {q['mean_kl']}, ppl {q['ppl_before']} -> {q['ppl_after']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models-dir", default="var/models")
    parser.add_argument("--kv-mib", type=int, default=1024, help="KV space of the blocks/quality/throughput runs")
    parser.add_argument("--windows", type=int, default=24, help="held-out windows for quality")
    parser.add_argument("--window", type=int, default=128, help="tokens per window")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="prompt of greedy and overflow requests")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per throughput request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--overflow-kv-mib", type=int, default=8)
    parser.add_argument("--requests", type=int, default=54, help="overflow load: requests in all")
    parser.add_argument("--concurrency", type=int, default=18,
                        help="overflow load: clients in a closed loop; 18 x 3 blocks of 128 tokens (96 prompt + 256 "
                             "output) = 54 blocks, over the 32 a 16-bit cache of 8 MiB holds, under fp8's 64")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900, help="per phase, seconds")
    parser.add_argument("--out", type=Path, help="also write every number as JSON here")
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(run_phase(json.loads(args.child))), flush=True)
        return
    data = run(args)
    summary = summarize(data)
    print(render(summary, args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, **data}, indent=1, default=str))


if __name__ == "__main__":
    main()

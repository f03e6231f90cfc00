"""The precision paths on a real NVIDIA GPU, in one short run (under 5 minutes on an idle H100/H200):

1. NVML: what the collectors read (name, memory, utilisation, peak bandwidth, GPM support) and each GPU's
   compute capability, and the scheme ``appliance quantize --scheme auto`` picks from it.
2. FP8 W8A8 weights: the demo model's FP8 checkpoint (``appliance quantize --scheme fp8``) loads in vLLM; the
   kernel vLLM selects, greedy text, and top-1 agreement with the BF16 checkpoint served by vLLM.
3. FP8 KV cache: KV blocks at the same KV space (``kv_cache_memory_bytes``), fp8 vs auto.

Each check says why it is skipped when its prerequisite is missing (no NVML, no CUDA, no CUDA build of vLLM,
no models): with no GPU at all the script prints one line and exits 0. Exit 1 only when a check that could
run failed. Numbers are printed (and written as JSON with --out), never asserted beyond "it ran".

    python bench/gpu_check.py --models-dir var/models [--out gpu-check.json]

The models directory needs demo-bf16 and demo-fp8 (build them where torch is installed:
``appliance demo-model DIR/demo-bf16`` then ``appliance quantize DIR/demo-bf16 DIR/demo-fp8 --scheme fp8``);
the script builds them itself when they are missing and the appliance's dependencies are importable.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT = "RESULT "
KV_SPACE_BYTES = 2 * 2**30
PROMPTS = ["The class statement", "A function definition", "The import system", "Exceptions are raised when"]


def nvml_check() -> dict[str, Any] | None:
    """Every GPU as NVML and the appliance's collector read it; None when NVML sees no GPU."""
    from appliance.collectors.nvml import NvmlSource
    from appliance.model.precision import choose_scheme, nvml_compute_capability

    capability, detail = nvml_compute_capability()
    if capability is None:
        return None
    source = NvmlSource()
    readings = [{"index": r.index, "name": r.name, "memory_total_bytes": r.memory_total_bytes,
                 "memory_used_bytes": r.memory_used_bytes, "utilization": r.utilization,
                 "peak_bandwidth_bytes_per_second": r.peak_bandwidth_bytes_per_second,
                 "power_watts": r.power_watts, "gpm": bool(r.gpm)} for r in source.readings()]
    choice = choose_scheme("auto")
    return {"lowest_capability": list(capability), "detail": detail, "gpus": readings,
            "nvml_read_failures": source.failures, "auto_scheme": choice.scheme.name, "auto_reason": choice.reason}


def ensure_models(models_dir: Path) -> dict[str, Path]:
    bf16, fp8 = models_dir / "demo-bf16", models_dir / "demo-fp8"
    if not (bf16 / "config.json").is_file():
        from appliance.model.demo import build_demo_model

        print(f"gpu-check: building the demo model in {bf16}", flush=True)
        build_demo_model(bf16, overwrite=True)
    if not (fp8 / "config.json").is_file():
        from appliance.model.quantize import quantize_checkpoint

        print(f"gpu-check: quantizing it to FP8 in {fp8}", flush=True)
        quantize_checkpoint(bf16, fp8, scheme="fp8", evaluate=False)
    return {"bf16": bf16, "fp8": fp8}


def engine_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM engine (in a child process): KV blocks, greedy text, teacher-forced top-1 of the prompts."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv"], kv_cache_memory_bytes=KV_SPACE_BYTES,
              max_model_len=512, max_num_seqs=64, enforce_eager=True, seed=0)
    start_s = time.perf_counter() - started
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    scored = llm.generate(spec["prompts"], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                          use_tqdm=False)
    top1 = [[next(t for t, lp in pos.items() if lp.rank == 1) for pos in out.prompt_logprobs[1:]] for out in scored]
    return {"start_seconds": round(start_s, 1), "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "text": [o.outputs[0].text for o in greedy], "top1": top1}


def child(spec: dict[str, Any], log: Path, timeout: float) -> dict[str, Any]:
    """Run one engine in its own process (the GPU is free again when it exits); its kernels from its log."""
    with log.open("wb") as sink:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], stdout=sink,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"{spec['model']} kv={spec['kv']}: exit {proc.returncode}; log {log}:\n{tail}")
    result = json.loads(lines[-1][len(RESULT):])
    result["kernels"] = sorted(set(re.findall(r"Selected (\w+) for (\w+)", text)))
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def vllm_checks(models: dict[str, Path], timeout: float) -> dict[str, Any]:
    """FP8 weights vs BF16, and fp8 KV vs auto, through vLLM on the GPU."""
    from appliance.model.demo import heldout_text

    text = heldout_text()
    prompts = [text[i : i + 600] for i in range(0, 600 * 8, 600)]  # ~128 tokens each
    logs = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runs = {}
    for name, model, kv in (("bf16-auto", models["bf16"], "auto"), ("fp8w-auto", models["fp8"], "auto"),
                            ("fp8w-fp8kv", models["fp8"], "fp8")):
        print(f"gpu-check: {name} (log {logs / name}.log)", flush=True)
        runs[name] = child({"model": str(model), "kv": kv, "prompts": prompts}, logs / f"{name}.log", timeout)
    return {
        "runs": {k: {key: v for key, v in r.items() if key != "top1"} for k, r in runs.items()},
        "fp8_weights_top1_vs_bf16": agreement(runs["fp8w-auto"]["top1"], runs["bf16-auto"]["top1"]),
        "fp8_kv_top1_vs_auto": agreement(runs["fp8w-fp8kv"]["top1"], runs["fp8w-auto"]["top1"]),
        "fp8_kv_blocks_ratio": runs["fp8w-fp8kv"]["blocks"] / runs["fp8w-auto"]["blocks"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("var/models"))
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=240, help="per engine, seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(engine_run(json.loads(args.child))), flush=True)
        return 0
    try:
        nvml = nvml_check()
    except ImportError as exc:
        print(f"gpu-check: cannot import the appliance's NVML reader ({exc}); run from the repository root")
        return 0
    if nvml is None:
        from appliance.model.precision import nvml_compute_capability

        print(f"gpu-check: no NVIDIA GPU here ({nvml_compute_capability()[1]}); nothing to check")
        return 0
    report: dict[str, Any] = {"nvml": nvml}
    print(json.dumps({"nvml": nvml}, indent=1), flush=True)
    failed = False
    try:
        import torch
        import vllm  # noqa: F401

        cuda = torch.cuda.is_available()
    except ImportError as exc:
        report["vllm"] = f"skipped: {exc}"
    else:
        if not cuda:
            report["vllm"] = "skipped: torch has no CUDA here (a CPU build of torch/vLLM)"
        else:
            try:
                report["vllm"] = vllm_checks(ensure_models(args.models_dir), args.timeout)
            except Exception as exc:  # a check that could run and did not: report it, exit 1
                report["vllm"] = f"failed: {type(exc).__name__}: {exc}"
                failed = True
    print(json.dumps({"vllm": report["vllm"]}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

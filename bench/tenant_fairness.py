"""Fair share between tenants: a victim tenant's TTFT while another tenant floods, FIFO vs fair share vs fair
share plus the engine's priority, with a flood that reads its streams to the end and one that leaves each stream at
its first token.

One real vLLM replica (the CPU build, the demo model) at a time and two gateways in front of it, identical but for
``admission.fair_share`` (the appliance's own gateway: on; a second one routing to the same engine by URL: off),
both with two tenants from APPLIANCE_TENANTS. The engine runs twice, once per scheduling policy (an engine flag):
``fcfs`` (vLLM's default) and ``priority`` (the gateway writes each request's priority: the flood, over its fair
share, goes behind the victim inside the engine too). In one run, one phase at a time:

1. ``alone``: the victim (``--victim-concurrency`` clients, ``--victim-tokens``-token streams) with nobody else.
2. per flood kind, ``read`` (the aggressor's clients read each stream to the end) and ``leave`` (they hang up at
   the first token and send the next request at once, as a client that times out or reconnects in a loop): the
   aggressor floods (``--aggressor-concurrency`` clients of ``--aggressor-tokens``-token streams) through a gateway;
   once its flood has run ``--ramp-seconds`` alone, the victim runs again through the same gateway. With the
   ``fcfs`` engine through the FIFO gateway and the fair-share gateway; with the ``priority`` engine through the
   fair-share gateway (fair share plus engine priority).

It prints the victim's TTFT p50/p90 per phase with ratios to alone (of the same engine run), and the aggressor's
throughput while the victim runs against its throughput in a phase of the same length with the victim idle
(``aggressor alone``; tokens/s for ``read``, requests/s for ``leave``, whose clients read one token each). A phase
runs the victim for ``--phase-seconds`` and then waits for its last requests' first tokens (so slow answers count,
they are not cut off). Numbers, never assertions. Goal (issue 34): victim p90 within 1.2x of alone in both flood
kinds, and the aggressor keeps at least 0.8x of its throughput.

Settings, as an SRE would set them for this replica (each a flag):
- ``engine.max_num_seqs`` 8, and the admission limit pinned to it (initial = min = max): on one CPU core a batch
  beyond a handful of sequences stretches every step, so the gateway, not the engine, should hold the rest of a
  flood, in an order it chooses. Pinned so that the AIMD limit's own reaction to the flood does not blur the
  comparison (it would cut both paths' limit alike). ``--limit`` above it lets requests wait inside the engine,
  where its priority acts.
- ``admission.queue_timeout_seconds`` 300: the FIFO path must answer late rather than 429, or its victim TTFT
  would be a count of refusals.
- ``admission.share_window_seconds`` 2 (the default): the victim's clients send their next request within
  milliseconds of the last one's end; its share stays free for it meanwhile instead of going to the flood.

    .venv/bin/python bench/tenant_fairness.py [--phase-seconds 60] [--max-num-seqs 8] [--limit 8]
        [--floods read,leave] [--policies fcfs,priority] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.cli.serve import ensure_demo_model  # noqa: E402
from appliance.loadtest.client import RequestResult, build_body, monotonic_clock, stream_request  # noqa: E402
from appliance.loadtest.stats import percentile  # noqa: E402
from bench.gateway_overhead import split_cores, start, stop, wait_ok  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEYS = {"victim": "victim-key-0123456789", "aggressor": "aggressor-key-0123456789"}
_WORD_TEXT = ("the of and to in is was that for on as with by at from this be or has had not but one all their there "
              "been its more when who will would can them time into only some other than then could these two")
WORDS = tuple(_WORD_TEXT.split(" "))


def demo_model(models_dir: str | None) -> Path:
    """``--model`` if given; else a demo model the tests already built (var/test-cache), else build one."""
    if models_dir:
        return Path(models_dir)
    built = sorted((REPO / "var" / "test-cache").glob("models-*/demo-int8/config.json"),
                   key=lambda path: path.stat().st_mtime)
    return built[-1].parent if built else ensure_demo_model(REPO / "var" / "models")


def prompt(index: int, words: int) -> str:
    """A distinct prompt of about ``words`` words (distinct so the prefix cache does not answer it)."""
    return f"Request {index}. " + " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(words))


@dataclass
class Tally:
    results: list[RequestResult] = field(default_factory=list)


async def client_loop(session: aiohttp.ClientSession, url: str, tenant: str, tokens: int, tally: Tally,
                      stop_at: float | None, clock, counter: list[int], leave: bool = False,
                      keys: dict[str, str] = KEYS) -> None:
    """One closed-loop client: a request, then the next as soon as it ends (``leave``: as soon as its first token
    came, hanging up on the rest), until ``stop_at`` (None: until cancelled). ``keys``: tenant -> API key."""
    headers = {"authorization": f"Bearer {keys[tenant]}"}
    while stop_at is None or clock() < stop_at:
        counter[0] += 1
        body = build_body("demo", {"prompt": prompt(counter[0], 48)}, tokens, ignore_eos=True)
        result = RequestResult(index=counter[0], phase="measure", intended=clock())
        tally.results.append(result)
        request = stream_request(session, url + "/v1/completions", body, result, clock, timeout=900,
                                 headers=headers)
        if not leave:
            await request
            continue
        task = asyncio.ensure_future(request)
        while not task.done() and result.first_token is None:
            await asyncio.sleep(0.005)
        task.cancel()  # the connection closes: the gateway sees its client leave
        await asyncio.gather(task, return_exceptions=True)


def ttfts(tally: Tally) -> list[float]:
    return [r.first_token - r.sent for r in tally.results if r.ok and r.first_token is not None]


def tokens_between(tally: Tally, start: float, end: float) -> int:
    return sum(1 for r in tally.results for t in r.chunk_times if start <= t <= end)


def firsts_between(tally: Tally, start: float, end: float) -> int:
    """Requests whose first token came in [start, end]: a leaving flood's throughput."""
    return sum(1 for r in tally.results if r.first_token is not None and start <= r.first_token <= end)


async def engine_idle(engine_url: str, timeout: float = 120) -> None:
    """Wait until the engine runs and queues nothing (the previous phase's streams were aborted)."""
    pattern = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            text = (await http.get(engine_url + "/metrics")).text
            if sum(float(value) for _, value in pattern.findall(text)) == 0:
                return
            await asyncio.sleep(0.5)
    print(f"warning: the engine was still busy after {timeout:.0f}s", flush=True)


async def phase(url: str, args: argparse.Namespace, *, flood: str | None, victim_runs: bool = True) -> dict:
    """The victim for ``--phase-seconds`` (after the flood's ramp when ``flood`` is read or leave); its TTFTs and
    the aggressor's throughput over the victim's window (``victim_runs`` False: the same window, the victim idle:
    the aggressor's throughput alone)."""
    clock = monotonic_clock()
    counter = [0]
    victim, aggressor = Tally(), Tally()
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits) as session:
        flooding = [asyncio.create_task(client_loop(session, url, "aggressor", args.aggressor_tokens, aggressor,
                                                    None, clock, counter, leave=flood == "leave"))
                    for _ in range(args.aggressor_concurrency if flood else 0)]
        if flood:
            await asyncio.sleep(args.ramp_seconds)
        start_at = clock()
        await asyncio.gather(*(client_loop(session, url, "victim", args.victim_tokens, victim,
                                           start_at + args.phase_seconds, clock, counter)
                               for _ in range(args.victim_concurrency if victim_runs else 0)))
        if not victim_runs:
            await asyncio.sleep(args.phase_seconds)
        end_at = clock()
        for task in flooding:
            task.cancel()
        await asyncio.gather(*flooding, return_exceptions=True)
    times = ttfts(victim)
    errors = [r.error for r in victim.results if not r.ok]
    done = firsts_between if flood == "leave" else tokens_between
    return {"n": len(times), "errors": len(errors), "first_error": errors[0] if errors else None,
            "p50": percentile(times, 50), "p90": percentile(times, 90),
            "aggressor": done(aggressor, start_at, end_at) / (end_at - start_at) if flood else None,
            "aggressor_errors": sum(1 for r in aggressor.results if r.error and "Cancelled" not in r.error),
            "seconds": end_at - start_at}


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(f"\nvictim: {args.victim_concurrency} clients x {args.victim_tokens}-token streams; aggressor: "
          f"{args.aggressor_concurrency} clients x {args.aggressor_tokens}-token streams (read: to the end; leave: "
          f"hang up at the first token); one replica, max_num_seqs {args.max_num_seqs}, admission limit "
          f"{args.limit or args.max_num_seqs}")
    print(f"{'engine':<9} {'phase':<24} {'n':>4} {'err':>4} {'TTFT p50 ms':>11} {'p90 ms':>8} {'p50 x alone':>11} "
          f"{'p90 x alone':>11} {'aggressor':>12} {'x idle':>7}")
    for policy, phases in results.items():
        alone = phases["alone"]
        for name, r in phases.items():
            ratios = [f"{r[k] / alone[k]:.2f}" if r[k] is not None and alone[k] else "-" for k in ("p50", "p90")]
            p50, p90 = (f"{1000 * r[k]:.0f}" if r[k] is not None else "-" for k in ("p50", "p90"))
            unit = "req/s" if "leave" in name else "tok/s"
            alone_flood = phases.get(f"{name.split(',')[0]}, aggressor alone")
            kept = (f"{r['aggressor'] / alone_flood['aggressor']:.2f}"
                    if r["aggressor"] is not None and alone_flood and alone_flood["aggressor"] else "-")
            got = f"{r['aggressor']:.1f} {unit}" if r["aggressor"] is not None else "-"
            print(f"{policy:<9} {name:<24} {r['n']:>4} {r['errors']:>4} {p50:>11} {p90:>8} {ratios[0]:>11} "
                  f"{ratios[1]:>11} {got:>12} {kept:>7}")
            if r["first_error"]:
                print(f"  first victim error: {r['first_error']}")
    print("goal: victim TTFT p90 within 1.2x of alone under both floods; aggressor x idle >= 0.8")


def run_policy(policy: str, model: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One engine scheduling by ``policy`` behind a fair-share gateway (and, for fcfs, a FIFO one): the victim
    alone, then under each flood kind through each gateway."""
    state = Path(tempfile.mkdtemp(prefix=f"bench-tenants-{policy}-"))
    engine_port, fair_port, fifo_port = args.base_port, args.base_port + 10, args.base_port + 11
    tenants = [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]
    limit = str(args.limit or args.max_num_seqs)
    common = {"APPLIANCE_STATE_DIR": str(state), "APPLIANCE_TENANTS": json.dumps(tenants),
              "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "512",
              "APPLIANCE_ADMISSION__INITIAL_LIMIT": limit, "APPLIANCE_ADMISSION__MIN_LIMIT": limit,
              "APPLIANCE_ADMISSION__MAX_LIMIT": limit,
              "APPLIANCE_ADMISSION__QUEUE_TIMEOUT_SECONDS": str(args.queue_timeout),
              "APPLIANCE_ADMISSION__SHARE_WINDOW_SECONDS": str(args.share_window),
              "APPLIANCE_REQUEST_TIMEOUT_SECONDS": "900",
              # both gateways call the one engine: the key it requires, shared (unset, the appliance makes one)
              "APPLIANCE_GATEWAY__ENGINE_KEY": "bench-engine-key-0123456789"}
    engine_cores, other_cores = split_cores()
    started = time.monotonic()
    fair = start([sys.executable, "-m", "appliance.cli", "serve"],
                 {**common, "APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo",
                  "APPLIANCE_PORT": str(fair_port), "APPLIANCE_ENGINE_BASE_PORT": str(engine_port),
                  "APPLIANCE_ENGINE__SCHEDULING_POLICY": policy,
                  "APPLIANCE_ADMISSION__FAIR_SHARE": "true"}, state / "fair.log", engine_cores)
    procs = [fair]
    try:
        wait_ok(f"http://127.0.0.1:{fair_port}/health/ready", fair)
        os.sched_setaffinity(fair.pid, other_cores)  # the gateways and the clients off the engine's core
        os.sched_setaffinity(0, other_cores)
        gateways = {"fair share" if policy == "fcfs" else "fair share + priority": f"http://127.0.0.1:{fair_port}"}
        if policy == "fcfs":
            fifo = start([sys.executable, "-m", "appliance.cli", "serve"],
                         {**common, "APPLIANCE_ENGINE_URLS": f"http://127.0.0.1:{engine_port}",
                          "APPLIANCE_SERVED_MODEL_NAME": "demo", "APPLIANCE_PORT": str(fifo_port),
                          "APPLIANCE_ADMISSION__FAIR_SHARE": "false"}, state / "fifo.log", other_cores)
            procs.append(fifo)
            wait_ok(f"http://127.0.0.1:{fifo_port}/health/ready", fifo)
            gateways = {"FIFO": f"http://127.0.0.1:{fifo_port}", **gateways}
        print(f"{policy}: engine and gateways ready in {time.monotonic() - started:.0f}s (logs {state})", flush=True)
        engine_url, fair_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{fair_port}"
        asyncio.run(phase(fair_url, argparse.Namespace(**{**vars(args), "phase_seconds": 5}), flood=None))  # warm-up
        runs: list[tuple[str, str, str | None, bool]] = [("alone", fair_url, None, True)]
        for flood in args.floods.split(","):
            runs.append((f"{flood}, aggressor alone", fair_url, flood, False))
            runs += [(f"{flood}, {name}", url, flood, True) for name, url in gateways.items()]
        results: dict[str, dict] = {}
        for name, url, flood, victim_runs in runs:
            asyncio.run(engine_idle(engine_url))
            results[name] = asyncio.run(phase(url, args, flood=flood, victim_runs=victim_runs))
            print(f"{policy} {name}: done ({results[name]['seconds']:.0f}s, {results[name]['n']} victim requests)",
                  flush=True)
        return results
    finally:
        for proc in reversed(procs):
            stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-seconds", type=float, default=60, help="victim run per phase (default 60)")
    parser.add_argument("--ramp-seconds", type=float, default=8, help="flood before the victim starts (default 8)")
    parser.add_argument("--victim-concurrency", type=int, default=2)
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--aggressor-concurrency", type=int, default=16)
    parser.add_argument("--aggressor-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's batch (default 8)")
    parser.add_argument("--limit", type=int, default=None, help="admission limit (default: max-num-seqs)")
    parser.add_argument("--queue-timeout", type=float, default=300)
    parser.add_argument("--share-window", type=float, default=2.0)
    parser.add_argument("--floods", default="read,leave", help="flood kinds: read, leave")
    parser.add_argument("--policies", default="fcfs,priority", help="engine scheduling policies, one run each")
    parser.add_argument("--base-port", type=int, default=18600)
    parser.add_argument("--model", default=None, help="model directory (default: the tests' demo model)")
    args = parser.parse_args()
    model = demo_model(args.model)
    started = time.monotonic()
    results = {policy: run_policy(policy, model, args) for policy in args.policies.split(",")}
    report(results, args)
    print(f"total {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()

"""What tenants are charged against what the engine did: the tokens each tenant is charged (``prompt`` +
``completion`` + ``estimated`` of ``appliance_tenant_tokens_total``) over the engine's own counters
(``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``), per way a client uses its answers.

Real vLLM replicas (the CPU build, the demo model; ``--replicas``, 2 by default) behind the appliance's gateway, one
tenant per behaviour, one phase at a time, the engines idle between phases:

1. ``whole``: clients read every answer to its end (half streams, half non-streaming).
2. ``leave stream``: streaming clients that close the connection after a few chunks (drawn 1-40), mid-answer.
3. ``timeout``: non-streaming clients whose own timeout (drawn 0.3-1.5 s) ends before the answer.
4. ``mixed``: the three at once, interleaved.
5. ``mixed + kill`` (two replicas or more): the same, and once a third of its requests have ended, the vLLM server
   of the replica running the most is SIGKILLed, its counters read just before: its streams continue on another
   replica, its non-streaming answers run again there, and the supervisor restarts it. Its engine's work is what
   its counters said at its death plus what its new process counts.

It prints, per phase, the engine's tokens, what the tenant was charged (and the part of it that is not an engine's
report: the gateway's estimate, or its share of the engine's count at rest) and their ratio: 1.0 is exact, below 1
work went uncharged, above 1 the tenant paid for more than the engine did. Each ``--holds`` value is one pass with
its own appliance (``gateway.unseen_hold_seconds``; 0: estimates charged as they are, as before work no engine
reported waited for a rest), the same seed, one after the other in one run, and a last table puts their ratios side
by side. Numbers, never assertions.

    .venv/bin/python bench/tenant_charging.py [--requests 24] [--concurrency 4] [--max-tokens 256] [--model DIR]
        [--holds 30,0] [--replicas 2] [--phases all]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_overhead import start, stop, wait_ok  # noqa: E402
from bench.tenant_fairness import WORDS, demo_model, engine_idle  # noqa: E402

PHASES = ("whole", "leave stream", "timeout")
KILL = "mixed + kill"
KEYS = {phase: f"{phase.replace(' ', '-')}-key-0123456789" for phase in PHASES}
TENANT = {phase: phase.replace(" ", "-") for phase in PHASES}
METRICS_TOKEN = "bench-metrics-token"
KINDS = ("prompt", "completion", "estimated")
UNSEEN = ("engine", "estimate")  # how the gateway charged work no engine reported
ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
SIDES = ("prompt", "completion")  # the reconciliation's kinds, each against its engine counter above


def prompt(rng: random.Random, index: int) -> str:
    return f"Request {index}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))


async def whole(http: httpx.AsyncClient, url: str, body: dict, key: str, index: int) -> None:
    headers = {"authorization": f"Bearer {key}"}
    if index % 2:
        response = await http.post(url, json=body, headers=headers, timeout=600)
        response.raise_for_status()
        return
    async with http.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=600) as response:
        async for _ in response.aiter_bytes():
            pass


async def leave_stream(http: httpx.AsyncClient, url: str, body: dict, key: str, chunks: int) -> None:
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=600) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: {")
            if seen >= chunks:
                break  # the connection closes with the context: the client left


async def time_out(http: httpx.AsyncClient, url: str, body: dict, key: str, seconds: float) -> None:
    with contextlib.suppress(httpx.TimeoutException):
        await http.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=seconds)


async def run_phase(gateway: str, names: tuple[str, ...], args: argparse.Namespace, rng: random.Random,
                    strike: Callable[[], None] | None = None) -> None:
    """``args.requests`` requests of each behaviour in ``names``, ``args.concurrency`` at a time, interleaved;
    ``strike`` once a third of them have ended."""
    url = gateway + "/v1/completions"
    jobs: list[tuple[str, dict, int, float]] = []  # behaviour, body, index, its chunks or timeout
    for i in range(args.requests):
        for name in names:
            body = {"model": "demo", "prompt": prompt(rng, i), "max_tokens": args.max_tokens, "ignore_eos": True,
                    "temperature": 0}
            jobs.append((name, body, i, rng.randint(1, 40) if name == "leave stream" else rng.uniform(0.3, 1.5)))
    rng.shuffle(jobs)
    limit = asyncio.Semaphore(args.concurrency)
    ended = 0

    async def one(http: httpx.AsyncClient, name: str, body: dict, index: int, param: float) -> None:
        nonlocal ended
        async with limit:
            if name == "whole":
                await whole(http, url, body, KEYS[name], index)
            elif name == "leave stream":
                await leave_stream(http, url, body, KEYS[name], int(param))
            else:
                await time_out(http, url, body, KEYS[name], param)
        ended += 1
        if strike is not None and ended == len(jobs) // 3:
            strike()

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as http:
        await asyncio.gather(*(one(http, *job) for job in jobs))


def scrape(url: str, names: tuple[str, ...], headers: dict[str, str] | None = None) -> dict[str, float]:
    text = httpx.get(url, headers=headers, timeout=30).text
    out: dict[str, float] = {}
    for name in names:
        pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
        for labels, value in pattern.findall(text):
            out[f"{name}{labels}"] = out.get(f"{name}{labels}", 0.0) + float(value)
    return out


def counters(engine: str) -> dict[str, float]:
    """One engine's own counters, by side."""
    counted = scrape(engine + "/metrics", ENGINE_COUNTERS)
    return {side: sum(v for k, v in counted.items() if k.startswith(name))
            for side, name in zip(SIDES, ENGINE_COUNTERS, strict=True)}


def totals(gateway: str, engines: list[str]) -> dict[str, float]:
    """The engines' counters (both kinds, and each), each tenant's charges by kind, and the reconciliation's
    tenants' side over every replica (charges split into prompt and completion, estimates included)."""
    tenants = scrape(gateway + "/metrics", ("appliance_tenant_tokens_total",
                                            "appliance_tenant_reconciled_tokens_total",
                                            "appliance_tenant_unseen_requests_total", "appliance_tenant_unseen_held"),
                     {"authorization": f"Bearer {METRICS_TOKEN}"})
    got: dict[str, float] = {}
    for index, engine in enumerate(engines):
        for side, value in counters(engine).items():
            got[f"engine/{side}"] = got.get(f"engine/{side}", 0.0) + value
            got[f"engine-{index}/{side}"] = value
    got["engine"] = sum(got[f"engine/{side}"] for side in SIDES)
    for side in SIDES:
        got[f"charged/{side}"] = sum(v for k, v in tenants.items() if k.startswith(
            "appliance_tenant_reconciled_tokens_total") and f'kind="{side}"' in k and 'side="tenants"' in k)
    for how in UNSEEN:
        got[f"unseen/{how}"] = sum(v for k, v in tenants.items() if k.startswith(
            "appliance_tenant_unseen_requests_total") and f'charged="{how}"' in k)
        for index in range(len(engines)):
            got[f"unseen-{index}/{how}"] = sum(v for k, v in tenants.items() if k.startswith(
                "appliance_tenant_unseen_requests_total") and f'charged="{how}"' in k
                and f'replica="replica-{index}"' in k)
    got["held"] = sum(v for k, v in tenants.items() if k.startswith("appliance_tenant_unseen_held"))
    for phase in PHASES:
        for kind in KINDS:
            got[f"{phase}/{kind}"] = tenants.get(
                f'appliance_tenant_tokens_total{{kind="{kind}",tenant="{TENANT[phase]}"}}', 0.0)
    return got


def engine_rise(after: dict[str, float], deaths: dict[int, dict[str, float]]) -> None:
    """The engines' counters in ``after`` as their rise since the phase began must read them: a killed engine
    rose by what it counted until its death (read just before it) and what its new process counted since (from
    0), that is by its count at death more than its new process's reading alone says."""
    for died in deaths.values():
        for side in SIDES:
            after[f"engine/{side}"] += died[side]
    after["engine"] = sum(after[f"engine/{side}"] for side in SIDES)


def vllm_server(appliance: subprocess.Popen, port: int) -> psutil.Process:
    """The vLLM API server of the replica on ``port``, among the appliance's processes."""
    for proc in psutil.Process(appliance.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if ("vllm.entrypoints.openai.api_server" in cmdline and "appliance.engine.launch" not in cmdline
                    and cmdline[cmdline.index("--port") + 1] == str(port)):
                return proc
    raise LookupError(f"no vLLM server on port {port}")


def running(engine: str) -> float:
    text = httpx.get(engine + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def striker(appliance: subprocess.Popen, engines: list[str], ports: list[int],
            deaths: dict[int, dict[str, float]]) -> Callable[[], None]:
    """SIGKILL the vLLM server of the replica running the most, its counters read just before into ``deaths``."""
    def strike() -> None:
        index = max(range(len(engines)), key=lambda i: running(engines[i]))
        server = vllm_server(appliance, ports[index])
        deaths[index] = counters(engines[index])
        server.kill()
        print(f"SIGKILLed replica-{index}'s vLLM server (pid {server.pid})", flush=True)
    return strike


def routable(gateway: str) -> int:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return int(httpx.get(gateway + "/health/ready", timeout=5).json().get("routable_replicas") or 0)
    return 0


Rows = list[tuple[str, int, dict[str, float]]]


def report(rows: Rows) -> None:
    print(f"\n{'phase':<14} {'requests':>8} {'engine tok':>10} {'charged':>9} {'not rep.':>9} {'ratio':>6} "
          f"{'reported only':>13} {'unseen: engine':>14} {'estimate':>8}")
    for name, count, delta in rows:
        names = PHASES if name in ("mixed", KILL) else (name,)
        reported = sum(delta[f"{n}/{kind}"] for n in names for kind in ("prompt", "completion"))
        estimated = sum(delta[f"{n}/estimated"] for n in names)
        engine = delta["engine"]
        ratio = (reported + estimated) / engine if engine else float("nan")
        print(f"{name:<14} {count:>8} {engine:>10.0f} {reported + estimated:>9.0f} {estimated:>9.0f} "
              f"{ratio:>6.2f} {reported / engine if engine else float('nan'):>13.2f} "
              f"{delta['unseen/engine']:>14.0f} {delta['unseen/estimate']:>8.0f}")
    print("ratio: charged (prompt + completion + estimated) / engine (prompt + generation tokens); "
          "reported only: without the work no engine reported; unseen: requests with such work, by how they were "
          "charged (engine: their share of the engine's count at rest; estimate: the gateway's estimate)")
    print(f"\n{'phase':<14} {'engine prompt':>13} {'charged':>8} {'ratio':>6} {'engine gen':>10} {'charged':>8} "
          f"{'ratio':>6}")
    for name, _, delta in rows:
        cells = []
        for side in SIDES:
            engine, charged = delta[f"engine/{side}"], delta[f"charged/{side}"]
            cells.append(f"{engine:>{13 if side == 'prompt' else 10}.0f} {charged:>8.0f} "
                         f"{charged / engine if engine else float('nan'):>6.2f}")
        print(f"{name:<14} {' '.join(cells)}")
    print("per side: the tenants' charges split as the reconciliation counts them (estimates in their side) against "
          "vllm:prompt_tokens_total and vllm:generation_tokens_total")


def ratios(delta: dict[str, float]) -> tuple[float, float]:
    return tuple(delta[f"charged/{side}"] / delta[f"engine/{side}"] if delta[f"engine/{side}"] else float("nan")
                 for side in SIDES)  # type: ignore[return-value]


def measure(args: argparse.Namespace, hold: float) -> Rows:
    """One pass: an appliance holding unseen work ``hold`` seconds, every phase, the engines idle and the unseen
    work charged between phases."""
    state = Path(tempfile.mkdtemp(prefix="bench-charging-"))
    tenants = [{"name": TENANT[phase], "api_keys": [KEYS[phase]]} for phase in PHASES]
    ports = [args.base_port + index for index in range(args.replicas)]
    port = args.base_port + 10
    env = {"APPLIANCE_STATE_DIR": str(state), "APPLIANCE_TENANTS": json.dumps(tenants),
           "APPLIANCE_METRICS_TOKEN": METRICS_TOKEN, "APPLIANCE_MODEL": str(demo_model(args.model)),
           "APPLIANCE_SERVED_MODEL_NAME": "demo", "APPLIANCE_PORT": str(port), "APPLIANCE_REPLICAS": str(args.replicas),
           "APPLIANCE_ENGINE_BASE_PORT": str(ports[0]), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "1024",
           "APPLIANCE_ENGINE__MAX_NUM_SEQS": "8", "APPLIANCE_GATEWAY__UNSEEN_HOLD_SECONDS": str(hold)}
    started = time.monotonic()
    proc = start([sys.executable, "-m", "appliance.cli", "serve"], env, state / "appliance.log")
    try:
        gateway, engines = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{p}" for p in ports]
        wait_ok(gateway + "/health/ready", proc)
        print(f"hold {hold:g}s: ready in {time.monotonic() - started:.0f}s (logs {state})", flush=True)
        rng = random.Random(args.seed)
        rows = []
        phases = [(p, (p,)) for p in PHASES] + [("mixed", PHASES)] + ([(KILL, PHASES)] if args.replicas > 1 else [])
        phases = [(name, names) for name, names in phases if args.phases in ("all", name)]
        for name, names in phases:
            deaths: dict[int, dict[str, float]] = {}
            rest(gateway, engines, args.replicas, hold)
            before = totals(gateway, engines)
            strike = striker(proc, engines, ports, deaths) if name == KILL else None
            asyncio.run(run_phase(gateway, names, args, rng, strike))
            after = rest(gateway, engines, args.replicas, hold)
            engine_rise(after, deaths)
            delta = {k: after[k] - before[k] for k in after}
            rows.append((name, args.requests * len(names), delta))
            by_replica = ", ".join(f"replica-{i} {delta[f'unseen-{i}/engine']:.0f} / "
                                   f"{delta[f'unseen-{i}/estimate']:.0f}" for i in range(args.replicas))
            print(f"{name}: done; unseen requests charged from the engine's count / as estimated: {by_replica}"
                  + (f"; replica-{next(iter(deaths))} killed" if deaths else ""), flush=True)
        report(rows)
        print(f"hold {hold:g}s: {time.monotonic() - started:.0f}s")
        return rows
    finally:
        stop(proc)


def rest(gateway: str, engines: list[str], replicas: int, hold: float) -> dict[str, float]:
    """Every replica back in routing (a killed one restarted) and idle, and the held work charged: the totals."""
    deadline = time.monotonic() + 600
    while routable(gateway) < replicas and time.monotonic() < deadline:
        time.sleep(1.0)
    for engine in engines:
        asyncio.run(engine_idle(engine))
    time.sleep(1.0)  # the last aborts reach the counters
    deadline = time.monotonic() + hold + 10
    while (after := totals(gateway, engines))["held"] and time.monotonic() < deadline:
        time.sleep(0.5)  # the replicas' rest: the held work charged
    return after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="requests per behaviour and phase (default 24)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--base-port", type=int, default=18700)
    parser.add_argument("--model", default=None, help="model directory (default: the tests' demo model)")
    parser.add_argument("--holds", default="30,0", help="gateway.unseen_hold_seconds of each pass (default 30,0)")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2; 1: no kill phase)")
    parser.add_argument("--phases", default="all", help=f"all (default), or one phase's name, e.g. '{KILL}'")
    args = parser.parse_args()
    holds = [float(value) for value in args.holds.split(",")]
    passes = [(hold, measure(args, hold)) for hold in holds]
    print(f"\n{'phase':<14} " + " ".join(f"{f'hold {hold:g}s prompt':>17} {'completion':>10}" for hold in holds))
    for index, (name, _, _) in enumerate(passes[0][1]):
        cells = [ratios(rows[index][2]) for _, rows in passes]
        print(f"{name:<14} " + " ".join(f"{prompt_ratio:>17.3f} {completion:>10.3f}"
                                        for prompt_ratio, completion in cells))
    print("charged / engine per side, each pass on its own appliance with the same seed")


if __name__ == "__main__":
    main()

"""Thousands of concurrent slow streams: does the gateway hold them, and what does each open stream cost?

The stub is the tests' fake vLLM engine (tests/fake_engine.py) pacing ``--tokens`` tokens ``--itl-ms`` apart, so
each stream stays open for about ``tokens x itl`` (30 s by default). The load generator opens ``--streams``
streams, ramped over ``--ramp-s`` seconds, each one request read to its end, through each path in turn (direct,
the gateway, vllm-router when installed), one run, side by side.

Prints per path: streams that ended with all their tokens, errors (a non-200, a cut stream, a missing token),
the most streams open at once, TTFT p50/p99 of the stream opens, the proxy's resident memory idle and with every
stream open (RSS per open stream = the difference over the streams open at that moment), the proxy's CPU per
1,000 events over the hold, and for the gateway its event-loop lag (appliance_event_loop_lag_seconds) over the
hold. Numbers, never assertions: this machine is shared, so compare paths within one run.

The gateway runs with its limits opened for the test (they are what is measured here, not what is refused):
intake.max_connections and max_connections_per_client above the streams, admission's per-replica limit and queue
too. Nothing is pinned: the point is the proxies' memory and whether they drop anything, not their CPU share.

    .venv/bin/python bench/stream_hold.py [--streams 4096] [--tokens 30] [--itl-ms 1000] [--ramp-s 8]
        [--paths direct,gateway,vllm-router] [--vllm-router /tmp/vr-venv/bin/vllm-router]

Open files: each proxy holds two sockets per stream and the load generator one; ``ulimit -n`` must allow it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import start, stop, wait_ok  # noqa: E402
from bench.stream_overhead import FAKE_ENGINE, MODEL, cpu_seconds, loop_lag, pct, request_body  # noqa: E402


@dataclass
class Hold:
    """What one path did with the streams."""

    complete: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    open_now: int = 0
    open_peak: int = 0
    events: int = 0
    ttfts: list[float] = field(default_factory=list)
    rss_peak: int = 0  # the proxy's RSS when the most streams were open
    open_at_rss_peak: int = 0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_stream(session: aiohttp.ClientSession, url: str, index: int, tokens: int, hold: Hold) -> None:
    payload = json.dumps(request_body("completions", tokens, index)).encode()
    started = time.perf_counter()
    texts = 0
    try:
        async with session.post(url + "/v1/completions", data=payload,
                                headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                hold.error(f"HTTP {resp.status}")
                await resp.read()
                return
            hold.open_now += 1
            hold.open_peak = max(hold.open_peak, hold.open_now)
            try:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    hold.events += 1
                    choices = json.loads(line[6:]).get("choices") or []
                    if any(choice.get("text") for choice in choices):
                        if texts == 0:
                            hold.ttfts.append(time.perf_counter() - started)
                        texts += 1
            finally:
                hold.open_now -= 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        hold.error(type(exc).__name__)
        return
    if texts < tokens:
        hold.error("short stream")
    else:
        hold.complete += 1


async def watch_memory(proxy: psutil.Process | None, hold: Hold, done: asyncio.Event) -> None:
    """Sample the proxy's RSS while streams are open; keep the sample taken with the most of them open."""
    while not done.is_set():
        if proxy is not None and hold.open_now >= hold.open_at_rss_peak:
            try:
                rss = proxy.memory_info().rss + sum(c.memory_info().rss for c in proxy.children(recursive=True))
            except psutil.Error:
                rss = 0
            hold.rss_peak, hold.open_at_rss_peak = max(hold.rss_peak, rss), hold.open_now
        await asyncio.sleep(0.5)


async def hold_streams(url: str, args: argparse.Namespace, proxy: psutil.Process | None) -> Hold:
    hold = Hold()
    done = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.tokens * args.itl_ms / 1000 * 4 + 120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        watcher = asyncio.create_task(watch_memory(proxy, hold, done))
        tasks = []
        for index in range(args.streams):
            tasks.append(asyncio.create_task(one_stream(session, url, index, args.tokens, hold)))
            await asyncio.sleep(args.ramp_s / args.streams)
        await asyncio.gather(*tasks)
        done.set()
        await watcher
    return hold


def rss(proxy: psutil.Process | None) -> int:
    if proxy is None:
        return 0
    return proxy.memory_info().rss + sum(c.memory_info().rss for c in proxy.children(recursive=True))


def cpu(proxy: psutil.Process | None) -> float:
    """CPU seconds of a proxy and its live children (a gateway's workers): ``cpu_seconds`` counts both."""
    return cpu_seconds(proxy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=30, help="completion tokens per stream")
    parser.add_argument("--itl-ms", type=float, default=1000.0, help="the stub's time between tokens")
    parser.add_argument("--ramp-s", type=float, default=8.0, help="seconds over which the streams open")
    parser.add_argument("--base-port", type=int, default=18500)
    parser.add_argument("--vllm-router", default=shutil.which("vllm-router") or "/tmp/vr-venv/bin/vllm-router")
    parser.add_argument("--paths", default="direct,gateway,vllm-router", help="which paths to measure")
    args = parser.parse_args()

    wanted = args.paths.split(",")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the proxies inherit it
    logs = Path(tempfile.mkdtemp(prefix="bench-hold-"))
    stub_port, gateway_port, router_port = args.base_port, args.base_port + 10, args.base_port + 20
    paths = {"direct": f"http://127.0.0.1:{stub_port}"}
    procs: dict[str, Any] = {}
    results: dict[str, tuple[Hold, int, float, tuple[float, float]]] = {}
    try:
        procs["stub"] = start([sys.executable, str(FAKE_ENGINE), str(stub_port), "--served-model-name", MODEL,
                               "--model", "counting", "--tokens", str(args.tokens), "--itl-ms", str(args.itl_ms),
                               "--backlog", "4096", "--uvloop"], {}, logs / "stub.log")
        wait_ok(f"{paths['direct']}/health", procs["stub"], timeout=120, interval=0.5)
        room = str(2 * args.streams)
        if "gateway" in wanted:
            env = {"APPLIANCE_ENGINE_URLS": paths["direct"], "APPLIANCE_PORT": str(gateway_port),
                   "APPLIANCE_SERVED_MODEL_NAME": MODEL, "APPLIANCE_STATE_DIR": str(logs / "state-gateway"),
                   "APPLIANCE_LOG_LEVEL": "warning", "APPLIANCE_ENGINE__MAX_NUM_SEQS": room,
                   "APPLIANCE_ADMISSION__MAX_QUEUE": room, "APPLIANCE_INTAKE__MAX_CONNECTIONS": room,
                   "APPLIANCE_INTAKE__MAX_CONNECTIONS_PER_CLIENT": room}
            procs["gateway"] = start([sys.executable, "-m", "appliance.cli", "serve"], env, logs / "gateway.log",
                                     cwd=ROOT)
            paths["gateway"] = f"http://127.0.0.1:{gateway_port}"
            wait_ok(f"{paths['gateway']}/health/ready", procs["gateway"], timeout=120, interval=0.5)
        if "vllm-router" in wanted and Path(args.vllm_router).exists():
            procs["vllm-router"] = start([args.vllm_router, "--port", str(router_port), "--worker-urls",
                                          paths["direct"], "--policy", "round_robin", "--log-level", "warning"], {},
                                         logs / "router.log")
            paths["vllm-router"] = f"http://127.0.0.1:{router_port}"
            wait_ok(f"{paths['vllm-router']}/v1/models", procs["vllm-router"], timeout=60)
        for name, url in paths.items():
            proxy = psutil.Process(procs[name].pid) if name in procs else None
            asyncio.run(hold_streams(url, argparse.Namespace(**{**vars(args), "streams": 16}), proxy))  # warm up
            idle, cpu_before = rss(proxy), cpu(proxy)
            lag_before = loop_lag(url) if name == "gateway" else (0.0, 0.0, 0.0)
            hold = asyncio.run(hold_streams(url, args, proxy))
            probes, lag, late = (b - a for a, b in zip(lag_before, loop_lag(url), strict=True)) if (
                name == "gateway") else (0.0, 0.0, 0.0)
            results[name] = (hold, idle, cpu(proxy) - cpu_before,
                             (1000 * lag / probes if probes else float("nan"), late / probes if probes else 0.0))
        report(results, args, logs)
        if "vllm-router" in wanted and "vllm-router" not in paths:
            print("vllm-router: not found (--vllm-router PATH; `pip install vllm-router==0.1.17` in a venv)")
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc, timeout=30)


def report(results: dict[str, tuple[Hold, int, float, tuple[float, float]]], args: argparse.Namespace,
           logs: Path) -> None:
    print(f"{args.streams} streams opened over {args.ramp_s:g} s, {args.tokens} tokens {args.itl_ms:g} ms apart "
          f"each; logs in {logs}")
    print(f"{'path':<12} {'complete':>8} {'errors':>6} {'open peak':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'RSS idle MB':>11} {'KB/stream':>9} {'CPU ms/1k ev':>12} {'loop lag ms':>11}")
    for name, (hold, idle, cpu_spent, (lag_ms, late)) in results.items():
        ttfts = sorted(hold.ttfts)
        per_stream = (hold.rss_peak - idle) / hold.open_at_rss_peak / 1024 if hold.open_at_rss_peak and idle else 0
        cpu_per_k = 1e6 * cpu_spent / max(1, hold.events) if name != "direct" else float("nan")
        lag = f"{lag_ms:.1f} ({100 * late:.0f}% >10)" if name == "gateway" else "-"
        print(f"{name:<12} {hold.complete:>8} {sum(hold.errors.values()):>6} {hold.open_peak:>9} "
              f"{1000 * pct(ttfts, 50):>11.1f} {1000 * pct(ttfts, 99):>11.1f} {idle / 2**20:>11.1f} "
              f"{per_stream:>9.1f} {cpu_per_k:>12.2f} {lag:>11}")
        if hold.errors:
            print(f"  {name} errors: {hold.errors}")
    if "gateway" in results and "vllm-router" in results:
        gw, router = results["gateway"][0], results["vllm-router"][0]
        if gw.open_at_rss_peak and router.open_at_rss_peak:
            ratio = ((gw.rss_peak - results["gateway"][1]) / gw.open_at_rss_peak) / max(
                1, (router.rss_peak - results["vllm-router"][1]) / router.open_at_rss_peak)
            print(f"gateway / vllm-router memory per open stream: {ratio:.2f}")


if __name__ == "__main__":
    main()

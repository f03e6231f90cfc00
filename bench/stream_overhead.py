"""Time to first token under many concurrent streams: a fast stub engine answered direct, through the
appliance's gateway, and through the peer router (vllm-router, when installed), in alternating rounds of one run.

The stub is the tests' fake vLLM engine (tests/fake_engine.py) in its own process, on uvloop: vLLM's /v1/models,
/health and /metrics (the gateway's load poll reads it), and streamed /v1/completions and /v1/chat/completions
written byte for byte as vLLM writes them: ``--tokens`` tokens ``--itl-ms`` apart (the first after
``--prefill-ms``), token ids when asked (``return_token_ids``: the gateway asks, to be able to migrate a stream), a
final usage chunk when ``stream_options.include_usage`` (the gateway asks for tenant accounting), then
``data: [DONE]``. The load generator (in this process) keeps ``--concurrency`` streams open, each sending its next
request as soon as its last one ended; TTFT is the time from sending a request to its first chunk with content.

Prints per path: TTFT p50/p99, the p50 added against direct, events/s received by the clients, and the proxy's CPU
per 1,000 events (psutil on the proxy's process; the Rust router's threads included), then the ratio of the
gateway's added p50 to vllm-router's, and the gateway's own event-loop lag over the rounds (its
appliance_event_loop_lag_seconds: how long a ready callback, such as a first token, waited for the loop). Medians
over the rounds. Numbers, never assertions.

Pinning (os.sched_setaffinity): the proxies (gateway, vllm-router) on the first core, the stub engine and the load
generator on the others (on a 2-core machine: they share the second), so a proxy's numbers are its own work and
not CPU it loses to the engine or the clients; ``--no-pin`` leaves everything where the OS puts it.

    .venv/bin/python bench/stream_overhead.py [--concurrency 64] [--requests 8] [--rounds 5] [--tokens 64]
        [--itl-ms 2] [--prefill-ms 0] [--route completions|chat] [--vllm-router /tmp/vr-venv/bin/vllm-router]
        [--compare-tree DIR]   # also the gateway of another source tree (a worktree of the commit before a change)

The streams start together and, their requests being alike, stay roughly in step: 64 requests arrive at the proxy
within a few milliseconds, so its per-request cost is multiplied by the queue it makes (the p50 waits behind about
half of the others).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import start, stop, wait_ok  # noqa: E402

MODEL = "demo"
FAKE_ENGINE = ROOT / "tests" / "fake_engine.py"


# -- the load generator ----------------------------------------------------------------------------------------


def request_body(route: str, tokens: int, index: int) -> dict[str, Any]:
    """A short prompt that differs per request (prefix routing has something to hash), streamed, usage asked for
    (as OpenAI's clients commonly do)."""
    text = f"request {index}: tell me about the number {index * 7919 % 10007} in a few words"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def has_content(block: bytes) -> bool:
    """Whether a block of SSE bytes holds an event with generated text (not chat's role-only first chunk)."""
    for line in block.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            choices = json.loads(line[6:]).get("choices") or []
        except ValueError:
            continue
        for choice in choices:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                return True
    return False


async def one_round(url: str, args: argparse.Namespace, requests: int, offset: int) -> dict[str, Any]:
    """``concurrency`` streams, each sending ``requests`` requests back to back."""
    path = "/v1/chat/completions" if args.route == "chat" else "/v1/completions"
    ttfts: list[float] = []
    events = errors = 0

    async def stream(session: aiohttp.ClientSession, worker: int) -> None:
        nonlocal events, errors
        for n in range(requests):
            payload = json.dumps(request_body(args.route, args.tokens, offset + worker * requests + n)).encode()
            started = time.perf_counter()
            first = None
            buffer = b""
            try:
                async with session.post(url + path, data=payload,
                                        headers={"content-type": "application/json"}) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    async for chunk in resp.content.iter_any():
                        if first is None:
                            buffer += chunk
                            cut = buffer.rfind(b"\n\n")
                            if cut >= 0 and has_content(buffer[:cut]):
                                first = time.perf_counter()
                        events += chunk.count(b"data: ")
            except aiohttp.ClientError:
                errors += 1
                continue
            if first is None:
                errors += 1
            else:
                ttfts.append(first - started)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(stream(session, w) for w in range(args.concurrency)))
        wall = time.perf_counter() - started
    ttfts.sort()
    return {"ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "events": events,
            "events_s": events / wall, "errors": errors, "requests": len(ttfts)}


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


# -- processes -------------------------------------------------------------------------------------------------


def split_cores(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(proxy cores, stub and load generator cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


def loop_lag(url: str) -> tuple[float, float, float]:
    """The gateway's own event-loop lag histogram (appliance_event_loop_lag_seconds): (probes, their summed lag,
    probes later than 10 ms), cumulative; zeros where the path has none (direct, vllm-router, an older tree)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0, 0.0, 0.0
    count = total = within = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "appliance_event_loop_lag_seconds_count":
                count = sample.value
            elif sample.name == "appliance_event_loop_lag_seconds_sum":
                total = sample.value
            elif sample.name == "appliance_event_loop_lag_seconds_bucket" and sample.labels.get("le") == "0.01":
                within = sample.value
    return count, total, count - within


def cpu_seconds(proc: psutil.Process | None) -> float:
    """CPU seconds of a proxy: its process and its live children (a gateway's workers, with gateway.workers above
    1; the gateways here route to the stub by URL, so they run no engines)."""
    if proc is None:
        return 0.0
    total = 0.0
    for process in (proc, *proc.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8, help="requests per stream per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--itl-ms", type=float, default=2.0, help="the stub's time between tokens")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="the stub's time to its first token")
    parser.add_argument("--route", choices=("completions", "chat"), default="completions")
    parser.add_argument("--base-port", type=int, default=18400)
    parser.add_argument("--vllm-router", default=shutil.which("vllm-router") or
                        ("/tmp/vr-venv/bin/vllm-router" if Path("/tmp/vr-venv/bin/vllm-router").exists() else None))
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--paths", default="direct,gateway,vllm-router",
                        help="which paths to measure; also: bare (bench/bare_relay.py, the gateway's libraries alone)")
    parser.add_argument("--compare-tree", metavar="DIR",
                        help="also measure the gateway of another source tree (e.g. a `git worktree` of the "
                             "commit before a change), as path gateway-other, in the same alternating rounds")
    parser.add_argument("--other-env", action="append", default=[], metavar="KEY=VALUE",
                        help="settings for gateway-other only (with --compare-tree . the same tree: a feature's "
                             "cost side by side, e.g. APPLIANCE_GATEWAY__REQUEST_RECORDS=0)")
    parser.add_argument("--profile", metavar="FILE",
                        help="run the gateway under cProfile, timed by its own CPU, and write its stats to FILE "
                             "(pstats), then print where its CPU went, by area and by function; slows the gateway, "
                             "so compare shares, not times")
    args = parser.parse_args()

    _use_uvloop()
    wanted = args.paths.split(",")
    proxy_cores, load_cores = split_cores(not args.no_pin)
    logs = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    stub_port, gateway_port, router_port = args.base_port, args.base_port + 10, args.base_port + 20
    bare_port = args.base_port + 30
    paths = {"direct": f"http://127.0.0.1:{stub_port}"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["stub"] = start([sys.executable, str(FAKE_ENGINE), str(stub_port), "--served-model-name", MODEL,
                               "--model", "counting", "--tokens", str(args.tokens), "--itl-ms", str(args.itl_ms),
                               "--prefill-ms", str(args.prefill_ms), "--backlog", "1024", "--uvloop"], {},
                              logs / "stub.log", load_cores)
        wait_ok(f"{paths['direct']}/health", procs["stub"], timeout=120, interval=0.5)
        gateways = {"gateway": ROOT} if "gateway" in wanted else {}
        if args.compare_tree:
            gateways["gateway-other"] = Path(args.compare_tree).resolve()
        for index, (name, tree) in enumerate(gateways.items()):
            port = gateway_port + index
            # the earlier top-level names (docs/configuration.md, "Earlier names"): a --compare-tree from before the
            # gateway and engine sections reads them too
            env = {"APPLIANCE_ENGINE_URLS": paths["direct"], "APPLIANCE_PORT": str(port),
                   "APPLIANCE_SERVED_MODEL_NAME": MODEL, "APPLIANCE_STATE_DIR": str(logs / f"state-{name}"),
                   "APPLIANCE_LOG_LEVEL": "warning",
                   # admission's per-replica limit defaults to engine.max_num_seqs: room for every stream, so the
                   # gateway's own queue is not what is measured
                   "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(2 * args.concurrency),
                   "APPLIANCE_ADMISSION__MAX_QUEUE": str(4 * args.concurrency)}
            if name == "gateway-other":
                env.update(item.split("=", 1) for item in args.other_env)
            profiled = ["-c", CPU_PROFILE, str(Path(args.profile).resolve())] if (
                args.profile and name == "gateway") else ["-m"]
            procs[name] = start([sys.executable, *profiled, "appliance.cli", "serve"], env,
                                logs / f"{name}.log", proxy_cores, cwd=tree)
            paths[name] = f"http://127.0.0.1:{port}"
        for name in gateways:
            wait_ok(f"{paths[name]}/health/ready", procs[name], timeout=120, interval=0.5)
        if "bare" in wanted:
            procs["bare"] = start([sys.executable, str(ROOT / "bench" / "bare_relay.py"), str(bare_port),
                                   paths["direct"]], {}, logs / "bare.log", proxy_cores)
            paths["bare"] = f"http://127.0.0.1:{bare_port}"
            wait_ok(f"{paths['bare']}/v1/models", procs["bare"], timeout=60, interval=0.5)
        if "vllm-router" in wanted and args.vllm_router:
            procs["vllm-router"] = start([args.vllm_router, "--port", str(router_port), "--worker-urls",
                                          paths["direct"], "--policy", "round_robin", "--log-level", "warning"], {},
                                         logs / "router.log", proxy_cores)
            paths["vllm-router"] = f"http://127.0.0.1:{router_port}"
            wait_ok(f"{paths['vllm-router']}/v1/models", procs["vllm-router"], timeout=60)
        if load_cores:
            os.sched_setaffinity(0, load_cores)
        proxies = {name: psutil.Process(procs[name].pid) for name in paths if name in procs}
        for url in paths.values():  # warm up: connections, caches, the first requests' one-time work
            asyncio.run(one_round(url, args, 2, 0))
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
        names = list(paths)
        offset = 10**6
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                # the gateway's own /metrics scrape (the loop-lag reading) before its CPU is read, not inside the round
                lag_before = loop_lag(paths[name]) if name.startswith("gateway") else (0.0, 0.0, 0.0)
                before = cpu_seconds(proxies.get(name))
                sample = asyncio.run(one_round(paths[name], args, args.requests, offset))
                offset += args.concurrency * args.requests
                sample["cpu_ms_per_k"] = (1000 * (cpu_seconds(proxies.get(name)) - before)
                                          / max(1, sample["events"]) * 1000)
                if name.startswith("gateway"):
                    probes, lag, late = (b - a for a, b in zip(lag_before, loop_lag(paths[name]), strict=True))
                    sample["lag_mean_ms"] = 1000 * lag / probes if probes else float("nan")
                    sample["lag_late_share"] = late / probes if probes else float("nan")
                samples[name].append(sample)
        pinned = (f"proxies on cores {sorted(proxy_cores)}, stub engine and load generator on {sorted(load_cores)}"
                  if proxy_cores and load_cores else "not pinned")
        print(f"{pinned}; logs in {logs}")
        report(samples, args)
        if "vllm-router" in wanted and "vllm-router" not in paths:
            print("vllm-router: not found (--vllm-router PATH; `pip install vllm-router==0.1.17` in a venv)")
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc, timeout=30)
    if args.profile:
        print_profile(Path(args.profile))


# The gateway under cProfile timed by its own CPU (time.process_time), not the wall clock: on a shared machine a
# wall-clock profile charges the time the process waited for a core to whatever function it was preempted in.
CPU_PROFILE = """
import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = sys.argv[2:]  # the module, then its arguments
profile = cProfile.Profile(time.process_time)
profile.enable()
try:
    runpy.run_module("appliance.cli", run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats(out)
"""

# Where a profiled gateway's own time goes, by the file a function is defined in (first match wins).
AREAS = (("hooks", ("gateway/observation/", "gateway/tenants/", "gateway/migration/")),
         ("transport", ("gateway/upstream/",)), ("admission+routing", ("gateway/admission/", "gateway/routing/")),
         ("gateway other", ("appliance/",)), ("aiohttp", ("aiohttp/",)),
         ("starlette+fastapi", ("starlette/", "fastapi/")),
         ("uvicorn+h11/httptools", ("uvicorn/", "h11/", "httptools/")), ("prometheus_client", ("prometheus_client/",)),
         ("asyncio+uvloop", ("asyncio/", "uvloop/")), ("opentelemetry", ("opentelemetry/",)))


def print_profile(path: Path, top: int = 25) -> None:
    """The profile's own time (tottime) by area and its top functions: where the per-request and per-event work
    is. Reproduce with: bench/stream_overhead.py --paths direct,gateway --profile /tmp/gateway.prof"""
    import pstats

    stats = pstats.Stats(str(path))
    by_area: dict[str, float] = {}
    total = 0.0
    for (file, _line, _func), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        area = next((name for name, marks in AREAS if any(m in file for m in marks)), "other (builtins, C)")
        by_area[area] = by_area.get(area, 0.0) + tottime
    print(f"\nprofile {path}: {total:.2f} s of the gateway's own time")
    for area, seconds in sorted(by_area.items(), key=lambda kv: -kv[1]):
        print(f"  {area:<24} {seconds:7.2f} s {100 * seconds / total:5.1f}%")
    stats.sort_stats("tottime").print_stats(top)


def report(samples: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    print(f"{args.route}, {args.concurrency} concurrent streams x {args.requests} requests x {args.rounds} "
          f"alternating rounds; {args.tokens} tokens {args.itl_ms:g} ms apart, first after {args.prefill_ms:g} ms "
          f"(medians over rounds)")
    print(f"{'path':<12} {'TTFT p50 ms':>11} {'+p50 ms':>8} {'TTFT p99 ms':>11} {'+p99 ms':>8} {'events/s':>9} "
          f"{'errors':>6} {'proxy CPU ms/1k events':>22}")
    added: dict[str, float] = {}
    for name in samples:
        added[name] = 1000 * (med(name, "ttft_p50") - med("direct", "ttft_p50"))
        cpu = f"{med(name, 'cpu_ms_per_k'):>22.2f}" if name != "direct" else f"{'-':>22}"
        print(f"{name:<12} {1000 * med(name, 'ttft_p50'):>11.1f} {added[name]:>8.1f} "
              f"{1000 * med(name, 'ttft_p99'):>11.1f} "
              f"{1000 * (med(name, 'ttft_p99') - med('direct', 'ttft_p99')):>8.1f} {med(name, 'events_s'):>9.0f} "
              f"{sum(s['errors'] for s in samples[name]):>6} {cpu}")
    if "gateway" in added and "gateway-other" in added:
        print(f"gateway added / gateway-other added (TTFT p50): {added['gateway']:.1f} / "
              f"{added['gateway-other']:.1f} ms")
    if "gateway" in added and "vllm-router" in added:
        print(f"gateway added / vllm-router added (TTFT p50): {added['gateway']:.1f} / {added['vllm-router']:.1f} ms "
              f"= {added['gateway'] / added['vllm-router'] if added['vllm-router'] else float('inf'):.2f}")
    cpu_ratios = [(a, b) for a, b in (("gateway", "vllm-router"), ("gateway", "bare"), ("bare", "vllm-router"))
                  if a in samples and b in samples]
    for a, b in cpu_ratios:  # bare (bench/bare_relay.py): the gateway's libraries and nothing else
        print(f"proxy CPU per event, {a} / {b}: {med(a, 'cpu_ms_per_k') / med(b, 'cpu_ms_per_k'):.2f}")
    for name in samples:
        if samples[name] and "lag_mean_ms" in samples[name][0] and med(name, "lag_mean_ms") == med(name, "lag_mean_ms"):
            # NaN where the tree has no such metric (a --compare-tree from before it)
            print(f"{name} event-loop lag during the rounds (appliance_event_loop_lag_seconds, a probe every 0.1 s): "
                  f"mean {med(name, 'lag_mean_ms'):.1f} ms, share of probes later than 10 ms "
                  f"{med(name, 'lag_late_share'):.2f}")
    print("per round (TTFT p50 ms): " + "; ".join(
        f"{name} " + " ".join(f"{1000 * s['ttft_p50']:.1f}" for s in samples[name]) for name in samples))


if __name__ == "__main__":
    main()

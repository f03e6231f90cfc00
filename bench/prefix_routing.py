"""Prefix-aware routing against today's routing and round robin, on 2 real vLLM engines; and the routing cost.

    flock /tmp/appliance-heavy.lock python bench/prefix_routing.py engines --model DIR [--conversations 120]
        [--policies today prefix] [--churn-policies today prefix]
    python bench/prefix_routing.py micro [--conversations 10000]

``engines`` starts two vLLM engines (one core each, prefix caching on, the KV cache cut with
``--num-gpu-blocks-override`` to hold about two thirds of all conversations' prefixes), then, for each policy in
turn, an ``appliance serve`` gateway in front of them (engine_urls, admission off so every request is routed at
once), empties the engines' prefix caches (``/reset_prefix_cache``, dev mode) and plays the same workload: many
conversations, each with its own long prefix (most of max_model_len) plus short new turns, interleaved, from a
fixed number of concurrent clients. It prints the engines' prefix-cache hit rate (from
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), TTFT p50/p95, throughput and the load split,
and their ratios to today's routing, per round (a round: every conversation's next turn; round 0 can hit nothing,
each conversation's prefix is new). Nothing is tuned to pass: the numbers are what the run measured.

The churn scenario, for each of ``--churn-policies`` in the same run: a fresh gateway, caches emptied,
two warm rounds, then engine 1 is stopped; once the gateway sees it unhealthy it is started again while round 3
plays (so the round goes to engine 0 while engine 1 boots), and once it is ready again two more rounds play: their
hit rate and request split (max over mean) are the churn numbers, next to the same policy's steady state.

The gateway is told the demo tokenizer's characters per token (``routing.scorers.prefix.chars_per_token``,
measured here with /tokenize on the workload's own text), as an operator configures it for their model.

``micro`` times the router's decision with 10k conversations indexed (no engines): prefix-aware vs load-only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from appliance.gateway.routing.prefix_index import PrefixIndex
from appliance.gateway.routing.request import RoutingRequest, render_chat
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.routing.settings import RoutingSettings
from appliance.gateway.schemas import ChatMessage
from appliance.loadtest.client import RequestResult, build_body, monotonic_clock, stream_request
from appliance.loadtest.stats import percentile
from tests.doubles import FakeReplica

POLICIES = {  # name -> the gateway's environment for it
    "today": {"APPLIANCE_ROUTING__SCORERS__WEIGHTS__PREFIX": "0"},
    "prefix": {},
    "prefix_unbounded": {"APPLIANCE_ROUTING__SCORERS__PREFIX__BALANCE_WINDOW": "0"},  # without the balance bound
    "round_robin": {"APPLIANCE_ROUTING__SCORERS__POLICY": "round_robin"},
    "prefix_no_room": {"APPLIANCE_ROUTING__SCORERS__WEIGHTS__CACHE_ROOM": "0"},  # without the cache-room scorer
}
CHURN_ROUNDS = 5  # 2 warm, 1 while engine 1 restarts, 2 after it is back
_WORD_TEXT = (
    "the of and to in is was that for on as with by at from his an were are which this be or has had not "
    "but one all their there been its more when who will would can them time into only some other than "
    "then could these two may first any after most also over where such through between under system question "
    "answer model value return function class module object string number list file"
)
WORDS = tuple(_WORD_TEXT.split(" "))


# -- the workload ---------------------------------------------------------------------------------------------

def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Conversation:
    prefix: str  # system prompt + earlier turns: unique to the conversation
    turns: list[str]

    def prompt(self, turn: int) -> str:
        return self.prefix + "".join(f"\nUser: {t}\nAssistant: ok." for t in self.turns[:turn + 1])


def conversations(count: int, prefix_words: int, turns: int, seed: int = 1) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation(f"Conversation {i}. " + text(rng, prefix_words), [text(rng, 12) for _ in range(turns)])
            for i in range(count)]


# -- engines and gateway --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def processes():
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_engine(model: Path, port: int, core: int, blocks: int, max_len: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), "--max-num-seqs", "16", "--enable-prefix-caching",
           "--num-gpu-blocks-override", str(blocks)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_gateway(urls: list[str], port: int, policy_env: dict[str, str], state: Path, log: Path
                  ) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update({"APPLIANCE_ENGINE_URLS": ",".join(urls), "APPLIANCE_PORT": str(port),
                "APPLIANCE_STATE_DIR": str(state), "APPLIANCE_ADMISSION__ENABLED": "false",
                "APPLIANCE_ENGINE__MAX_MODEL_LEN": "1024", "APPLIANCE_COLLECTORS__ENABLED": "false",
                "APPLIANCE_MAINTENANCE__ENABLED": "false", **policy_env})
    return subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve"], env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def wait_until(session: aiohttp.ClientSession, url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1)
    raise TimeoutError(url)


async def engine_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
              "vllm:num_gpu_blocks", "vllm:cache_config_info")
    out: dict[str, float] = {}
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted and not line.startswith("#"):
                if name == "vllm:cache_config_info":
                    for part in line.split("{", 1)[1].split("}", 1)[0].split(","):
                        key, _, value = part.partition("=")
                        if key in ("num_gpu_blocks", "block_size"):
                            out[f"cache_config.{key}"] = float(value.strip('"'))
                    continue
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def tokens_per_word(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """Tokens per word and characters per token of the workload's text, by the engine's own tokenizer."""
    sample = text(random.Random(9), 400)
    async with session.post(f"{url}/tokenize", json={"model": "demo", "prompt": sample}) as resp:
        tokens = len((await resp.json())["tokens"])
    return tokens / 400, len(sample) / tokens


async def play(gateway: str, convs: list[Conversation], turns: int, clients: int, max_tokens: int,
               first_turn: int = 0) -> tuple[list[RequestResult], float]:
    """Every conversation's turn t before any conversation's turn t+1, shuffled within each round."""
    rng = random.Random(2 + first_turn)
    order = []
    for turn in range(first_turn, first_turn + turns):
        round_ = list(range(len(convs)))
        rng.shuffle(round_)
        order += [(c, turn) for c in round_]
    queue: asyncio.Queue = asyncio.Queue()
    for item in order:
        queue.put_nowait(item)
    clock = monotonic_clock()
    results: list[RequestResult] = []
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while not queue.empty():
                conv, turn = queue.get_nowait()
                result = RequestResult(index=len(results), phase="measure", intended=clock())
                body = build_body("demo", {"prompt": convs[conv].prompt(turn)}, max_tokens, ignore_eos=True)
                results.append(await stream_request(session, f"{gateway}/v1/completions", body, result, clock, 120))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return results, time.perf_counter() - started


def routing_counts(page: str) -> dict[str, float]:
    """The gateway's routing decisions by ``decided_by`` and its prefix yields, from its /metrics text."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("appliance_routing_decisions_total{"):
            labels = line.split("{", 1)[1].split("}", 1)[0]
            decider = next(p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("decided_by="))
            out[decider] = out.get(decider, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("appliance_routing_prefix_yields_total "):
            out["prefix_yields"] = float(line.rsplit(" ", 1)[1])
    return out


async def gateway_routing(session: aiohttp.ClientSession, gateway: str) -> dict[str, float]:
    async with session.get(f"{gateway}/metrics") as resp:
        return routing_counts(await resp.text())


async def measure_rounds(session: aiohttp.ClientSession, gateway: str, urls: list[str], convs: list[Conversation],
                         first_turn: int, turns: int, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """One round at a time with the engines' counters read around each: each round's numbers (and how the
    gateway decided them), and all of them."""
    rounds: list[dict] = []
    everything: list[RequestResult] = []
    walls = 0.0
    first = before = [await engine_counters(session, url) for url in urls]
    decided = await gateway_routing(session, gateway)
    for turn in range(first_turn, first_turn + turns):
        results, wall = await play(gateway, convs, 1, args.clients, args.max_tokens, first_turn=turn)
        after = [await engine_counters(session, url) for url in urls]
        now = await gateway_routing(session, gateway)
        decisions = {k: v - decided.get(k, 0.0) for k, v in now.items() if v - decided.get(k, 0.0)}
        rounds.append({"round": turn, **summarize(results, wall, before, after), "decided_by": decisions})
        everything += results
        walls += wall
        before, decided = after, now
    return rounds, summarize(everything, walls, first, before)


async def replica_state(session: aiohttp.ClientSession, gateway: str, replica: str, state: str, timeout: float
                        ) -> float:
    """Wait until the gateway's appliance_replica_state says ``replica`` is in ``state``; the seconds it took."""
    started = time.monotonic()
    wanted = f'appliance_replica_state{{replica="{replica}",state="{state}"}} 1.0'
    while time.monotonic() - started < timeout:
        async with session.get(f"{gateway}/metrics") as resp:
            if wanted in await resp.text():
                return time.monotonic() - started
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{replica} never became {state}")


async def run_engines(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    report: dict = {"policies": {}, "churn": {}}
    with processes() as procs:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            # Size the prefixes from the model's own tokenizer, on a first engine started with the final blocks.
            engines = [start_engine(Path(args.model), port, i, args.blocks, args.max_model_len,
                                    work / f"engine-{i}.log") for i, port in enumerate(ports)]
            procs += engines
            for proc, url in zip(engines, urls, strict=True):
                await wait_until(session, f"{url}/health", 300, proc)
            per_word, chars_per_token = await tokens_per_word(session, urls[0])
            prefix_words = int(args.prefix_tokens / per_word)
            turns = max(args.turns, CHURN_ROUNDS if args.churn_policies else 0)
            convs = conversations(args.conversations, prefix_words, turns)
            info = await engine_counters(session, urls[0])
            block_size = info.get("cache_config.block_size", 0)
            tokenizer_env = {"APPLIANCE_ROUTING__SCORERS__PREFIX__CHARS_PER_TOKEN": f"{chars_per_token:.3f}"}
            report["setup"] = {
                "engines": 2, "cores_per_engine": 1, "conversations": args.conversations, "turns": args.turns,
                "clients": args.clients, "max_tokens": args.max_tokens, "tokens_per_word": round(per_word, 3),
                "chars_per_token": round(chars_per_token, 3),
                "prefix_tokens_target": args.prefix_tokens, "max_model_len": args.max_model_len,
                "kv_blocks_per_engine": info.get("cache_config.num_gpu_blocks"), "block_size": block_size,
                "kv_tokens_per_engine": (info.get("cache_config.num_gpu_blocks") or 0) * block_size,
                "all_prefixes_tokens": int(args.conversations * args.prefix_tokens),
            }
            print(json.dumps(report["setup"]), flush=True)

            async def gateway_for(name: str, label: str) -> tuple[subprocess.Popen, str]:
                port = free_port()
                proc = start_gateway(urls, port, {**tokenizer_env, **POLICIES[name]}, work / f"state-{label}",
                                     work / f"gateway-{label}.log")
                procs.append(proc)
                await wait_until(session, f"http://127.0.0.1:{port}/health/ready", 60, proc)
                for url in urls:
                    async with session.post(f"{url}/reset_prefix_cache") as resp:
                        assert resp.status == 200, f"reset_prefix_cache: HTTP {resp.status}"
                return proc, f"http://127.0.0.1:{port}"

            async def stop(proc: subprocess.Popen) -> None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.wait, 60)

            for name in args.policies:
                gateway, url = await gateway_for(name, name)
                rounds, overall = await measure_rounds(session, url, urls, convs, 0, args.turns, args)
                await stop(gateway)
                report["policies"][name] = {**overall, "rounds": rounds}
                print(name, json.dumps(report["policies"][name]), flush=True)

            for name in args.churn_policies:
                gateway, url = await gateway_for(name, f"churn-{name}")
                warm, _ = await measure_rounds(session, url, urls, convs, 0, 2, args)
                await stop(engines[1])
                down_s = await replica_state(session, url, "external-1", "unhealthy", 60)
                engines[1] = start_engine(Path(args.model), ports[1], 1, args.blocks, args.max_model_len,
                                          work / f"engine-1-{name}.log")
                procs.append(engines[1])
                away, away_wall = await play(url, convs, 1, args.clients, args.max_tokens, first_turn=2)
                await wait_until(session, f"{urls[1]}/health", 300, engines[1])
                back_s = await replica_state(session, url, "external-1", "ready", 60)
                after, overall = await measure_rounds(session, url, urls, convs, 3, 2, args)
                await stop(gateway)
                report["churn"][name] = {
                    "after": overall, "rounds_after": after, "warm_rounds": warm,
                    "while_away": {"requests": len(away), "failed": sum(not r.ok for r in away),
                                   "wall_s": round(away_wall, 2)},
                    "seen_down_after_s": round(down_s, 1), "seen_ready_after_s": round(back_s, 1),
                }
                print("churn", name, json.dumps(report["churn"][name]), flush=True)
    report["ratios_vs_today"] = ratios(report["policies"])
    report["churn_ratios_vs_today"] = ratios({k: v["after"] for k, v in report["churn"].items()})
    report["goals"] = goals(report)
    return report


def goals(report: dict) -> dict:
    """Issue 25's goals next to what was measured (not assertions: a benchmark reports)."""
    out: dict = {}
    steady = report["policies"].get("prefix")
    if steady:
        later = [r["hit_rate"] for r in steady["rounds"][1:]]  # round 0 can hit nothing
        out["steady_hit_rate_per_round_ge_0.75"] = {"rounds": later, "met": all((h or 0) >= 0.75 for h in later)}
        ttft = report["ratios_vs_today"].get("prefix", {}).get("ttft_p50_s")
        out["steady_ttft_p50_le_0.7x_today"] = {"ratio": ttft, "met": ttft is not None and ttft <= 0.7}
    churn = report["churn"].get("prefix")
    if churn:
        after = churn["after"]
        out["churn_hit_rate_ge_0.7"] = {"hit_rate": after["hit_rate"], "met": (after["hit_rate"] or 0) >= 0.7}
        worst = max((r["max_over_mean"] or 0) for r in churn["rounds_after"])
        out["churn_max_over_mean_le_1.3"] = {"overall": after["max_over_mean"], "worst_round": worst,
                                             "met": worst <= 1.3}
    return out


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def summarize(results: list[RequestResult], wall: float, before: list[dict], after: list[dict]) -> dict:
    ok = [r for r in results if r.ok]
    hits = sum(delta(b, a, "vllm:prefix_cache_hits_total") for b, a in zip(before, after, strict=True))
    queries = sum(delta(b, a, "vllm:prefix_cache_queries_total") for b, a in zip(before, after, strict=True))
    split = [delta(b, a, "vllm:request_success_total") for b, a in zip(before, after, strict=True)]
    mean = sum(split) / len(split)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": round(wall, 2),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p95_s": round(percentile(ttfts, 95), 4),
        "throughput_rps": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
        "requests_per_engine": split, "max_over_mean": round(max(split) / mean, 3) if mean else None,
    }


def ratios(policies: dict) -> dict:
    base = policies.get("today")
    if not base:
        return {}
    out = {}
    for name, row in policies.items():
        out[name] = {key: round(row[key] / base[key], 3) if row.get(key) and base.get(key) else None
                     for key in ("hit_rate", "ttft_p50_s", "ttft_p95_s", "throughput_rps")}
        out[name]["max_over_mean"] = row["max_over_mean"]
    return out


# -- the routing cost, no engines -----------------------------------------------------------------------------

def micro(args: argparse.Namespace) -> dict:
    rng = random.Random(3)
    system = [text(rng, 120) for _ in range(args.conversations)]  # ~700 characters of system prompt each

    def chat(i: int, turns: int) -> list[ChatMessage]:
        msgs = [ChatMessage(role="system", content=f"{i} " + system[i])]
        for t in range(turns):
            msgs += [ChatMessage(role="user", content=f"question {t} " * 20),
                     ChatMessage(role="assistant", content=f"answer {t} " * 30)]
        return msgs + [ChatMessage(role="user", content="and now?")]

    out: dict = {"conversations_indexed": args.conversations}
    for name, routing in (("load_only", {"scorers": {"weights": {"prefix": 0}}}), ("prefix", {}),
                          ("round_robin", {"scorers": {"policy": "round_robin"}})):
        replicas = [FakeReplica(f"replica-{i}") for i in range(args.replicas)]
        router = Router(lambda replicas=replicas: replicas, RoutingSettings(**routing))
        prompts = [chat(i, 2) for i in range(args.conversations)]
        for messages in prompts:  # fill the index: every conversation seen once
            replica = router.try_acquire(request=RoutingRequest(render_chat(messages)))
            router.release(replica, Outcome.SUCCESS)
        follow = [chat(i, 3) for i in rng.sample(range(args.conversations), 2000)]
        started = time.perf_counter()
        for messages in follow:  # what the gateway adds per request: render, hash, score, record, release
            replica = router.try_acquire(request=RoutingRequest(render_chat(messages)))
            router.release(replica, Outcome.SUCCESS)
        per_request = (time.perf_counter() - started) / len(follow)
        prefix = router.policy.prefix
        out[name] = {"per_request_us": round(per_request * 1e6, 1),
                     "index_entries": len(prefix.index) if prefix else 0,
                     "index_bytes": prefix.index.bytes if prefix else 0,
                     "evictions": prefix.index.evictions if prefix else 0,
                     "prompt_chars": len(render_chat(follow[0]))}
    out["added_by_prefix_us"] = round(out["prefix"]["per_request_us"] - out["load_only"]["per_request_us"], 1)
    index = PrefixIndex(2**40)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(1000):
        index.record("r0", [rng.getrandbits(44) for _ in range(1000)])
    out["bytes_per_1M_blocks"] = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    eng = sub.add_parser("engines")
    eng.add_argument("--model", required=True)
    eng.add_argument("--work", default="var/bench-prefix-routing")
    eng.add_argument("--conversations", type=int, default=120)
    eng.add_argument("--turns", type=int, default=3)
    eng.add_argument("--prefix-tokens", type=int, default=700, help="per conversation (system + earlier turns)")
    eng.add_argument("--max-model-len", type=int, default=1024)
    eng.add_argument("--blocks", type=int, default=0, help="KV blocks per engine; default: 2/3 of all prefixes")
    eng.add_argument("--block-size", type=int, default=128,
                     help="vLLM's KV block size (the CPU backend's default is 128); only sizes --blocks' default")
    eng.add_argument("--clients", type=int, default=8)
    eng.add_argument("--max-tokens", type=int, default=8)
    eng.add_argument("--policies", nargs="*", default=["today", "prefix", "round_robin"], choices=list(POLICIES))
    eng.add_argument("--churn-policies", nargs="*", default=["today", "prefix"], choices=list(POLICIES),
                     help="the churn scenario (engine 1 restarted between rounds) for each of these")
    mic = sub.add_parser("micro")
    mic.add_argument("--conversations", type=int, default=10_000)
    mic.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    if args.command == "micro":
        print(json.dumps(micro(args), indent=1))
        return
    if not args.blocks:
        args.blocks = int(args.conversations * args.prefix_tokens * 2 / 3 / args.block_size)
    print(json.dumps(asyncio.run(run_engines(args)), indent=1))


if __name__ == "__main__":
    main()

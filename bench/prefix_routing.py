"""Load-only, approximate and precise prefix routing on 2 real vLLM engines, in four scenarios, next to an oracle;
and the routing cost.

    flock /tmp/appliance-heavy.lock python bench/prefix_routing.py engines --model DIR [--conversations 120]
        [--policies today prefix precise] [--scenarios steady restart pressure two_gateways]
    python bench/prefix_routing.py micro [--conversations 10000]

``engines`` starts two vLLM engines (one core each, prefix caching on, the KV cache cut with
``--num-gpu-blocks-override`` to hold about two thirds of all conversations' prefixes, KV-cache events published
as the appliance's own engines publish them with ``engine.kv_events: local``). Then, for each scenario and each
policy in turn, ``appliance serve`` gateways in front of them (engine_urls, admission off so every request is
routed at once), the engines' prefix caches emptied (``/reset_prefix_cache``, dev mode, and a request of a few
tokens to each engine so that it publishes the reset to the gateways' event indexes), and the same workload:
many conversations, each with its own long prefix (most of max_model_len) plus short new turns, played in rounds
(a round: every conversation's next turn, shuffled; round 0 can hit nothing, each prefix is new) from a fixed
number of concurrent clients. Policies (``POLICIES``): ``today`` load only (prefix weight 0), ``prefix`` the
approximate scorer (the gateway's model of what it sent where), ``precise`` the engines' own KV events (the
gateway tokenizes each prompt with the model's tokenizer), ``precise_fallback`` precise with the approximate
scorer for replicas whose event index is not current. Scenarios:

- ``steady``: one gateway, ``--turns`` rounds; scored from round 1.
- ``restart``: one gateway, two warm rounds, then engine 1 is stopped; once the gateway sees it unhealthy it is
  started again while round 2 plays (so that round goes to engine 0 while engine 1 boots); once it is ready
  again two more rounds play, and they are scored.
- ``pressure``: as steady with more conversations (``--pressure-conversations``, by default as many as make all
  prefixes twice one engine's KV cache: the whole working set then just fits the two engines' caches together,
  if every conversation stays on one engine); scored from round 1.
- ``two_gateways``: two gateways of the same policy in front of the same engines, turn t of conversation c sent
  to gateway (c + t) mod 2, so no gateway sees two consecutive turns of a conversation; scored from round 1.

Each scenario prints a table: per policy the engines' prefix-cache hit rate over the scored rounds (from
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), the oracle's on the same requests and the ratio,
TTFT p50/p95 and the ratio of p50 to load-only's, and the load split. Nothing is tuned to pass: the numbers are
what the run measured.

The oracle (``Oracle``) is an offline replay of the scenario's request sequence (the same rounds, the same
shuffled order, the prompts' token ids from the engine's own /tokenize) against a model of each engine's prefix
cache as vLLM's block pool keeps it: the engine's block size and number of blocks (less vLLM's null block), a hit
is the longest chain of full cached blocks within the prompt less its last token (as vLLM counts hits and
queries), each request's blocks (prompt and output less its last token) are taken from the head of the free
queue (evicting what the block held) and given back at its end, full ones to the tail in reverse order and partly
filled ones to the head (vLLM 0.32's free queue), and only full prompt blocks are reusable. It routes each
request to the replica whose cache holds the longest prefix, among the replicas the router's own balance bound
(``BalanceBound``, its defaults) leaves, ties to the replica with more blocks that hold nothing a prompt could
hit, then fewer recent decisions, then the lower index; a restarted replica's model is emptied and a replica
that is away is not routed to. What it ignores: concurrency (requests are played one at a time, so no blocks are
held by running requests and no preemption), the gateways' load scorer, and timing (when an event or a request
reaches the engine). It is a reference for what exact knowledge of the caches can give with this router's balance,
not a proven upper bound: a policy may beat it by chance.

The approximate scorer is told the demo tokenizer's characters per token (``routing.scorers.prefix.chars_per_token``,
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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from appliance.engine.kv_events import event_ports, kv_events_argv, kv_events_env  # noqa: E402
from appliance.engine.settings import EngineSettings  # noqa: E402
from appliance.gateway.routing.filters import BalanceBound  # noqa: E402
from appliance.gateway.routing.prefix_index import PrefixIndex  # noqa: E402
from appliance.gateway.routing.request import RoutingRequest, render_chat  # noqa: E402
from appliance.gateway.routing.router import Outcome, Router  # noqa: E402
from appliance.gateway.routing.settings import PrefixScorerSettings, RoutingSettings  # noqa: E402
from appliance.gateway.schemas import ChatMessage  # noqa: E402
from appliance.loadtest.client import RequestResult, build_body, monotonic_clock, stream_request  # noqa: E402
from appliance.loadtest.stats import percentile  # noqa: E402
from tests.doubles import FakeReplica  # noqa: E402

_PRECISE = {"APPLIANCE_DISCOVERY__KV_EVENTS": "true"}  # and the tokenizer: the model's directory, set at run time
POLICIES = {  # name -> the gateway's environment for it
    "today": {"APPLIANCE_ROUTING__SCORERS__WEIGHTS__PREFIX": "0"},
    "prefix": {},
    "precise": {**_PRECISE, "APPLIANCE_ROUTING__PREFIX_CACHE__MODE": "precise"},
    "precise_fallback": {**_PRECISE, "APPLIANCE_ROUTING__PREFIX_CACHE__MODE": "precise-with-fallback"},
    "prefix_unbounded": {"APPLIANCE_ROUTING__SCORERS__PREFIX__BALANCE_WINDOW": "0"},  # without the balance bound
    "round_robin": {"APPLIANCE_ROUTING__SCORERS__POLICY": "round_robin"},
    "prefix_no_room": {"APPLIANCE_ROUTING__SCORERS__WEIGHTS__CACHE_ROOM": "0"},  # without the cache-room scorer
}
SCENARIOS = ("steady", "restart", "pressure", "two_gateways")
EVENTS = EngineSettings(kv_events="local")  # the engines publish as the appliance's own do
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


def round_order(count: int, turn: int) -> list[int]:
    """The conversations' order in round ``turn``: shuffled, the same for every policy and for the oracle."""
    order = list(range(count))
    random.Random(2 + turn).shuffle(order)
    return order


# -- the oracle -----------------------------------------------------------------------------------------------

def block_keys(ids: Sequence[int], block_size: int) -> list[int]:
    """A key per full block, chained (a block's key names every token before it too), as vLLM's block hashes;
    never negative (``EngineCache`` numbers the blocks no prompt can match below 0)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size]))) & 0x7FFF_FFFF_FFFF_FFFF
        keys.append(parent)
    return keys


class EngineCache:
    """One engine's prefix cache as vLLM's block pool keeps it, one request at a time: a free queue of blocks (a
    request takes new blocks from its head, evicting what they held, and gives all of its blocks back at its end:
    those that hold a full, hashed block to the tail, last block first, so the least recently used go first;
    partly filled ones to the head, to be reused before any cached block), and a map from full prompt blocks' keys
    to the blocks holding them. A request's KV covers its prompt and its output less the last token (never fed
    back); full blocks holding output tokens are cached by vLLM too, but no later prompt matches them. vLLM
    reserves one block (the null block): ``blocks`` is the engine's num_gpu_blocks."""

    def __init__(self, blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(blocks - 1))
        self.content: list[int | None] = [None] * (blocks - 1)
        self.where: dict[int, int] = {}
        self._unmatched = 0  # keys of cached blocks no prompt can match (output tokens, duplicates): -1, -2, ...

    def held(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, the cache holds."""
        count = 0
        for key in keys:
            if key not in self.where:
                break
            count += 1
        return count

    def unused(self) -> int:
        """Blocks that hold no reusable prompt block: taking them evicts nothing a prompt could hit."""
        return len(self.content) - len(self.where)

    def empty(self) -> None:
        """The engine restarted: nothing is cached."""
        self.where.clear()
        self.content = [None] * len(self.content)

    def _key(self, keys: Sequence[int], position: int) -> int:
        if position < len(keys) and keys[position] not in self.where:
            return keys[position]
        self._unmatched -= 1
        return self._unmatched

    def serve(self, ids: Sequence[int], output_tokens: int) -> int:
        """Play one request: the prompt tokens it found cached (vLLM's hits; its queries are len(ids))."""
        size = self.block_size
        keys = block_keys(ids, size)
        hit = self.held(keys[:(len(ids) - 1) // size])  # vLLM computes at least the prompt's last token
        computed = len(ids) + max(output_tokens - 1, 0)
        used = [self.where[key] for key in keys[:hit]]
        for block in used:
            del self.free[block]  # in use now: out of the free queue
        for position in range(hit, -(-computed // size)):
            block, _ = self.free.popitem(last=False)
            old = self.content[block]
            if old is not None and self.where.get(old) == block:
                del self.where[old]
            key = self._key(keys, position) if position < computed // size else None  # full blocks are hashed
            self.content[block] = key
            if key is not None and key >= 0:
                self.where[key] = block
            used.append(block)
        for block in reversed(used):
            self.free[block] = None
            if self.content[block] is None:
                self.free.move_to_end(block, last=False)
        return hit * size


class Oracle:
    """Routing that knows every engine's cache exactly (see the module's docstring): the longest cached prefix
    wins among the replicas within the router's balance bound."""

    def __init__(self, replicas: int, blocks: int, block_size: int, output_tokens: int,
                 balance: PrefixScorerSettings | None = None) -> None:
        bound = balance or PrefixScorerSettings()
        self.caches = [EngineCache(blocks, block_size) for _ in range(replicas)]
        self.output_tokens = output_tokens
        self.balance = BalanceBound(bound.balance_window, bound.balance_factor)
        self._replicas = [FakeReplica(f"replica-{i}") for i in range(replicas)]

    def route(self, ids: Sequence[int], available: Sequence[int]) -> tuple[int, int]:
        """The replica the request goes to, and the prompt tokens it finds cached there."""
        candidates = [self._replicas[i] for i in available]
        self.balance.observe(candidates)
        keys = block_keys(ids, self.caches[0].block_size)

        def rank(name: str) -> tuple[int, int, int, int]:
            index = int(name.rsplit("-", 1)[1])
            cache = self.caches[index]
            return cache.held(keys), cache.unused(), -self.balance.taken(name), -index

        chosen = max((r.name for r in self.balance.within(candidates)), key=rank)
        self.balance.chosen(chosen)
        index = int(chosen.rsplit("-", 1)[1])
        return index, self.caches[index].serve(ids, self.output_tokens)


@dataclass(frozen=True)
class Round:
    """One round as the oracle replays it: which replicas take requests, which restarted just before."""

    turn: int
    available: tuple[int, ...] = (0, 1)
    emptied: tuple[int, ...] = ()


def replay(oracle: Oracle, prompts: Callable[[int, int], Sequence[int]], count: int, schedule: Sequence[Round]
           ) -> list[dict]:
    """Each round's hits, queries (prompt tokens) and requests per replica, as the oracle routes them."""
    out = []
    for round_ in schedule:
        for replica in round_.emptied:
            oracle.caches[replica].empty()
        hits = queries = 0
        split = [0] * len(oracle.caches)
        for conv in round_order(count, round_.turn):
            ids = prompts(conv, round_.turn)
            replica, hit = oracle.route(ids, round_.available)
            hits += hit
            queries += len(ids)
            split[replica] += 1
        out.append({"round": round_.turn, "hits": hits, "queries": queries, "requests_per_engine": split})
    return out


def oracle_summary(rounds: Sequence[dict], scored_from: int) -> dict:
    scored = [r for r in rounds if r["round"] >= scored_from]
    hits, queries = sum(r["hits"] for r in scored), sum(r["queries"] for r in scored)
    split = [sum(column) for column in zip(*(r["requests_per_engine"] for r in scored), strict=True)]
    return {"hit_rate": round(hits / queries, 4) if queries else None, "hits": hits, "queries": queries,
            "requests_per_engine": split,
            "rounds": [round(r["hits"] / r["queries"], 4) if r["queries"] else None for r in rounds]}


# -- engines and gateways -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def engine_ports(count: int) -> list[int]:
    """Ports for ``count`` engines, each free together with the two its KV events take (its port + the offsets)."""
    taken: set[int] = set()
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        group = {port, *event_ports(port, EVENTS)}
        if max(group) < 65536 and not group & taken and all(_bindable(p) for p in group):
            ports.append(port)
            taken |= group
    return ports


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
           "VLLM_SERVER_DEV_MODE": "1", **kv_events_env(EVENTS)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), "--max-num-seqs", "16", "--enable-prefix-caching",
           "--num-gpu-blocks-override", str(blocks), *kv_events_argv(port, EVENTS)]
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


async def prompt_ids(session: aiohttp.ClientSession, url: str, convs: list[Conversation], turns: int
                     ) -> list[list[list[int]]]:
    """Every prompt's token ids as the engine tokenizes a completion's prompt: the oracle's input."""
    async def one(conv: Conversation, turn: int) -> list[int]:
        async with session.post(f"{url}/tokenize", json={"model": "demo", "prompt": conv.prompt(turn)}) as resp:
            return list((await resp.json())["tokens"])

    return [[await one(conv, turn) for turn in range(turns)] for conv in convs]


async def play(gateways: list[str], convs: list[Conversation], turn: int, clients: int, max_tokens: int
               ) -> tuple[list[RequestResult], float]:
    """One round: every conversation's turn ``turn`` in ``round_order``; conversation c's to gateway
    (c + turn) mod the number of gateways."""
    queue: asyncio.Queue = asyncio.Queue()
    for conv in round_order(len(convs), turn):
        queue.put_nowait(conv)
    clock = monotonic_clock()
    results: list[RequestResult] = []
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                gateway = gateways[(conv + turn) % len(gateways)]
                result = RequestResult(index=len(results), phase="measure", intended=clock())
                body = build_body("demo", {"prompt": convs[conv].prompt(turn)}, max_tokens, ignore_eos=True)
                results.append(await stream_request(session, f"{gateway}/v1/completions", body, result, clock, 120))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return results, time.perf_counter() - started


def routing_counts(page: str) -> dict[str, float]:
    """The gateway's routing decisions by ``decided_by``, its prefix yields, and where the chosen replica's prefix
    score came from (``source.precise``, ``source.approximate``, ``source.none``), from its /metrics text."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        for metric, label in (("appliance_routing_decisions_total{", "decided_by="),
                              ("appliance_routing_prefix_source_total{", "source=")):
            if line.startswith(metric):
                labels = line.split("{", 1)[1].split("}", 1)[0]
                value = next(p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith(label))
                key = value if label == "decided_by=" else f"source.{value}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("appliance_routing_prefix_yields_total "):
            out["prefix_yields"] = out.get("prefix_yields", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def gateway_routing(session: aiohttp.ClientSession, gateways: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for gateway in gateways:
        async with session.get(f"{gateway}/metrics") as resp:
            for key, value in routing_counts(await resp.text()).items():
                out[key] = out.get(key, 0.0) + value
    return out


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


async def publish_reset(session: aiohttp.ClientSession, engines: list[str]) -> None:
    """Make each engine publish the AllBlocksCleared its /reset_prefix_cache queued: vLLM publishes KV events from
    its scheduler's steps, so until the engine's next request a subscribed gateway's index still lists what the
    engine held before the reset (the previous policy's run of the same prompts), and a round's first requests were
    routed on it. One request of a few tokens, straight to the engine: it stores no full block."""
    for url in engines:
        body = {"model": "demo", "prompt": "reset", "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, f"publishing the reset: HTTP {resp.status}"


async def indexes_usable(session: aiohttp.ClientSession, gateway: str, replicas: int, timeout: float
                         ) -> float | None:
    """Wait until the gateway routes on every replica's event index, each index is empty (the engines' reset
    applied) and its tokenizer has loaded (until then prompts go untokenized); the seconds it took (None: not in
    time)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        async with session.get(f"{gateway}/metrics") as resp:
            page = await resp.text()
        lines = page.splitlines()
        usable = [line for line in lines
                  if line.startswith("appliance_routing_kv_index_usable{") and line.endswith(" 1.0")]
        held = [line for line in lines
                if line.startswith("appliance_routing_kv_index_blocks{") and not line.endswith(" 0.0")]
        if len(usable) >= replicas and not held and "appliance_routing_tokenizer_loaded 1.0" in lines:
            return round(time.monotonic() - started, 1)
        await asyncio.sleep(0.5)
    return None


# -- the scenarios --------------------------------------------------------------------------------------------

@dataclass
class Bench:
    """What every scenario shares: the engines, their URLs, the workloads and the gateways' common settings."""

    args: argparse.Namespace
    session: aiohttp.ClientSession
    procs: list[subprocess.Popen]
    work: Path
    ports: list[int]
    engines: list[subprocess.Popen] = field(default_factory=list)
    gateway_env: dict[str, str] = field(default_factory=dict)
    blocks: int = 0
    block_size: int = 0

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def counters(self) -> list[dict[str, float]]:
        return [await engine_counters(self.session, url) for url in self.urls]

    def start_engine(self, index: int, label: str) -> subprocess.Popen:
        args = self.args
        proc = start_engine(Path(args.model), self.ports[index], index, args.blocks, args.max_model_len,
                            self.work / f"engine-{index}{label}.log")
        self.procs.append(proc)
        if index < len(self.engines):
            self.engines[index] = proc
        else:
            self.engines.append(proc)
        return proc

    async def gateways(self, policy: str, label: str, count: int) -> tuple[list[subprocess.Popen], list[str], dict]:
        """``count`` fresh gateways of ``policy``, the engines' caches emptied; and how long the event indexes took
        to become usable (precise policies)."""
        procs, urls = [], []
        for i in range(count):
            port = free_port()
            proc = start_gateway(self.urls, port, {**self.gateway_env, **POLICIES[policy]},
                                 self.work / f"state-{label}-{i}", self.work / f"gateway-{label}-{i}.log")
            self.procs.append(proc)
            await wait_until(self.session, f"http://127.0.0.1:{port}/health/ready", 60, proc)
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        for url in self.urls:
            async with self.session.post(f"{url}/reset_prefix_cache") as resp:
                assert resp.status == 200, f"reset_prefix_cache: HTTP {resp.status}"
        await publish_reset(self.session, self.urls)
        setup: dict = {}
        if "APPLIANCE_ROUTING__PREFIX_CACHE__MODE" in POLICIES[policy]:
            setup["index_usable_after_s"] = [await indexes_usable(self.session, url, len(self.urls), 30)
                                             for url in urls]
        return procs, urls, setup


async def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.wait, 60)


async def measure_rounds(b: Bench, gateways: list[str], convs: list[Conversation], first_turn: int, turns: int,
                         scored_from: int) -> dict:
    """Rounds ``first_turn``.. with the engines' counters read around each: each round's numbers (and how the
    gateways decided them), and those of the rounds from ``scored_from`` together."""
    marks = [await b.counters()]
    decided = await gateway_routing(b.session, gateways)
    rounds: list[dict] = []
    played: list[tuple[list[RequestResult], float]] = []
    for turn in range(first_turn, first_turn + turns):
        results, wall = await play(gateways, convs, turn, b.args.clients, b.args.max_tokens)
        marks.append(await b.counters())
        now = await gateway_routing(b.session, gateways)
        decisions = {k: v - decided.get(k, 0.0) for k, v in now.items() if v - decided.get(k, 0.0)}
        rounds.append({"round": turn, **summarize(results, wall, marks[-2], marks[-1]), "decided_by": decisions})
        played.append((results, wall))
        decided = now
    first = max(scored_from - first_turn, 0)
    everything = [r for results, _ in played[first:] for r in results]
    scored = summarize(everything, sum(wall for _, wall in played[first:]), marks[first], marks[-1])
    return {"scored": scored, "rounds": rounds}


async def steady(b: Bench, policy: str, label: str, convs: list[Conversation], gateways: int) -> dict:
    """``--turns`` rounds through ``gateways`` gateways; scored from round 1."""
    procs, urls, setup = await b.gateways(policy, label, gateways)
    out = {**setup, **await measure_rounds(b, urls, convs, 0, b.args.turns, 1)}
    for proc in procs:
        await stop(proc)
    return out


async def restart(b: Bench, policy: str, convs: list[Conversation]) -> dict:
    """Two warm rounds, engine 1 stopped and started again while round 2 plays, two rounds after: scored."""
    procs, urls, setup = await b.gateways(policy, f"restart-{policy}", 1)
    warm = await measure_rounds(b, urls, convs, 0, 2, 0)
    await stop(b.engines[1])
    down_s = await replica_state(b.session, urls[0], "external-1", "unhealthy", 60)
    engine = b.start_engine(1, f"-{policy}")
    away, away_wall = await play(urls, convs, 2, b.args.clients, b.args.max_tokens)
    await wait_until(b.session, f"{b.urls[1]}/health", 300, engine)
    back_s = await replica_state(b.session, urls[0], "external-1", "ready", 60)
    after = await measure_rounds(b, urls, convs, 3, 2, 3)
    await stop(procs[0])
    return {**setup, **after, "warm_rounds": warm["rounds"],
            "while_away": {"requests": len(away), "failed": sum(not r.ok for r in away),
                           "wall_s": round(away_wall, 2)},
            "seen_down_after_s": round(down_s, 1), "seen_ready_after_s": round(back_s, 1)}


SCHEDULES: dict[str, Callable[[int], tuple[list[Round], int]]] = {  # scenario -> (rounds for turns, scored from)
    "steady": lambda turns: ([Round(t) for t in range(turns)], 1),
    "pressure": lambda turns: ([Round(t) for t in range(turns)], 1),
    "two_gateways": lambda turns: ([Round(t) for t in range(turns)], 1),
    "restart": lambda turns: ([Round(0), Round(1), Round(2, (0,), (1,)), Round(3), Round(4)], 3),
}
RESTART_ROUNDS = 5  # 2 warm, 1 while engine 1 restarts, 2 after it is back


def oracle_for(b: Bench, scenario: str, ids: list[list[list[int]]]) -> dict:
    schedule, scored_from = SCHEDULES[scenario](b.args.turns)
    oracle = Oracle(len(b.ports), b.blocks, b.block_size, b.args.max_tokens)
    return oracle_summary(replay(oracle, lambda c, t: ids[c][t], len(ids), schedule), scored_from)


async def run_engines(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"scenarios": {}}
    with processes() as procs:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            b = Bench(args, session, procs, work, engine_ports(2))
            for i in range(2):
                b.start_engine(i, "")
            for proc, url in zip(b.engines, b.urls, strict=True):
                await wait_until(session, f"{url}/health", 300, proc)
            per_word, chars_per_token = await tokens_per_word(session, b.urls[0])
            prefix_words = int(args.prefix_tokens / per_word)
            info = await engine_counters(session, b.urls[0])
            b.blocks = int(info.get("cache_config.num_gpu_blocks") or args.blocks)
            b.block_size = int(info.get("cache_config.block_size") or args.block_size)
            pressure = args.pressure_conversations or round(2 * b.blocks * b.block_size / args.prefix_tokens)
            turns = max(args.turns, RESTART_ROUNDS)  # the same texts whichever scenarios run
            workloads = {"steady": conversations(args.conversations, prefix_words, turns)}
            workloads["pressure"] = conversations(pressure, prefix_words, turns)
            b.gateway_env = {"APPLIANCE_ROUTING__SCORERS__PREFIX__CHARS_PER_TOKEN": f"{chars_per_token:.3f}",
                             "APPLIANCE_ROUTING__PREFIX_CACHE__TOKENIZER": str(Path(args.model).resolve())}
            report["setup"] = {
                "engines": 2, "cores_per_engine": 1, "conversations": args.conversations,
                "pressure_conversations": pressure, "turns": args.turns, "clients": args.clients,
                "max_tokens": args.max_tokens, "tokens_per_word": round(per_word, 3),
                "chars_per_token": round(chars_per_token, 3), "prefix_tokens_target": args.prefix_tokens,
                "max_model_len": args.max_model_len, "kv_blocks_per_engine": b.blocks, "block_size": b.block_size,
                "kv_tokens_per_engine": b.blocks * b.block_size,
                "all_prefixes_tokens": int(args.conversations * args.prefix_tokens),
                "pressure_prefixes_tokens": int(pressure * args.prefix_tokens),
            }
            print(json.dumps(report["setup"]), flush=True)
            ids = {name: await prompt_ids(session, b.urls[0], convs, turns) for name, convs in workloads.items()}
            for scenario in args.scenarios:
                convs = workloads["pressure" if scenario == "pressure" else "steady"]
                started = time.monotonic()
                oracle = oracle_for(b, scenario, ids["pressure" if scenario == "pressure" else "steady"])
                rows: dict = {}
                for policy in args.policies:
                    if scenario == "restart":
                        rows[policy] = await restart(b, policy, convs)
                    else:
                        rows[policy] = await steady(b, policy, f"{scenario}-{policy}", convs,
                                                    2 if scenario == "two_gateways" else 1)
                    print(scenario, policy, json.dumps(rows[policy]), flush=True)
                report["scenarios"][scenario] = {"oracle": oracle, "policies": rows,
                                                 "wall_s": round(time.monotonic() - started, 1)}
                print(table(scenario, rows, oracle), flush=True)
    report["goals"] = goals(report)
    return report


def table(scenario: str, rows: dict, oracle: dict) -> str:
    """The scenario's numbers, a policy a line: scored rounds' hit rate, the oracle's and the ratio, TTFT, split."""
    base = rows.get("today", {}).get("scored", {})
    lines = [f"== {scenario} (oracle hit rate {oracle['hit_rate']}, split {oracle['requests_per_engine']})",
             f"{'policy':<18}{'hit':>7}{'oracle':>8}{'/orcl':>7}{'p50 s':>8}{'p95 s':>8}{'p50/lo':>8}"
             f"{'split':>12}{'max/mn':>8}{'failed':>7}  hit per round"]
    for name, row in rows.items():
        s = row["scored"]
        hit, best = s["hit_rate"], oracle["hit_rate"]
        to_oracle = f"{hit / best:.3f}" if hit is not None and best else "-"
        to_base = f"{s['ttft_p50_s'] / base['ttft_p50_s']:.3f}" if base.get("ttft_p50_s") else "-"
        split = "/".join(str(int(n)) for n in s["requests_per_engine"])
        per_round = " ".join(str(r["hit_rate"]) for r in row["rounds"])
        lines.append(f"{name:<18}{hit!s:>7}{best!s:>8}{to_oracle:>7}{s['ttft_p50_s']:>8.3f}{s['ttft_p95_s']:>8.3f}"
                     f"{to_base:>8}{split:>12}{s['max_over_mean']!s:>8}{s['failed']:>7}  {per_round}")
    return "\n".join(lines)


def goals(report: dict) -> dict:
    """The issue's goals next to what was measured (not assertions: a benchmark reports)."""
    wanted = {"steady": 0.8, "restart": 0.75, "two_gateways": 0.75}
    out: dict = {}
    for scenario, data in report["scenarios"].items():
        rows = data["policies"]
        precise, approximate = rows.get("precise"), rows.get("prefix")
        entry: dict = {"oracle": data["oracle"]["hit_rate"]}
        if precise and approximate:
            entry["precise_ge_approximate"] = (precise["scored"]["hit_rate"] or 0) >= (
                approximate["scored"]["hit_rate"] or 0)
        if precise and scenario in wanted:
            entry[f"precise_hit_rate_ge_{wanted[scenario]}"] = (precise["scored"]["hit_rate"] or 0) >= wanted[scenario]
        out[scenario] = entry
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
        "hit_rate": round(hits / queries, 4) if queries else None, "hits": hits, "queries": queries,
        "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p95_s": round(percentile(ttfts, 95), 4),
        "throughput_rps": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
        "requests_per_engine": split, "max_over_mean": round(max(split) / mean, 3) if mean else None,
    }


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
    eng.add_argument("--pressure-conversations", type=int, default=0,
                     help="the pressure scenario's; default: all prefixes twice one engine's KV cache")
    eng.add_argument("--turns", type=int, default=3, help="rounds of the steady, pressure and two-gateway scenarios")
    eng.add_argument("--prefix-tokens", type=int, default=700, help="per conversation (system + earlier turns)")
    eng.add_argument("--max-model-len", type=int, default=1024)
    eng.add_argument("--blocks", type=int, default=0, help="KV blocks per engine; default: 2/3 of all prefixes")
    eng.add_argument("--block-size", type=int, default=128,
                     help="vLLM's KV block size (the CPU backend's default is 128); only sizes --blocks' default")
    eng.add_argument("--clients", type=int, default=8)
    eng.add_argument("--max-tokens", type=int, default=8)
    eng.add_argument("--policies", nargs="*", default=["today", "prefix", "precise"], choices=list(POLICIES))
    eng.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
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

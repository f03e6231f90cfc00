"""What precise prefix routing costs per request, at 1k and 8k-token prompts; and what applying events costs.

    python bench/prefix_precise.py [--tokenizer DIR] [--replicas 4] [--indexed 2000] [--requests 200]

For each prompt size, a chat request whose system prompt is that many tokens of the demo model's training text
(the Python reference pages) is timed through each step of the decision, as the gateway runs it:

- ``tokenize_ms``: the chat template and the tokenizer (the model's own, offline), in a worker thread;
- ``keys_ms``: the prompt's block hashes (SHA-256 chain as vLLM's), in the same worker;
- ``decision_precise_us``: the router's decision on the event loop with the precise scorer (filters, every
  scorer, the longest held prefix on each replica's event index, the approximate index kept fed), then release;
- ``decision_approximate_us``: the same decision with the approximate scorer alone (it renders nothing here: the
  rendering is the route's in both cases), for comparison;
- ``loop_added_us``: what precise routing adds on the event loop (the difference).

Each replica's index holds ``--indexed`` other prompts' blocks, and one replica holds the timed prompt's whole
prefix (so the lookup walks every block: the worst case). ``apply`` decodes and applies event batches as the
subscriber does (a batch of 32 stored blocks, then one of their removal), per event, on the event loop.

No engine runs: the numbers are the gateway's own work. Nothing is tuned to pass.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from appliance.gateway.routing.kv_events.hashing import BlockHasher  # noqa: E402
from appliance.gateway.routing.kv_events.hub import KvEventsHub  # noqa: E402
from appliance.gateway.routing.kv_events.index import ReplicaIndex  # noqa: E402
from appliance.gateway.routing.kv_events.scorer import PreciseScorer  # noqa: E402
from appliance.gateway.routing.kv_events.settings import PrefixCacheSettings  # noqa: E402
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer, PromptTokens, token_job  # noqa: E402
from appliance.gateway.routing.kv_events.wire import Batch, BlockRemoved, BlockStored, decode  # noqa: E402
from appliance.gateway.routing.request import RoutingRequest, render_chat  # noqa: E402
from appliance.gateway.routing.router import Outcome, Router  # noqa: E402
from appliance.gateway.routing.settings import RoutingSettings  # noqa: E402
from appliance.gateway.schemas import ChatMessage  # noqa: E402
from tests.doubles import FakeReplica  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def system_prompt(tokenizer: PromptTokenizer, text: str, tokens: int) -> str:
    ids = tokenizer.tokenize(token_job("completions", {"prompt": text[: tokens * 8], "add_special_tokens": False}))
    return tokenizer._tokenizer().decode(ids[:tokens])


def routers(replicas: list[FakeReplica], hub: KvEventsHub) -> dict[str, Router]:
    hasher = BlockHasher("random")
    return {"precise": Router(lambda: replicas, RoutingSettings(),
                              affinity_scorer=lambda s: PreciseScorer(s, hub, "precise-with-fallback", hasher)),
            "approximate": Router(lambda: replicas, RoutingSettings())}


def fill(hub: KvEventsHub, replicas: list[FakeReplica], indexed: int, prompt: PromptTokens, rng: random.Random
         ) -> None:
    hasher = BlockHasher("random")
    for replica in replicas:
        index = hub.indexes[replica.name] = ReplicaIndex(10_000_000)
        index.trusted_from = 0.0
        for _ in range(indexed):
            keys = [rng.getrandbits(64) for _ in range(64)]
            index.apply(BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=BLOCK))
    keys = prompt.keys(hasher, BLOCK)
    hub.indexes[replicas[-1].name].apply(BlockStored(block_hashes=list(keys), parent_block_hash=None,
                                                     token_ids=[], block_size=BLOCK))


def time_decisions(router: Router, requests: list[RoutingRequest]) -> float:
    started = time.perf_counter()
    for request in requests:
        replica = router.try_acquire(request=request)
        assert replica is not None
        router.release(replica, Outcome.SUCCESS)
    return (time.perf_counter() - started) / len(requests)


def measure(tokenizer: PromptTokenizer, size: int, args: argparse.Namespace, text: str) -> dict[str, float]:
    rng = random.Random(size)
    system = system_prompt(tokenizer, text, size)
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is a for loop?"}]}
    job = token_job("chat", body)
    assert job is not None
    hasher = BlockHasher("random")
    tokenize, keys, ids = [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        ids = tokenizer.tokenize(job)
        tokenize.append(time.perf_counter() - started)
        started = time.perf_counter()
        PromptTokens(ids).keys(hasher, BLOCK)
        keys.append(time.perf_counter() - started)
    replicas = [FakeReplica(f"replica-{i}") for i in range(args.replicas)]
    hub = KvEventsHub(PrefixCacheSettings(mode="precise-with-fallback"), lambda _r: None, lambda: replicas)
    fill(hub, replicas, args.indexed, PromptTokens(ids), rng)
    rendered = render_chat(ChatMessage(**message) for message in body["messages"])
    out: dict[str, float] = {"prompt_tokens": len(ids), "tokenize_ms": round(statistics.median(tokenize) * 1e3, 2),
                             "keys_ms": round(statistics.median(keys) * 1e3, 3)}
    for name, router in routers(replicas, hub).items():
        requests = []
        for _ in range(args.requests):
            prompt = PromptTokens(list(ids))
            prompt.keys(hasher, BLOCK)  # as the worker leaves it
            requests.append(RoutingRequest(rendered, tokens=prompt if name == "precise" else None))
        time_decisions(router, requests[:10])  # warm
        out[f"decision_{name}_us"] = round(time_decisions(router, requests[10:]) * 1e6, 1)
    out["loop_added_us"] = round(out["decision_precise_us"] - out["decision_approximate_us"], 1)
    return out


def apply_cost(rounds: int = 2000) -> dict[str, float]:
    """Decoding and applying events as the subscriber does, per event."""
    rng = random.Random(7)
    encoder = msgspec.msgpack.Encoder()
    index = ReplicaIndex(10_000_000)
    payloads = []
    for _ in range(rounds):
        hashes = [rng.randbytes(32) for _ in range(32)]
        payloads.append(encoder.encode(Batch(ts=time.time(), events=[
            BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=list(range(32 * BLOCK)),
                        block_size=BLOCK, medium="GPU")])))
        payloads.append(encoder.encode(Batch(ts=time.time(), events=[BlockRemoved(block_hashes=list(hashes),
                                                                                   medium="GPU")])))
    started = time.perf_counter()
    for payload in payloads:
        index.apply_batch(decode(payload), 0.0, time.time())
    elapsed = time.perf_counter() - started
    return {"batches": len(payloads), "per_block_event_us": round(elapsed / (rounds * 64) * 1e6, 2),
            "per_batch_us": round(elapsed / len(payloads) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the demo model)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--indexed", type=int, default=2000, help="other prompts (64 blocks each) per replica")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20, help="tokenizations timed per size (median)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 8000])
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:
        from appliance.cli.serve import ensure_demo_model
        from tests.conftest import _model_code_hash

        path = ensure_demo_model(REPO / "var" / "test-cache" / f"models-{_model_code_hash()}")
    tokenizer = PromptTokenizer(path, threads=1)
    try:
        text = corpus()
        result = {"tokenizer": str(path), "replicas": args.replicas, "indexed_blocks_per_replica": args.indexed * 64,
                  **{f"{size}_tokens": measure(tokenizer, size, args, text) for size in args.sizes},
                  "apply": apply_cost()}
    finally:
        tokenizer.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The appliance's own work per request and per read, in-process and without a network: the gateway's request path
as the composition root builds it (every hook in its order, admission, routing), one stream driven through it
with vLLM's bytes from the tests' fake engine, one event per read (a gateway that keeps up with its engines reads
each token as it comes).

It prints microseconds per request for the decisions up to the first byte (the exchange built, the hooks started
and checked, a slot taken and the attempt begun, the request's headers) and per read for the relay, which is the
transport's own (``Upstream._relay``: framing, the block, every relay hook, and the request's end spread over its
reads: the slot given back, every hook's end), best of the rounds: the two numbers bench/stream_overhead.py finds
above the bare relay, measured here without the noise of a shared machine, so that a change can be compared side by
side (``--compare-tree DIR`` runs the same in another checkout, alternating). Numbers, never assertions.

    .venv/bin/python bench/relay_hooks.py [--tokens 64] [--requests 400] [--rounds 7] [--compare-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class EngineResponse:
    """What the relay reads of an engine's answer: its events, one read each; released or closed when settled."""

    def __init__(self, events: list[bytes]) -> None:
        self.content = self
        self._events = events

    async def iter_any(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield event

    def release(self) -> None:
        pass

    close = release


def measure(tokens: int, requests: int) -> tuple[float, float]:
    """(µs per request up to the first byte, µs per read of the relay) for ``requests`` streams of ``tokens``."""
    from prometheus_client import CollectorRegistry
    from starlette.requests import Request

    from appliance.composition.gateway import build_gateway
    from appliance.gateway.routing.request import RoutingRequest
    from appliance.gateway.upstream.exchange import Exchange
    from appliance.gateway.upstream.hook import HookChain
    from appliance.settings import Settings
    from tests.doubles import FakeReplica
    from tests.fake_engine import FakeEngine

    replica = FakeReplica("replica-0")
    gateway = build_gateway(Settings(served_model_name="demo"), lambda: [replica], CollectorRegistry())
    gc.collect()
    gc.freeze()  # as the app does once it has started: what lives as long as the app is not traversed
    upstream, admission = gateway.upstream, gateway.admission
    engine = FakeEngine(served_model_name="demo", response_id="cmpl-0123456789abcdef", created=1764800000)
    client_body = {"model": "demo", "prompt": "Once upon a time there was a relay", "max_tokens": tokens,
                   "stream": True}
    raw = json.dumps(client_body).encode()
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                             "state": {}, "query_string": b""}
    events: list[bytes] | None = None
    decisions = relay = 0.0

    async def one() -> None:
        nonlocal events, decisions, relay
        started = time.perf_counter()
        request = Request(scope)
        exchange = Exchange(route="completions", path="/v1/completions", body=raw, stream=True,
                            arrived=time.monotonic(), headers={}, request=request,
                            routing=RoutingRequest(client_body["prompt"]), parsed_body=dict(client_body))
        exchange.hooks = HookChain([h for hook in upstream.hooks if (h := hook.start(exchange)) is not None])
        pending = exchange.hooks.arrived()
        if pending is not None:
            await pending
        await upstream.admit(exchange, "first")
        headers: dict[str, str] = {}
        exchange.hooks.sending(exchange.attempt, headers)
        upstream._response_headers(exchange)
        middle = time.perf_counter()
        if events is None:  # the engine's bytes for the body as the hooks rewrote it (ids, usage asked for)
            events = engine.stream_events(json.loads(exchange.body))
        exchange.upstream = EngineResponse(events)  # type: ignore[assignment]
        async for _ in upstream._relay(exchange):  # the transport's own relay, the request's end included
            pass
        ended = time.perf_counter()
        decisions += middle - started
        relay += ended - middle

    async def run() -> None:
        for _ in range(requests):
            await one()

    asyncio.run(run())
    held = admission.router.in_flight(replica.name)
    assert held == 0, f"{held} slot(s) still held after the streams ended"
    reads = requests * len(events or [])
    return decisions / requests * 1e6, relay / reads * 1e6


def child(tree: Path, tokens: int, requests: int) -> tuple[float, float]:
    """One measurement in a fresh interpreter, of ``tree``'s code (this bench need not exist there)."""
    out = subprocess.run([sys.executable, __file__, "--tokens", str(tokens), "--requests", str(requests),
                          "--once", str(tree)], cwd=tree, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare-tree", metavar="DIR", help="another checkout, measured alternating with this")
    parser.add_argument("--once", metavar="TREE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        sys.path.insert(0, args.once)
        print(*measure(args.tokens, args.requests))
        return
    trees = {"this": REPO, **({"other": Path(args.compare_tree).resolve()} if args.compare_tree else {})}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            got = child(tree, args.tokens, args.requests)
            held = best.get(name)
            best[name] = got if held is None else (min(held[0], got[0]), min(held[1], got[1]))
    print(f"{args.requests} streams x {args.tokens} tokens, one event per read; best of {args.rounds} rounds")
    print(f"{'tree':<6} {'µs per request':>15} {'µs per read':>12}")
    for name, (per_request, per_read) in best.items():
        print(f"{name:<6} {per_request:>15.1f} {per_read:>12.2f}")
    if "other" in best:
        print(f"this / other: per request {best['this'][0] / best['other'][0]:.3f}, "
              f"per read {best['this'][1] / best['other'][1]:.3f}")


if __name__ == "__main__":
    main()

"""Storms of poison and healthy requests interleaved on three replicas: no replica is ejected by a poison, every
healthy request is served in full, and the breakers' memory stays within ``breaker.max_shapes``.

A seeded generator draws, per case, a crowd of concurrent clients against a real uvicorn: healthy requests (any
route, streamed or not, each its own prompt) and poison requests (an input every fake engine answers with vLLM's
500, or streams up to its 5xx error event, after a drawn number of tokens), some of them the same request again
(a client's retries), some new. There are more poison shapes over the storm than the breakers may remember, so the
LRU evicts and shapes are learned again. Some cases eject one or two replicas for a moment, as a loaded host's
TTFT outliers are, at a drawn instant: a poison that fails on the one replica left then waits for another to be
told. Invariants after every case: no replica has a failure in a row, none was ejected but by the storm itself,
nothing is in flight, and the breakers hold at most ``max_shapes`` shapes.

The fake engine (tests/fake_engine.py) is fine here: what is verified is the gateway's own judgement. The same
kind of poison runs against real vLLM in tests/integration/test_poison.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.breaker.circuit import Breaker
from appliance.gateway.breaker.hook import ShapeBreaker
from appliance.gateway.core import Gateway
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, FakeEngine, Poison
from tests.gateway.live import LiveGateway, wait_until

CASES = 40
SEED = 20261205
MAX_SHAPES = 6
MARKERS = [f"<<raise-{i}>>" for i in range(12)]  # x 2 routes: 24 poison shapes, four times MAX_SHAPES
ANSWER = " t0 t1 t2"


@dataclass
class Storm:
    live: LiveGateway
    app: object
    engines: list[FakeEngine]
    served: int = 0
    poisons_sent: int = 0
    refused: int = 0  # poison requests answered 422 (refused at once, or judged the input's on their 2nd replica)
    largest: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)  # replica -> ejections the storm made

    @property
    def gateway(self) -> Gateway:
        return context_of(self.app).gateway

    @property
    def breaker(self) -> Breaker:
        hook = next(h for h in self.gateway.upstream.hooks if isinstance(h, ShapeBreaker))
        assert hook.breaker is not None
        return hook.breaker

    def counted(self) -> dict[str, tuple[int, int]]:
        return {name: (h.consecutive_failures, h.ejections) for name, h in self.gateway.router.ejector.health.items()}

    def only_injected(self) -> bool:
        """No failure in a row anywhere, and every ejection one the storm made."""
        return all(value == (0, self.injected.get(name, 0)) for name, value in self.counted().items())


@pytest.fixture(scope="module")
def storm():
    rng = random.Random(SEED)
    poisons = [Poison(marker, after=rng.randint(0, 2)) for marker in MARKERS]
    engines = [FakeEngine(model=CountingModel(prefix=" t"), tokens=3, poisons=poisons, token_delay=0.002).start()
               for _ in range(3)]
    fleet = [FakeReplica(f"replica-{i}", engine.url) for i, engine in enumerate(engines)]
    settings = Settings(served_model_name="demo", request_timeout_seconds=20,
                        breaker={"max_shapes": MAX_SHAPES},
                        admission={"max_queue": 256, "queue_timeout_seconds": 10},
                        # the storm's ejections: short, and two of three leave one replica routed (no panic)
                        routing={"metrics_poll_seconds": 0.2, "eject_base_seconds": 0.2, "eject_max_seconds": 0.4,
                                 "eject_panic_threshold": 0.3})
    app = create_app(settings, replicas=lambda: fleet, registry=CollectorRegistry())
    with LiveGateway(app) as live:
        yield Storm(live, app, engines)
    for engine in engines:
        engine.stop()


def body_for(route: str, prompt: str, stream: bool) -> tuple[str, dict]:
    if route == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                                        "stream": stream}
    return "/v1/completions", {"prompt": prompt, "max_tokens": 3, "stream": stream}


def text_of(route: str, stream: bool, raw: bytes) -> tuple[str, bool]:
    """The answer's text, and whether it ended with an error (an error event, or an error answer)."""
    if not stream:
        answer = json.loads(raw)
        if "error" in answer:
            return "", True
        choice = answer["choices"][0]
        return (choice["message"]["content"] if route == "chat" else choice["text"]), False
    text, errored = [], False
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errored = True
        for choice in event.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "" if route == "chat" else choice["text"])
    return "".join(text), errored


async def healthy(http: httpx.AsyncClient, rng: random.Random, storm: Storm) -> None:
    route, stream = rng.choice(["completions", "chat"]), rng.random() < 0.6
    path, body = body_for(route, f"healthy question {rng.random():.6f}", stream)
    answer = await http.post(path, json=body)
    text, errored = text_of(route, stream, answer.content)
    assert answer.status_code == 200 and not errored and text == ANSWER, (body, answer.status_code, answer.text)
    storm.served += 1


async def poison(http: httpx.AsyncClient, marker: str, route: str, rng: random.Random, storm: Storm) -> None:
    stream = rng.random() < 0.5
    path, body = body_for(route, f"do {marker} please", stream)
    if rng.random() < 0.3:
        body["stop"] = ["never"]  # a stream migration does not continue: the engine's error event as it came
    answer = await http.post(path, json=body)
    _, errored = text_of(route, stream, answer.content)
    assert answer.status_code in (200, 422, 500) and (errored or answer.status_code != 200), answer.text
    storm.poisons_sent += 1
    storm.refused += answer.status_code == 422
    storm.seen[str(answer.status_code)] = storm.seen.get(str(answer.status_code), 0) + 1


async def outliers(storm: Storm, rng: random.Random) -> None:
    """One or two replicas ejected at a drawn instant, as TTFT outliers (for the period the settings give), one
    always left in rotation (all ejected, routing would panic: the storm's doing, not a poison's)."""
    await asyncio.sleep(rng.uniform(0, 0.05))
    ejector = storm.gateway.router.ejector
    in_rotation = [f"replica-{i}" for i in range(len(storm.engines)) if not ejector.is_ejected(f"replica-{i}")]
    for name in rng.sample(in_rotation, min(rng.randint(1, 2), len(in_rotation) - 1)):
        ejector.eject(name, "TTFT outlier (the storm's)")
        storm.injected[name] = storm.injected.get(name, 0) + 1


async def crowd(storm: Storm, rng: random.Random) -> None:
    markers = rng.sample(MARKERS, 2)  # at most 4 poison shapes at once: within MAX_SHAPES
    async with httpx.AsyncClient(base_url=storm.live.url, timeout=30) as http:
        clients = [outliers(storm, random.Random(rng.random()))] if rng.random() < 0.7 else []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.35:
                clients.append(poison(http, rng.choice(markers), rng.choice(["completions", "chat"]),
                                      random.Random(rng.random()), storm))
            else:
                clients.append(healthy(http, random.Random(rng.random()), storm))
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.02))
        await asyncio.wait_for(asyncio.gather(*clients), timeout=60)


def warm(storm: Storm) -> None:
    """The fleet has served before the storm, as a fleet in service has: each replica's health is in evidence."""
    async def each() -> None:
        async with httpx.AsyncClient(base_url=storm.live.url, timeout=30) as http:
            await asyncio.gather(*(healthy(http, random.Random(i), storm) for i in range(9)))
    asyncio.run(each())
    assert all(engine.received for engine in storm.engines)


def test_poison_storms_eject_no_replica_and_every_healthy_request_is_served(storm: Storm) -> None:
    started = time.monotonic()
    warm(storm)
    for case in range(CASES):
        rng = random.Random(SEED + case)
        asyncio.run(crowd(storm, rng))
        assert wait_until(lambda: storm.gateway.router.in_flight() == 0, timeout=20), f"case {case}"
        assert storm.only_injected(), f"case {case}: {storm.counted()}, the storm ejected {storm.injected}"
        assert not storm.gateway.router.panic()
        storm.largest = max(storm.largest, len(storm.breaker))
        assert len(storm.breaker) <= MAX_SHAPES, f"case {case}"
    engine_hits = sum(engine.poisoned for engine in storm.engines)
    print(f"{CASES} poison storm cases in {time.monotonic() - started:.1f}s: {storm.served} healthy served, "
          f"{storm.poisons_sent} poisons sent ({storm.seen}), {engine_hits} reached an engine, "
          f"{storm.breaker.evicted} shapes evicted, at most {storm.largest} remembered, replicas ejected by the "
          f"storm {storm.injected}")
    assert engine_hits <= 2 * storm.poisons_sent  # a poison is tried on one more replica at most
    assert storm.breaker.refusals > 0 and storm.refused > 0  # open breakers refused repeats before any engine
    assert storm.breaker.evicted > 0  # the LRU's bound was reached and held

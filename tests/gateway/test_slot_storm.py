"""Storms of clients that leave at every moment: after each, every slot is back and a request succeeds.

Issue 20: bursts of streaming clients that all hung up at once wedged the gateway for good (its in-flight count
stayed at the replica's limit while the engine was idle). Each disconnect path passed when tested alone; the leak
was a race between them (a client that left as its upstream answered: the stream response was built and dropped
unserved). So these tests generate interleavings instead of examples: a seeded generator draws, per case, the
fake engines' behaviour (speed, stream length, a replica answering 503 so requests retry, one ejected) and a crowd
of clients that each leave at a drawn moment (right after sending, while queued, at the response headers, mid-
stream, or not at all), all against a real uvicorn so that clients really disconnect. The invariant is checked
after every case: nothing in flight, nothing queued, no lease held, and none of it returned by the garbage
collector's backstop (the lease structure must release every slot on its own), and a new request is answered.
While each case runs, a drain would wait for every stream the gateway has open (``DrainWatch``).

The fake engine (tests/fake_engine.py) is fine here: what is verified is the gateway's own bookkeeping. The same
storm runs against a real vLLM engine in tests/integration/test_disconnect.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.core import Gateway
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, FakeEngine
from tests.gateway.live import DrainWatch, LiveGateway, LiveWorkers, wait_until

CASES = 60  # per mode, each its own: the two modes together run 120 distinct storms
SEED = 20261204
ACTIONS = ("leave_at_once", "leave_soon", "leave_at_headers", "leave_mid_stream", "finish")


@dataclass
class Storm:
    live: LiveGateway | LiveWorkers
    app: object
    watch: DrainWatch
    stubs: list[FakeEngine]
    fleet: list[FakeReplica]

    @property
    def gateway(self) -> Gateway:
        return context_of(self.app).gateway

    def slots_back(self) -> bool:
        admission = self.gateway.admission
        return (self.gateway.router.in_flight() == 0 and admission.queue_length == 0
                and not admission.ledger.held)

    def describe(self) -> str:
        admission = self.gateway.admission
        return (f"in flight {dict(self.gateway.router.outstanding)}, queued {admission.queue_length}, "
                f"leases held {dict(admission.ledger.held)}, reclaimed by GC {dict(admission.ledger.reclaimed)}")


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "2-workers"])
def storm(request: pytest.FixtureRequest):
    """The gateway as one process, and as a decider with 2 worker processes (``gateway.workers``)."""
    stubs = [FakeEngine(model=CountingModel(prefix=""), tokens=3).start() for _ in range(2)]
    fleet = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    workers = request.param
    settings = Settings(served_model_name="demo", request_timeout_seconds=10, upstream_idle_timeout_seconds=3,
                        gateway={"workers": workers},
                        admission={"max_limit": 2, "initial_limit": 2, "max_queue": 64,
                                   "queue_timeout_seconds": 5},
                        routing={"metrics_poll_seconds": 0.2})
    app = create_app(settings, replicas=lambda: fleet,
                     registry=CollectorRegistry() if workers == 1 else MergedRegistry())
    watch = DrainWatch(app)
    with LiveGateway(watch) if workers == 1 else LiveWorkers(app, settings) as live:
        yield Storm(live, app, watch, stubs, fleet)
    for stub in stubs:
        stub.stop()


def request_bytes(stream: bool, *, close: bool) -> bytes:
    body = json.dumps({"prompt": "hi", "max_tokens": 5, "stream": stream}).encode()
    connection = "connection: close\r\n" if close else ""
    return (f"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n{connection}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def client(port: int, action: str, stream: bool, rng: random.Random) -> None:
    """One client that leaves at the moment ``action`` names; abruptly (RST) or politely (FIN), drawn."""
    await asyncio.sleep(rng.uniform(0, 0.05))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(stream, close=action == "finish"))
        await writer.drain()
        if action == "leave_soon":
            await asyncio.sleep(rng.uniform(0, 0.2))
        elif action in ("leave_at_headers", "leave_mid_stream"):
            await reader.readuntil(b"\r\n\r\n")
            if action == "leave_mid_stream":
                await reader.read(rng.randint(1, 300))
        elif action == "finish":
            await reader.read()  # to the end: the server closes (connection: close)
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()
        else:
            writer.close()


def configure(storm: Storm, rng: random.Random) -> str:
    """Draw the engines' behaviour for one case; returns it in words, for a failure message."""
    for stub in storm.stubs:
        stub.first_token_delay = stub.token_delay = rng.choice([0.0, 0.005, 0.02, 0.05])
        stub.tokens = rng.randint(1, 30)
        stub.stall_seconds = rng.choice([0.0, 0.0, 0.0, 0.3])
        stub.fail_status = None
    if rng.random() < 0.2:
        storm.stubs[1].fail_status = 503  # refuses: its requests retry on replica-0
    ejected = rng.random() < 0.15
    if ejected:
        storm.gateway.router.eject("replica-1", "storm")
    return (f"stubs {[(s.token_delay, s.tokens, s.stall_seconds, s.fail_status) for s in storm.stubs]}, "
            f"replica-1 ejected: {ejected}")


def recover(storm: Storm) -> None:
    """Between cases: engines healthy and in rotation again (only the slot state carries over)."""
    for stub in storm.stubs:
        stub.fail_status, stub.stall_seconds, stub.tokens = None, 0.0, 3
        stub.first_token_delay = stub.token_delay = 0.0
    for name in ("replica-0", "replica-1"):
        health = storm.gateway.router.health_of(name)
        health.ejected_until, health.consecutive_failures = None, 0


async def crowd(port: int, rng: random.Random) -> None:
    clients = [client(port, rng.choice(ACTIONS), rng.random() < 0.7, random.Random(rng.random()))
               for _ in range(rng.randint(1, 24))]
    await asyncio.wait_for(asyncio.gather(*clients), timeout=30)


def answered(storm: Storm) -> int:
    with (httpx.Client(base_url=storm.live.url, timeout=20) as http,
          http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as response):
        body = b"".join(response.iter_bytes())
    assert b"data: [DONE]" in body, body[-300:]
    return response.status_code


def test_generated_storms_of_leaving_clients_give_every_slot_back(storm: Storm) -> None:
    started = time.monotonic()
    first = SEED + (CASES if isinstance(storm.live, LiveWorkers) else 0)
    for seed in range(first, first + CASES):
        rng = random.Random(seed)
        drawn = configure(storm, rng)
        asyncio.run(crowd(storm.live.port, rng))
        recover(storm)
        assert wait_until(storm.slots_back, timeout=20), f"seed {seed} ({drawn}): {storm.describe()}"
        assert not storm.gateway.admission.ledger.reclaimed, f"seed {seed}: a lease needed the GC backstop"
        assert not storm.gateway.admission.audit.orphans_returned, f"seed {seed}: the audit returned orphans"
        assert not storm.watch.violations, f"seed {seed} ({drawn}): {storm.watch.violations[:5]}"
        assert answered(storm) == 200
    print(f"{CASES} storm cases in {time.monotonic() - started:.1f}s, {storm.watch.checks} drain checks")


def test_a_burst_of_streams_dropped_at_once_gives_every_slot_back(storm: Storm) -> None:
    """The issue's reproduction, on a stub: 64 streaming clients on a replica whose limit is 2, all dropped at once
    while some stream and the rest wait in the queue, three bursts in a row (before the fix: every slot leaked)."""
    for stub in storm.stubs:
        stub.tokens, stub.first_token_delay, stub.token_delay = 200, 0.02, 0.02

    async def burst(port: int, rng: random.Random) -> None:
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(64)]
        for _, writer in connections:
            writer.write(request_bytes(True, close=False))
        await asyncio.sleep(rng.uniform(0.2, 1.0))
        for _, writer in connections:
            writer.transport.abort()

    try:
        for round_ in range(3):
            asyncio.run(burst(storm.live.port, random.Random(round_)))
        assert wait_until(storm.slots_back, timeout=20), storm.describe()
        assert not storm.gateway.admission.ledger.reclaimed
    finally:
        recover(storm)
    assert answered(storm) == 200

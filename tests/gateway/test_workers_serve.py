"""The gateway as a decider and 2 worker processes (``gateway.workers: 2``), end to end on the fake engines: the
admission limit holds by the engines' own count, the workers' metrics and records are the decider's, a worker that
dies gives back its slots and is replaced, a reload reaches the workers, and a drain lets their streams end.

The storms of tests/gateway/test_slot_storm.py and test_migration_storm.py also run against this shape."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.core import Gateway
from appliance.gateway.workers.metrics import MergedRegistry, total
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, FakeEngine
from tests.gateway.live import LiveWorkers, wait_until

LIMIT = 2
ADMIN = {"Authorization": "Bearer admin-t0ken"}
KEY = {"Authorization": "Bearer k1"}


class Workers:
    def __init__(self, live: LiveWorkers, engines: list[FakeEngine], settings: Settings) -> None:
        self.live = live
        self.engines = engines
        self.settings = settings

    @property
    def gateway(self) -> Gateway:
        return context_of(self.live.app).gateway

    def idle(self) -> bool:
        admission = self.gateway.admission
        return self.gateway.router.in_flight() == 0 and admission.queue_length == 0 and not admission.ledger.held

    @property
    def pool(self):  # type: ignore[no-untyped-def]
        return self.live.server._workers


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    engines = [FakeEngine(model=CountingModel(prefix=""), tokens=20).start() for _ in range(2)]
    fleet = [FakeReplica(f"replica-{i}", engine.url) for i, engine in enumerate(engines)]
    settings = Settings(served_model_name="demo", request_timeout_seconds=20, api_keys=["k1"],
                        gateway={"workers": 2, "admin_token": "admin-t0ken", "drain_timeout_seconds": 20},
                        admission={"max_limit": LIMIT, "initial_limit": LIMIT, "max_queue": 256,
                                   "queue_timeout_seconds": 20},
                        routing={"metrics_poll_seconds": 0.2})
    app = create_app(settings, replicas=lambda: fleet, registry=MergedRegistry())
    with LiveWorkers(app, settings) as live:
        yield Workers(live, engines, settings)
    for engine in engines:
        engine.stop()


async def stream(url: str, prompt: str = "hi") -> bytes:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, http.stream(
            "POST", "/v1/completions", headers=KEY, json={"prompt": prompt, "stream": True}) as answer:
        return b"".join([chunk async for chunk in answer.aiter_bytes()])


def test_the_limit_of_each_replica_holds_by_the_engines_own_count(workers: Workers) -> None:
    """More clients than both replicas' limits, reading to the end through both workers: each engine never runs
    more than the limit at once (its own count), and each was filled to it."""
    for engine in workers.engines:
        engine.max_running, engine.first_token_delay, engine.token_delay = 0, 0.02, 0.005

    async def crowd() -> list[bytes]:
        return await asyncio.gather(*(stream(workers.live.url, f"prompt {i}") for i in range(40)))

    try:
        answers = asyncio.run(crowd())
    finally:
        for engine in workers.engines:
            engine.first_token_delay = engine.token_delay = 0.0
    assert all(b"data: [DONE]" in answer for answer in answers)
    assert [engine.max_running for engine in workers.engines] == [LIMIT, LIMIT]
    assert wait_until(workers.idle, timeout=10)
    served = {session.worker: session for session in workers.pool.decider.sessions}
    assert sorted(served) == [1, 2]


def test_the_workers_metrics_and_records_are_the_deciders(workers: Workers) -> None:
    before = _requests_total(workers)
    asyncio.run(stream(workers.live.url))
    assert wait_until(lambda: _requests_total(workers) >= before + 1, timeout=5)  # a worker's, summed in
    with httpx.Client(base_url=workers.live.url, timeout=10) as http:
        records = http.get("/admin/requests", params={"limit": 1}, headers=ADMIN)
        assert records.status_code == 200, records.text
        assert records.json()["requests"][0]["replica"] in ("replica-0", "replica-1")
        assert http.get("/health/ready").status_code == 200
        metrics = http.get("/metrics", headers=ADMIN).text
    assert "appliance_event_loop_lag_seconds_count" in metrics and "appliance_replica_outstanding_requests" in metrics


def _requests_total(workers: Workers) -> float:
    return total(context_of(workers.live.app).registry, "appliance_requests_total")


def test_a_reload_reaches_the_workers(workers: Workers) -> None:
    new = workers.settings.replaced({"gateway.api_keys": ["k1", "k2"]})
    context_of(workers.live.app).live.replace(new)
    with httpx.Client(base_url=workers.live.url, timeout=10) as http:
        def both_accept() -> bool:
            codes = {http.post("/v1/completions", headers={"Authorization": "Bearer k2"},
                               json={"prompt": "hi", "max_tokens": 2}).status_code for _ in range(8)}
            return codes == {200}
        assert wait_until(both_accept, timeout=10)


def test_a_worker_that_dies_gives_back_its_slots_and_is_replaced(workers: Workers) -> None:
    for engine in workers.engines:
        engine.first_token_delay, engine.token_delay, engine.tokens = 0.0, 0.05, 200

    async def hold(count: int) -> None:
        tasks = [asyncio.ensure_future(stream(workers.live.url)) for _ in range(count)]
        await asyncio.sleep(1.0)
        victim = workers.pool.processes[1]
        assert workers.gateway.router.in_flight() > 0
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(hold(8))
        assert wait_until(workers.idle, timeout=20), dict(workers.gateway.router.outstanding)
        assert wait_until(lambda: len(workers.pool.decider.sessions) == 2 and workers.pool.restarts >= 1,
                          timeout=30)
    finally:
        for engine in workers.engines:
            engine.token_delay, engine.tokens = 0.0, 20
    assert b"data: [DONE]" in asyncio.run(stream(workers.live.url))


def test_a_drain_lets_the_workers_streams_end_and_refuses_new_requests(workers: Workers) -> None:
    """Last in this module: the drain stops the gateway."""
    for engine in workers.engines:
        engine.token_delay, engine.tokens = 0.02, 60

    async def drain() -> tuple[list[bytes], int]:
        tasks = [asyncio.ensure_future(stream(workers.live.url)) for _ in range(6)]
        await asyncio.sleep(0.5)
        workers.live.server.handle_exit(signal.SIGTERM, None)
        decider = workers.pool.decider
        while decider.draining_since is None or any(session.reported_at < decider.draining_since
                                                    for session in decider.sessions):
            await asyncio.sleep(0.02)  # every worker heard of the drain (and said what it has open)
        async with httpx.AsyncClient(base_url=workers.live.url, timeout=10) as http:
            refused = await http.post("/v1/completions", headers=KEY, json={"prompt": "hi"})
        return await asyncio.gather(*tasks), refused.status_code

    answers, refused = asyncio.run(drain())
    assert refused == 503
    assert all(answer.rstrip().endswith(b"data: [DONE]") for answer in answers), [a[-80:] for a in answers]
    deadline = time.monotonic() + 30
    while workers.pool.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers.pool.alive()


def test_a_worker_serves_its_inherited_port_as_the_tcp_socket_it_is() -> None:
    """The event loop sets TCP_NODELAY on the connections of a TCP server only: served as a Unix socket (what
    uvicorn's fd option assumes), the clients' small writes waited on Nagle's algorithm (~40 ms per first token)."""
    from appliance.gateway.workers.pool import listening_socket
    from appliance.serve_worker import inherited_listener

    listener = listening_socket("127.0.0.1", 0)
    try:
        duplicate = os.dup(listener.fileno())
        served = inherited_listener(duplicate)
        try:
            assert served.family == socket.AF_INET and served.type == socket.SOCK_STREAM
        finally:
            served.close()
    finally:
        listener.close()

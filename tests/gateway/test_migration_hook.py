"""Migration as a hook, without a transport: the ledger fed whole events however the reads cut them, the break
resolved by a continuation placed through a fake placement, and what cannot be continued ended with a reason."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
from prometheus_client import CollectorRegistry

from appliance.gateway.migration import ledger as ledger_module
from appliance.gateway.migration.hook import MigratingRequest, Migration
from appliance.gateway.observation.metrics import RequestMetrics
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Block, Break, End, Resolution
from appliance.gateway.upstream.sse import SSEEvents
from tests.gateway.upstream.support import DONE, begin, chain, chunk, exchange


class FakePlacement:
    """Records what the hook asked to place; every continuation lands on replica-1."""

    max_attempts = 2

    def __init__(self) -> None:
        self.posted: list[tuple[str, dict]] = []

    async def admit_patiently(self, ex: Exchange, kind: str):
        begin(ex, "replica-1", kind)
        return ex.lease

    async def post(self, ex: Exchange, path: str, body: bytes):
        self.posted.append((path, json.loads(body)))

        class Answer:
            status = 200

        return Answer()


def hook(limit: int = 1) -> tuple[Migration, FakePlacement, CollectorRegistry]:
    registry = CollectorRegistry()
    migration = Migration(RequestMetrics(registry, slo_ttft_seconds=1.0), limit=limit, max_model_len=None)
    migration.placement = placement = FakePlacement()
    return migration, placement, registry


def stream_events(n: int) -> list[bytes]:
    first = chunk("t0", [100], prompt_token_ids=None)
    events = [first] + [chunk(f"t{i}", [100 + i]) for i in range(1, n)]
    return [e.replace(b',"prompt_token_ids":null', b"") for e in events]


def relay(req: MigratingRequest, stream: bytes, cuts: list[int]) -> bytes:
    framer, out, start = SSEEvents(), b"", 0
    for end in [*cuts, len(stream)]:
        raw = framer.feed_block(stream[start:end])
        start = end
        if raw:
            block = Block(raw, raw, time.monotonic(), raw.count(b"data: "))
            req.relayed(block)
            out += block.out
    return out


def test_token_ids_the_client_did_not_ask_for_are_stripped_however_the_reads_cut_the_stream() -> None:
    events = stream_events(6) + [chunk("", [], finish="length"), DONE]
    stream = b"".join(events)
    expected = b"".join(e.replace(b'"token_ids":[' + e.split(b'"token_ids":[')[1].split(b"]")[0] + b"]",
                                  b'"token_ids":null') if b'"token_ids":[' in e else e for e in events)
    rng = random.Random(7)
    for _ in range(200):
        migration, _, _ = hook()
        ex = exchange({"prompt": [1, 2, 3], "stream": True, "max_tokens": 7})
        req = migration.start(ex)
        assert isinstance(req, MigratingRequest) and req.ledger is not None
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 8)))
        assert relay(req, stream, cuts) == expected, cuts
        assert req.ledger.sent_ids == [100, 101, 102, 103, 104, 105] and req.ledger.done


def broken_after(migration: Migration, sent: int, replica: str) -> tuple[Exchange, MigratingRequest, Resolution | None]:
    """A migratable stream relayed from ``replica`` for ``sent`` tokens, whose connection then dropped: the
    exchange, the hook, and the hook's answer to the break."""
    ex = exchange({"prompt": [1, 2, 3], "stream": True, "max_tokens": 10})
    req = migration.start(ex)
    assert req is not None
    chain(ex, req)
    begin(ex, replica)
    relay(req, b"".join(stream_events(sent)), [])
    brk = Break(aiohttp.ServerDisconnectedError(), replica, "connection", time.monotonic())
    return ex, req, asyncio.run(req.broke(brk))


def test_a_break_is_continued_from_the_exact_tokens_sent() -> None:
    migration, placement, registry = hook()
    ex, req, resolution = broken_after(migration, 4, "replica-0")
    assert resolution is not None and resolution.resumed
    path, body = placement.posted[0]
    assert path == "/v1/completions" and body["prompt"] == [1, 2, 3, 100, 101, 102, 103] and body["max_tokens"] == 6
    assert ex.tried == {"replica-0"} and ex.migrations == 1 and ex.attempt.replica == "replica-1"
    assert ex.attempts[0].reason == "migrated: connection" and ex.attempts[0].sent_tokens == 4
    continued = Block(chunk("t4", [104]), chunk("t4", [104]), time.monotonic(), 1)
    req.relayed(continued)  # the continuation's first event
    assert registry.get_sample_value("appliance_stream_migrations_total",
                                     {"reason": "connection", "outcome": "continued"}) == 1


def test_a_request_that_cannot_be_continued_ends_with_why() -> None:
    migration, placement, registry = hook()
    ex = exchange({"prompt": "hi", "stream": True, "n": 2})
    req = migration.start(ex)
    assert req is not None and req.ledger is None and not req.frames
    resolution = asyncio.run(req.broke(Break(aiohttp.ServerDisconnectedError(), "replica-0", "connection",
                                             time.monotonic())))
    assert resolution is not None and not resolution.resumed and resolution.outcome is Outcome.FAILURE
    assert b"not continued elsewhere: several choices" in resolution.out and placement.posted == []
    assert registry.get_sample_value("appliance_stream_migrations_total",
                                     {"reason": "connection", "outcome": ledger_module.INELIGIBLE}) == 1


def test_migration_off_touches_no_request() -> None:
    migration, _, _ = hook(limit=0)
    ex = exchange({"prompt": "hi", "stream": True})
    body = ex.body
    assert migration.start(ex) is None and ex.body == body and ex.migration_limit == 0


def test_a_rerun_of_a_non_streaming_answer_is_counted_by_what_came_of_it() -> None:
    migration, _, registry = hook()
    ex = exchange({"prompt": "hi"})
    req = migration.start(ex)
    assert req is not None
    chain(ex, req)
    begin(ex)
    ex.end_attempt(Outcome.FAILURE, "rerun: connection")
    begin(ex, "replica-1", "rerun")
    ex.hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    assert registry.get_sample_value("appliance_stream_migrations_total",
                                     {"reason": "connection", "outcome": "continued"}) == 1


def test_a_continuation_that_cannot_connect_says_so_without_the_engines_address() -> None:
    class Unreachable(FakePlacement):
        async def post(self, ex: Exchange, path: str, body: bytes):
            raise aiohttp.ClientOSError(111, "Cannot connect to host 10.42.0.17:8100")

    migration, _, _ = hook()
    migration.placement = Unreachable()
    _, _, resolution = broken_after(migration, 2, "10.42.0.16:8100")
    assert resolution is not None and not resolution.resumed and resolution.status == 502
    assert b"no replica could continue it (ClientOSError)" in resolution.out
    assert b"10.42.0." not in resolution.out

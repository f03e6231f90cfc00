"""Stream migration, the gateway's own logic, against fake engines that speak vLLM's streaming protocol with token
ids (tests/fake_engine.py, its greedy model): a stream broken at any token is continued on the other replica and the
client sees one whole stream, identical to an undisturbed one; what cannot be continued ends with an error event
that says why; slots come back; metrics and spans say what happened. Against a real uvicorn, so streams are real.

Real engines: tests/integration/test_migration.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.migration import ledger as migration
from appliance.gateway.upstream.sse import SSEEvents
from appliance.serve import in_flight
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import Failure, FakeEngine, detok, greedy, render_chat, tokenize
from tests.gateway.live import LiveGateway, wait_until

PROMPT = "The import system"
MESSAGES = [{"role": "user", "content": "Tell me about modules"}]


@pytest.fixture
def failures() -> list[Failure]:
    return []  # shared by both engines: the n-th stream, wherever it runs, takes the n-th failure


@pytest.fixture
def engines(failures):
    fleet = [FakeEngine(failures=failures).start() for _ in range(2)]
    yield fleet
    for engine in fleet:
        engine.stop()


class Gateway:
    def __init__(self, engines: list[FakeEngine], exporter: InMemorySpanExporter | None = None, **overrides):
        self.registry = CollectorRegistry()
        self.fleet = [FakeReplica(f"replica-{i}", e.url) for i, e in enumerate(engines)]
        settings = Settings(served_model_name="demo", upstream_idle_timeout_seconds=1.0,
                            routing={"migration_limit": 1, **overrides.pop("routing", {})}, **overrides)
        self.app = create_app(settings, replicas=lambda: self.fleet, registry=self.registry, span_exporter=exporter)
        self.live = LiveGateway(self.app)

    def __enter__(self) -> Gateway:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def stream(self, route: str, body: dict) -> list[dict | str]:
        path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
        with httpx.Client(base_url=self.live.url, timeout=30) as http, \
                http.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return [e if e == "[DONE]" else json.loads(e) for e in events]

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.live.url + path, json=body, timeout=30)

    def migrations(self, reason: str, outcome: str) -> float:
        return self.registry.get_sample_value("appliance_stream_migrations_total",
                                              {"reason": reason, "outcome": outcome}) or 0.0

    def replayed(self) -> float:
        return self.registry.get_sample_value("appliance_stream_migration_replayed_tokens_total") or 0.0

    def slots_back(self) -> bool:
        gateway = context_of(self.app).gateway
        return gateway.router.in_flight() == 0 and not gateway.admission.ledger.held


def text_of(events: list, route: str) -> str:
    parts = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                parts.append(choice.get("text") if route == "completions" else
                             (choice.get("delta") or {}).get("content") or "")
    return "".join(p or "" for p in parts)


def finishes(events: list) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices") or []
            if c.get("finish_reason") is not None]


def expected_text(route: str, max_tokens: int) -> str:
    prompt = tokenize(PROMPT) if route == "completions" else render_chat(MESSAGES)
    return "".join(detok(t) for t in greedy(prompt, max_tokens))


def body_for(route: str, max_tokens: int, **extra) -> dict:
    base = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    return {**base, "max_tokens": max_tokens, "stream_options": {"include_usage": True}, **extra}


def assert_whole(events: list, route: str, max_tokens: int) -> None:
    """One well-formed stream: one id, one finish_reason (length), the undisturbed text, whole usage, [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1, {c["id"] for c in chunks}
    assert len({c["created"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"text_completion" if route == "completions" else
                                             "chat.completion.chunk"}
    assert finishes(events) == ["length"]
    assert text_of(events, route) == expected_text(route, max_tokens)
    prompt = len(tokenize(PROMPT) if route == "completions" else render_chat(MESSAGES))
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": max_tokens,
                                   "total_tokens": prompt + max_tokens}
    # no ids the client did not ask for: null, as vLLM writes the fields when nobody asked
    assert not any(c.get("token_ids") or c.get("prompt_token_ids") for e in chunks for c in [e, *e["choices"]])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_broken_mid_way_is_continued_token_exact_on_the_other_replica(engines, failures, route):
    failures.append(Failure(after=7, how="reset"))
    with Gateway(engines) as gw:
        events = gw.stream(route, body_for(route, 20))
        assert_whole(events, route, 20)
        assert gw.migrations("connection", "continued") == 1
        prompt = len(tokenize(PROMPT) if route == "completions" else render_chat(MESSAGES))
        assert gw.replayed() == prompt + 7
        assert wait_until(gw.slots_back)
    continuation = [r.body for e in engines for r in e.received if isinstance(r.body.get("prompt"), list)]
    assert len(continuation) == 1
    body = continuation[0]
    assert body["max_tokens"] == 13 and body["stream"] is True and body["return_token_ids"] is True
    first = tokenize(PROMPT) if route == "completions" else render_chat(MESSAGES)
    assert body["prompt"] == first + greedy(first, 7)


@pytest.mark.parametrize("how,reason", [("eof", "connection"), ("error", "engine_error"),
                                        ("stall", "idle_timeout"), ("abort", "engine_error")])
def test_every_kind_of_break_is_continued(engines, failures, how, reason):
    failures.append(Failure(after=3, how=how))
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 10))
        assert_whole(events, "completions", 10)
        assert gw.migrations(reason, "continued") == 1
        assert wait_until(gw.slots_back)


def test_generated_break_points_always_give_the_undisturbed_stream(engines, failures):
    """The invariant over break points (0 = right after the headers, before any token) and routes, drawn."""
    rng = random.Random(20261204)
    with Gateway(engines) as gw:
        for case in range(16):
            route = rng.choice(["completions", "chat"])
            max_tokens = rng.randint(1, 24)
            how = rng.choice(["reset", "eof", "error", "abort"])
            failures.append(Failure(after=rng.randint(1 if how == "abort" else 0, max_tokens), how=how))
            events = gw.stream(route, body_for(route, max_tokens))
            assert_whole(events, route, max_tokens), f"case {case}"
            assert wait_until(gw.slots_back), f"case {case}"
            failures.clear()
            for replica in gw.fleet:  # failures pile up on one fake replica and eject it: not what is tested
                health = context_of(gw.app).gateway.router.health_of(replica.name)
                health.ejected_until, health.consecutive_failures = None, 0
        assert not context_of(gw.app).gateway.admission.ledger.reclaimed


def test_the_client_that_asked_for_token_ids_gets_them_consistent_across_the_break(engines, failures):
    failures.append(Failure(after=5))
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 12, return_token_ids=True))
    chunks = [e for e in events if isinstance(e, dict)]
    ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert ids == greedy(tokenize(PROMPT), 12)
    assert [choice.get("prompt_token_ids") for c in chunks for choice in c["choices"]
            if choice.get("prompt_token_ids")] == [tokenize(PROMPT)]  # once, the original prompt's


def test_a_stream_whose_finish_was_sent_is_closed_without_a_continuation(engines, failures):
    failures.append(Failure(after=6, how="reset"))  # breaks after the last token, before usage and [DONE]
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 6))
        assert_whole(events, "completions", 6)
    assert sum(len(e.received) for e in engines) == 1


@pytest.mark.parametrize("extra,why", [({"seed": 7, "temperature": 0.8}, "seed"), ({"n": 2}, "several choices"),
                                       ({"stop": ["w1"]}, "stop strings"), ({"logprobs": 2}, "logprobs"),
                                       ({"presence_penalty": 0.5}, "presence")])
def test_what_cannot_be_continued_faithfully_ends_with_an_error_event_saying_why(engines, failures, extra, why):
    failures.append(Failure(after=4))
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 10, **extra))
        error = events[-1]["error"]
        assert why in error["message"] and error["code"] == "upstream_error"
        assert gw.migrations("connection", "ineligible") == 1
        assert wait_until(gw.slots_back)
    sent = [r.body for e in engines for r in e.received]
    assert len(sent) == 1 and "return_token_ids" not in sent[0]  # the client's bytes, untouched


def test_greedy_with_a_seed_is_continued(engines, failures):
    failures.append(Failure(after=4))
    with Gateway(engines) as gw:
        assert_whole(gw.stream("completions", body_for("completions", 9, seed=3, temperature=0)), "completions", 9)


def test_the_budget_bounds_migrations(engines, failures):
    failures.extend([Failure(after=3), Failure(after=2)])  # the continuation breaks too
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 12))
        assert "migration_limit (1) reached" in events[-1]["error"]["message"]
        assert text_of(events, "completions") == expected_text("completions", 12)[:len(text_of(events,
                                                                                             "completions"))]
        assert gw.migrations("connection", "continued") == 1
        assert gw.migrations("connection", "exhausted") == 1
        assert wait_until(gw.slots_back)


def test_a_budget_of_two_survives_two_breaks_on_two_replicas(engines, failures):
    """The second continuation may go back to the first replica only if it did not fail this request: with two
    replicas that both failed it, the stream ends with an error event (no replica left), slots back."""
    failures.extend([Failure(after=3), Failure(after=2)])
    with Gateway(engines, routing={"migration_limit": 2}, admission={"queue_timeout_seconds": 1}) as gw:
        events = gw.stream("completions", body_for("completions", 12))
        assert "no replica could continue it" in events[-1]["error"]["message"]
        assert gw.migrations("connection", "failed") == 1
        assert wait_until(gw.slots_back)


def test_a_continuation_waits_for_a_replica_rather_than_fail_at_once(engines, failures):
    """Seen on real engines: the other replica was ejected (a TTFT outlier) when the engine died, and the dead one
    still counted as healthy, so the router found no replica for the continuation (no panic either). A stream
    half-sent waits for one, as a queued request would."""
    failures.append(Failure(after=4))
    with Gateway(engines, routing={"eject_base_seconds": 0.5}) as gw:
        context_of(gw.app).gateway.router.eject("replica-1", "a TTFT outlier")
        assert_whole(gw.stream("completions", body_for("completions", 10)), "completions", 10)
        assert gw.migrations("connection", "continued") == 1
    assert [len(e.received) for e in engines] == [1, 1]


def test_a_continuation_waiting_for_a_replica_is_still_owed_to_the_drain(engines, failures):
    """Between the broken replica's slot and the next one, a continuation holds no slot and is in no queue, yet
    its client's stream is open: a SIGTERM then must not count 0 requests in flight and stop the gateway under it
    (the drain counts what ``appliance.serve.in_flight`` says)."""
    failures.append(Failure(after=4))
    with Gateway(engines, routing={"eject_base_seconds": 1.5}) as gw:
        context_of(gw.app).gateway.router.eject("replica-1", "a TTFT outlier")
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(gw.stream, "completions", body_for("completions", 10))
            assert wait_until(lambda: engines[0].received, timeout=10)
            samples, gauge = [], []
            while not engines[1].received and not streamed.done():  # the stream is open, its continuation waits
                samples.append(in_flight(gw.app))
                gauge.append(gw.registry.get_sample_value("appliance_open_requests"))
                time.sleep(0.01)
            assert_whole(streamed.result(), "completions", 10)
        assert gw.migrations("connection", "continued") == 1
        assert len(samples) > 10 and min(samples) == 1, samples
        assert min(gauge) == 1, gauge  # the SRE's view of the same count
        assert wait_until(lambda: in_flight(gw.app) == 0)


def test_a_continuation_still_waiting_at_the_drain_timeout_ends_with_an_error_event(engines, failures):
    """The drain waits for it (above); when the drain times out, the streams still open are cut with an error
    event, and one whose continuation waits for a replica is cut too, not left to a silent close by the server."""
    failures.append(Failure(after=4))
    with Gateway(engines, routing={"eject_base_seconds": 60}) as gw:
        gateway = context_of(gw.app).gateway
        gateway.router.eject("replica-1", "a TTFT outlier")
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(gw.stream, "completions", body_for("completions", 10))
            # open, holding no slot: the continuation waits for a replica
            assert wait_until(lambda: engines[0].received and in_flight(gw.app) == 1
                              and gateway.router.in_flight() == 0, timeout=10)
            loop = gw.live.server.servers[0].get_loop()
            cut = asyncio.run_coroutine_threadsafe(gateway.upstream.cut_streams(), loop).result(10)
            events = streamed.result(10)
        assert cut == 1
        assert events[-1]["error"]["code"] == "shutting_down", events[-1]  # as every stream cut at the timeout
        assert text_of(events, "completions") == expected_text("completions", 4)  # what was sent stays exact
        assert wait_until(lambda: in_flight(gw.app) == 0)


def test_a_continuation_whose_connection_fails_before_the_engine_is_tried_again(engines, failures):
    """Seen on a real restart: the continuation's pooled connection had just been closed by the engine."""
    failures.extend([Failure(after=4), Failure(after=0, how="refuse")])
    with Gateway(engines) as gw:
        assert_whole(gw.stream("completions", body_for("completions", 10)), "completions", 10)
        assert gw.migrations("connection", "continued") == 1
        assert wait_until(gw.slots_back)


def test_migration_off_keeps_the_error_event_and_the_clients_bytes(engines, failures):
    failures.append(Failure(after=4))
    with Gateway(engines, routing={"migration_limit": 0}) as gw:
        events = gw.stream("completions", body_for("completions", 10))
        assert "error" in events[-1]
        assert gw.migrations("connection", "continued") == 0
    sent = [r.body for e in engines for r in e.received]
    assert len(sent) == 1 and "return_token_ids" not in sent[0]


def test_a_drained_replica_breaking_counts_as_drain(engines, failures):
    failures.append(Failure(after=4))
    with Gateway(engines) as gw:
        for replica in gw.fleet:
            replica.status.planned_restart = True  # a maintenance restart whose drain timed out
        assert_whole(gw.stream("completions", body_for("completions", 10)), "completions", 10)
        assert gw.migrations("drain", "continued") == 1


def test_a_non_streaming_answer_that_broke_mid_body_is_run_again_elsewhere(engines, failures):
    failures.append(Failure(after=0))
    with Gateway(engines) as gw:
        response = gw.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected_text("completions", 8)
        assert gw.migrations("connection", "continued") == 1
        assert wait_until(gw.slots_back)


def test_the_continuation_has_its_span(engines, failures):
    failures.append(Failure(after=5))
    exporter = InMemorySpanExporter()
    with Gateway(engines, exporter=exporter, trace_sample_ratio=1.0) as gw:
        assert_whole(gw.stream("completions", body_for("completions", 10)), "completions", 10)
        assert wait_until(gw.slots_back)
        context_of(gw.app).gateway.tracer_provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    span = spans["gateway.continuation"]
    assert span.attributes["appliance.migration.reason"] == "connection"
    assert span.attributes["appliance.migration.sent_tokens"] == 5
    assert span.attributes["appliance.migration.to"] != span.attributes["appliance.migration.from"]
    assert span.attributes["appliance.migration.added_seconds"] >= 0


def test_refusal_names_what_cannot_be_continued() -> None:
    assert migration.refusal("completions", {"prompt": "x"}) is None
    assert migration.refusal("completions", {"prompt": "x", "temperature": 0.7}) is None  # sampling, no seed
    assert migration.refusal("chat", {"messages": [], "tools": [{}], "tool_choice": "none"}) is None
    assert migration.refusal("chat", {"messages": [], "tools": [{}]}) == "tools"
    assert migration.refusal("chat", {"messages": [], "response_format": {"type": "json_object"}})
    assert migration.refusal("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert migration.refusal("completions", {"prompt": ["a", "b"]}) == "several prompts"
    assert migration.refusal("completions", {"prompt": "x", "echo": True}) == "echo"


def test_events_are_split_whole_whatever_the_chunking() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for size in (1, 2, 5, 13, len(stream)):
        events = SSEEvents()
        got = [e for i in range(0, len(stream), size) for e in events.feed(stream[i:i + size])]
        assert got == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


def test_with_token_ids_keeps_the_clients_bytes_and_adds_the_field() -> None:
    assert json.loads(migration.with_token_ids(b'{"prompt": "x"}')) == {"prompt": "x", "return_token_ids": True}
    assert json.loads(migration.with_token_ids(b'{"prompt": "x", "return_token_ids": false}\n'))[
        "return_token_ids"] is True
    assert json.loads(migration.with_token_ids(b"{}")) == {"return_token_ids": True}


def test_the_metrics_labels_are_the_migration_modules_and_exist_from_the_start() -> None:
    from appliance.gateway.observation.metrics import MIGRATION_OUTCOMES, MIGRATION_REASONS, RequestMetrics

    assert (MIGRATION_REASONS, MIGRATION_OUTCOMES) == (migration.REASONS, migration.OUTCOMES)
    registry = CollectorRegistry()
    RequestMetrics(registry, slo_ttft_seconds=0.8)
    for reason in migration.REASONS:
        for outcome in migration.OUTCOMES:
            assert registry.get_sample_value("appliance_stream_migrations_total",
                                             {"reason": reason, "outcome": outcome}) == 0
    assert registry.get_sample_value("appliance_stream_migration_added_seconds_count", {"route": "chat"}) == 0


@pytest.mark.parametrize("breaks", [0, 1])
def test_the_token_counters_take_the_whole_streams_usage(engines, failures, breaks):
    """The relay yields whole events one at a time, so the usage event and [DONE] are two: the token counters must
    still read the usage (they read nothing before, on real vLLM: test_metrics' appliance_tokens_total)."""
    failures.extend(Failure(after=5, how="reset") for _ in range(breaks))
    with Gateway(engines) as gw:
        events = gw.stream("completions", body_for("completions", 12))
        assert_whole(events, "completions", 12)
        usage = [e for e in events if isinstance(e, dict)][-1]["usage"]
        assert wait_until(gw.slots_back)
        count = gw.registry.get_sample_value
        assert count("appliance_tokens_total", {"kind": "completion"}) == usage["completion_tokens"] == 12
        assert count("appliance_tokens_total", {"kind": "prompt"}) == usage["prompt_tokens"]

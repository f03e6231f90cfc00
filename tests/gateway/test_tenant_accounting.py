"""Per-tenant accounting, the gateway's own logic, against the fake engine (tests/fake_engine.py), which answers the
way vLLM 0.32 does where it matters here (compact JSON events, a final usage event only when asked for,
``system_fingerprint`` on the finishing chunk without it and on the usage event with it; here events split across
reads). Real engines: tests/integration/test_tenants.py.

- A stream is sent to the engine asking for its final and its running usage; the client's bytes are exactly those
  the engine sends a client that asked for what it asked (on the plain relay and on the migratable one).
- A client that asked keeps its usage, and a request that asked for all of it goes out as it sent it.
- Each tenant's counters are what the engines reported, continued streams included (the broken leg's running
  usage, the continuation's report).
"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.usage import HiddenUsage, Usage, final_usage, strip_running_usage, usage_options
from appliance.gateway.upstream.sse import DONE, SSEEvents
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, Failure, FakeEngine, tokenize
from tests.gateway.live import LiveGateway

FINGERPRINT = "fp_0123abcd"
TENANTS = [{"name": "team-a", "api_keys": ["key-a"]}, {"name": "team-b", "api_keys": ["key-b"], "weight": 2}]
A = {"authorization": "Bearer key-a", "content-type": "application/json"}
B = {"authorization": "Bearer key-b", "content-type": "application/json"}


@pytest.fixture
def engine():
    """Deterministic answers in vLLM's shape (the same id and created every time, so two answers to one request are
    byte-identical), ``cached`` prompt tokens reported in ``prompt_tokens_details``, every event in two writes (the
    gateway must put them back together)."""
    fake = FakeEngine(model=CountingModel(), system_fingerprint=FINGERPRINT, cached_tokens=3, response_id="cmpl-fixed",
                      created=1, writes="split").start()
    yield fake
    fake.stop()


def gateway(engine, migration_limit: int = 1) -> TestClient:
    replicas = [FakeReplica("replica-0", engine.url)]
    settings = Settings(served_model_name="demo", tenants=TENANTS, routing={"migration_limit": migration_limit},
                        collectors={"enabled": False})
    client = TestClient(create_app(settings, replicas=lambda: replicas, registry=CollectorRegistry()),
                        raise_server_exceptions=False)
    return client


def tokens(client: TestClient, tenant: str, kind: str) -> float:
    return context_of(client.app).registry.get_sample_value("appliance_tenant_tokens_total",
                                                            {"tenant": tenant, "kind": kind})


def direct(engine: FakeEngine, path: str, body: dict) -> bytes:
    import httpx

    return httpx.post(engine.url + path, content=json.dumps(body), timeout=10).content


BODIES = {
    "completions": ("/v1/completions", {"model": "demo", "prompt": "hello there", "max_tokens": 4, "stream": True}),
    "chat": ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi you"}],
                                      "max_tokens": 3, "stream": True}),
}


@pytest.mark.parametrize("migration_limit", [0, 1], ids=["plain-relay", "migratable"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_is_asked_for_and_hidden_client_bytes_as_without(engine, route, migration_limit):
    path, body = BODIES[route]
    with gateway(engine, migration_limit) as client:
        answer = client.post(path, content=json.dumps(body), headers=A)
        assert answer.status_code == 200
        sent = engine.received[-1].body
        assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        expected = direct(engine, path, body)  # what the engine sends a client that did not ask for usage
        assert b'"usage"' not in expected and FINGERPRINT.encode() in expected
        assert answer.content == expected
        usage = engine.usage(body)
        assert tokens(client, "team-a", "prompt") == usage["prompt_tokens"]
        assert tokens(client, "team-a", "completion") == usage["completion_tokens"]
        assert tokens(client, "team-a", "cached_prompt") == 3
        assert tokens(client, "team-b", "prompt") == 0  # every tenant's series from the start


@pytest.mark.parametrize("running", [False, True], ids=["final", "final-and-running"])
@pytest.mark.parametrize("migration_limit", [0, 1], ids=["plain-relay", "migratable"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_client_that_asked_for_usage_keeps_it(engine, route, migration_limit, running):
    path, body = BODIES[route]
    body = {**body, "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if running else {})}}
    with gateway(engine, migration_limit) as client:
        answer = client.post(path, content=json.dumps(body), headers=B)
        assert answer.status_code == 200
        if migration_limit == 0 and running:  # the client's bytes, untouched but for its tenant's cache salt
            raw = engine.received[-1].raw
            assert raw.startswith(json.dumps(body).encode()[:-1]) and raw.endswith(b'"}')
            assert {k: v for k, v in json.loads(raw).items() if k != "cache_salt"} == body
        elif migration_limit == 0:
            assert engine.received[-1].body["stream_options"]["continuous_usage_stats"] is True
        assert answer.content == direct(engine, path, body)
        assert (b'"usage":{"prompt_tokens"' in answer.content.split(b"\n\n")[1]) is running
        usage = engine.usage(body)
        assert tokens(client, "team-b", "prompt") == usage["prompt_tokens"]
        assert tokens(client, "team-b", "completion") == usage["completion_tokens"]


def test_counters_are_the_sum_of_what_the_engine_reported_per_tenant(engine):
    with gateway(engine) as client:
        expected = {"team-a": Usage(), "team-b": Usage()}
        for i in range(12):
            tenant, auth = ("team-a", A) if i % 3 else ("team-b", B)
            path, body = BODIES["chat" if i % 2 else "completions"]
            body = {**body, "max_tokens": 1 + i, "stream": i % 4 != 0}
            assert client.post(path, json=body, headers=auth).status_code == 200
            expected[tenant] = expected[tenant] + Usage.of(engine.usage(body))
        for tenant, usage in expected.items():
            assert tokens(client, tenant, "prompt") == usage.prompt
            assert tokens(client, tenant, "completion") == usage.completion
            assert tokens(client, tenant, "cached_prompt") == usage.cached_prompt
        registry = context_of(client.app).registry
        assert registry.get_sample_value("appliance_tenant_requests_total", {"tenant": "team-a", "code": "200"}) == 8
        assert registry.get_sample_value("appliance_tenant_ttft_seconds_count", {"tenant": "team-a"}) == 6
        assert registry.get_sample_value("appliance_tenant_queue_wait_seconds_count", {"tenant": "team-b"}) == 4
        # a request refused before the proxy (validation) is the tenant's answer too
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, headers=B).status_code == 400
        assert registry.get_sample_value("appliance_tenant_requests_total", {"tenant": "team-b", "code": "400"}) == 1
        assert registry.get_sample_value("appliance_requests_total", {"route": "completions", "code": "400"}) == 1
        summary = context_of(client.app).gateway.accounting.summary()
        assert [row["tenant"] for row in summary] == sorted(
            expected, key=lambda name: -expected[name].total)
        top = summary[0]
        assert top["prompt_tokens"] == expected[top["tenant"]].prompt
        assert set(top) == {"tenant", "requests", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
                            "estimated_tokens", "rate_limited"}


def test_a_continued_stream_counts_what_each_engine_reported():
    """The first leg broke before its final usage: its running usage counts (its prompt, the 3 tokens it made).
    The continuation's engine reports its own prompt (the original prompt plus the tokens already sent, prefilled
    again) and the rest of the answer: counted too. Together, what both engines counted."""
    failures = [Failure(after=3)]
    engines = [FakeEngine(failures=failures).start() for _ in range(2)]
    try:
        replicas = [FakeReplica(f"replica-{i}", e.url) for i, e in enumerate(engines)]
        settings = Settings(served_model_name="demo", tenants=TENANTS, routing={"migration_limit": 1},
                            collectors={"enabled": False})
        registry = CollectorRegistry()
        with LiveGateway(create_app(settings, replicas=lambda: replicas, registry=registry)) as live:
            import httpx

            body = {"prompt": "The import system", "max_tokens": 8, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=A, timeout=30) as response:
                payload = response.read()
            assert b'"usage"' not in payload and payload.endswith(b"data: [DONE]\n\n")
            legs = [r.body for e in engines for r in e.received if r.path == "/v1/completions"]
            assert len(legs) == 2
            continuation = next(b for b in legs if isinstance(b["prompt"], list))
            assert continuation["stream_options"]["include_usage"] is True
            prompts = len(tokenize("The import system")) + len(continuation["prompt"])
            assert registry.get_sample_value("appliance_tenant_tokens_total",
                                             {"tenant": "team-a", "kind": "prompt"}) == prompts
            assert registry.get_sample_value("appliance_tenant_tokens_total",
                                             {"tenant": "team-a", "kind": "completion"}) == 8
            assert sum(e.prompt_tokens_total for e in engines) == prompts
            assert sum(e.generation_tokens_total for e in engines) == 8
            assert len(continuation["prompt"]) == len(tokenize("The import system")) + 3
    finally:
        for e in engines:
            e.stop()


# -- the pieces -------------------------------------------------------------------------------------------------------

def test_usage_options_ask_for_all_usage_and_hide_what_the_client_did_not_ask_for():
    plan = usage_options({"continuous_usage_stats": True, "other": 1})  # running usage without include_usage: none
    assert plan.options == {"continuous_usage_stats": True, "other": 1, "include_usage": True}
    assert plan.hide_final and plan.strip_running
    plan = usage_options({"include_usage": True})
    assert plan.options == {"include_usage": True, "continuous_usage_stats": True}
    assert not plan.hide_final and plan.strip_running
    assert usage_options(None).hide_final
    assert usage_options({"include_usage": True, "continuous_usage_stats": True}) is None  # nothing to change


def test_running_usage_is_stripped_from_content_chunks_only():
    chunk = (b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,'
             b'"total_tokens":4,"completion_tokens":1,"completion_tokens_details":{"reasoning_tokens":0}},'
             b'"prompt_token_ids":null}\n\n')
    final = b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}\n\n'
    assert strip_running_usage(chunk + final) == (b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"}}],'
                                                  b'"prompt_token_ids":null}\n\n' + final)
    text = b'data: {"choices":[{"index":0,"text":"a,\\"usage\\":{}"}]}\n\n'  # the words in generated text
    assert strip_running_usage(text) == text


def test_hidden_usage_moves_the_fingerprint_and_drops_only_the_usage_event():
    events = [b'data: {"id":"a","choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n',
              b'data: {"id":"a","choices":[{"index":0,"text":"y","finish_reason":"stop"}]}\n\n',
              b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2},'
              b'"system_fingerprint":"fp"}\n\n',
              DONE]
    stream = b"".join(events)
    for cut in range(1, len(stream)):  # wherever the reads split the events
        hidden, splitter, out = HiddenUsage(), SSEEvents(), b""
        for piece in (stream[:cut], stream[cut:]):
            out += hidden.feed(b"".join(splitter.feed(piece)))
        assert out == (events[0] + events[1][:-3] + b',"system_fingerprint":"fp"}\n\n' + DONE)
        assert hidden.usage == {"prompt_tokens": 2, "completion_tokens": 2}


def test_a_held_finish_is_given_back_when_no_usage_comes():
    hidden = HiddenUsage()
    finish = b'data: {"choices":[{"index":0,"text":"y","finish_reason":"length"}]}\n\n'
    assert hidden.feed(finish) == b""
    assert hidden.flush() == finish
    assert hidden.feed(finish) == b"" and hidden.feed(DONE) == finish + DONE


def test_only_the_final_usage_event_is_a_report():
    assert final_usage(b'data: {"choices":[{"text":"a"}],"usage":{"prompt_tokens":1}}\n\n') is None
    assert final_usage(b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n')["usage"] == {"prompt_tokens": 1}
    assert final_usage(b'data: {"choices": [], "usage": null}\n\n') is None


def test_usage_of_an_engine_report():
    assert Usage.of(None) is None
    assert Usage.of({"prompt_tokens": 5, "completion_tokens": 2}) == Usage(5, 2, 0)
    assert Usage.of({"prompt_tokens": 5, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 4}}).cached_prompt == 4


def test_summary_orders_by_tokens_and_every_configured_tenant_has_series():
    registry = CollectorRegistry()
    accounting = TenantAccounting(registry, slo_ttft_seconds=1.0)
    accounting.configure(["a", "b", "c"])
    accounting.used("b", Usage(10, 5, 0))
    accounting.used("c", Usage(1, 1, 0))
    accounting.answered("c", 200)
    accounting.limited("a", "tokens")
    assert [row["tenant"] for row in accounting.summary()] == ["b", "c", "a"]
    assert accounting.summary()[2]["rate_limited"] == 1
    for tenant in "abc":
        for kind in ("prompt", "completion", "cached_prompt"):
            assert registry.get_sample_value("appliance_tenant_tokens_total", {"tenant": tenant, "kind": kind}) \
                is not None
        assert registry.get_sample_value("appliance_tenant_requests_total", {"tenant": tenant, "code": "200"}) \
            is not None
        assert registry.get_sample_value("appliance_tenant_ttft_seconds_count", {"tenant": tenant}) is not None
    assert time.monotonic()  # nothing here depends on time


def _vllm_chat_stream(tokens: int, choices: int) -> tuple[list[bytes], bytes]:
    """A vLLM chat stream with include_usage (content chunks of ``choices`` choices, each choice's finishing chunk,
    the usage event with the fingerprint, [DONE]) and what the relay sends a client that did not ask for usage
    while the engine's fingerprint is not known: the chunks vLLM writes that client, each choice's finishing chunk
    where the usage event was."""
    head = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"demo"'

    def chunk(index: int, content: str, finish: str | None) -> bytes:
        reason = f'"{finish}"' if finish else "null"
        return (f'data: {{{head},"choices":[{{"index":{index},"delta":{{"content":"{content}"}},'
                f'"logprobs":null,"finish_reason":{reason}}}]}}\n\n').encode()

    # Choice 0 finishes half-way; the others stream on after it (a choice's finishing chunk is its last).
    events = [chunk(i % choices, f" w{i}", None) for i in range(tokens // 2)]
    later = [chunk(1 + i % (choices - 1) if choices > 1 else 0, f" v{i}", None) for i in range(tokens // 2)]
    finishes = [chunk(i, " end", "length") for i in range(choices)]
    events += [*finishes[:1], *later, *finishes[1:]] if choices > 1 else [*later, *finishes]
    usage = f'data: {{{head},"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{tokens + choices}}},' \
            '"system_fingerprint":"fp"}\n\n'
    stamped = b"".join(finishes).replace(b'"finish_reason":"length"}]}',
                                         b'"finish_reason":"length"}],"system_fingerprint":"fp"}')
    expected = b"".join(event for event in events if event not in finishes) + stamped
    return [*events, usage.encode(), DONE], expected + DONE


@pytest.mark.parametrize("choices", [1, 2])
def test_hiding_usage_gives_the_client_its_bytes_however_the_reads_cut_the_stream(choices: int) -> None:
    """Property (seeded storm of cut points): the relay's block framing (SSEEvents.feed_block) and HiddenUsage's
    fast path for blocks with nothing to hide give the bytes of a stream without usage (each finishing chunk when
    the usage event comes), wherever the engine's reads split events (mid-event, mid-marker, several events a
    read)."""
    import random

    events, expected = _vllm_chat_stream(40, choices)
    stream = b"".join(events)
    rng = random.Random(23)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 60)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        framing, hide, sent = SSEEvents(), HiddenUsage(), []
        for read in reads:
            sent.append(hide.feed(framing.feed_block(read)))
        sent.append(hide.flush() + framing.pending)
        assert b"".join(sent) == expected
        assert hide.usage == {"prompt_tokens": 3, "completion_tokens": 40 + choices}

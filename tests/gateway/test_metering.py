"""Tenant metering as a hook, without a transport: the quota's reservation before the queue and its settlement at
the end, the engines' usage (final and running) asked for and hidden, what a request that ended early is charged,
every leg counted."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry

from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.metering import Metering, tail_tokens
from appliance.gateway.tenants.quota import REQUESTS, TOKENS, Quotas
from appliance.gateway.tenants.usage import RunningUsage
from appliance.gateway.upstream.hook import Block, End
from appliance.http.errors import APIError
from tests.doubles import FakeClock
from tests.gateway.upstream.support import DONE, begin, block, chain, chunk, exchange, sse, usage_event

CAPACITY = 10_000


def meter(tenant: Tenant | None = None, clock: FakeClock | None = None) -> tuple[Metering, CollectorRegistry]:
    registry = CollectorRegistry()
    clock = clock or FakeClock()
    quotas = Quotas([tenant or Tenant("team-a")], clock)
    accounting = TenantAccounting(registry, slo_ttft_seconds=1.0, ratios=quotas.ratios)
    accounting.configure(["team-a"])
    admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    return Metering(accounting, quotas, admission, max_model_len=1000, clock=clock), registry


def tokens(registry: CollectorRegistry, kind: str) -> float | None:
    return registry.get_sample_value("appliance_tenant_tokens_total", {"tenant": "team-a", "kind": kind})


def level(metering: Metering) -> float:
    return metering.quotas.get("team-a").tokens.level


def running_chunk(text: str, prompt: int, completion: int, finish: str | None = None, index: int = 0) -> bytes:
    """A content chunk with vLLM's running usage (continuous_usage_stats)."""
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo", "choices": [choice],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                          "completion_tokens": completion}})


def relay(hooks, events: list[bytes], at: float | None = None) -> bytes:
    out = b""
    for event in events:
        b = Block(event, event, time.monotonic() if at is None else at, event.count(b"data: "))
        hooks.relayed(b)
        out += b.out
    return out + hooks.held()


def end(status: int = 200, outcome: Outcome = Outcome.SUCCESS, at: float | None = None) -> End:
    return End(status, outcome, True, time.monotonic() if at is None else at)


# -- usage asked for and hidden ---------------------------------------------------------------------------------------

def test_a_stream_asks_for_all_usage_and_the_client_never_sees_it() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello", "stream": True})
    hooks = chain(ex, metering.start(ex))
    assert json.loads(ex.body)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert hooks.frames
    begin(ex)
    out = relay(hooks, [running_chunk("a", 3, 1), running_chunk("b", 3, 2, finish="length"), usage_event(3, 2), DONE])
    assert out == chunk("a") + chunk("b", finish="length") + DONE
    hooks.finished(end())
    assert (tokens(registry, "prompt"), tokens(registry, "completion"), tokens(registry, "estimated")) == (3, 2, 0)


def test_a_client_that_asked_for_usage_keeps_it_and_every_leg_is_counted() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello", "stream": True, "stream_options": {"include_usage": True}})
    hooks = chain(ex, metering.start(ex))
    assert json.loads(ex.body)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    begin(ex)
    for event, shown in ((running_chunk("a", 3, 1), chunk("a")), (usage_event(3, 1), usage_event(3, 1))):
        assert relay(hooks, [event]) == shown
    begin(ex, "replica-1", "continuation")  # a second leg, with its own report
    assert relay(hooks, [usage_event(4, 1)]) == usage_event(4, 1)
    hooks.finished(end())
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (7, 2)


def test_a_client_that_asked_for_running_usage_gets_it_untouched() -> None:
    metering, _ = meter()
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hello", "stream": True, "stream_options": options}
    ex = exchange(body)
    sent = ex.body
    hooks = chain(ex, metering.start(ex))
    assert ex.body == sent
    events = [running_chunk("a", 3, 1), usage_event(3, 1), DONE]
    assert relay(hooks, events) == b"".join(events)


def test_a_non_streaming_answer_is_counted_from_its_body() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello"})
    hooks = chain(ex, metering.start(ex))
    assert not hooks.frames
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}).encode()
    b = block(body)
    hooks.relayed(b)
    assert b.out == body and b.usage == {"prompt_tokens": 5, "completion_tokens": 4}
    hooks.finished(end())
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (5, 4)


# -- the quota: a reservation of the worst case ---------------------------------------------------------------------

def test_the_worst_case_is_reserved_before_the_queue_and_settled_to_the_usage() -> None:
    metering, _ = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    ex = exchange({"prompt": "x" * 40, "max_tokens": 100, "n": 3})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    assert level(metering) == CAPACITY - (10 + 3 * 100)  # the prompt's estimate, max_tokens x n
    begin(ex)
    hooks.relayed(block(json.dumps({"usage": {"prompt_tokens": 12, "completion_tokens": 50}}).encode()))
    hooks.finished(end())
    assert level(metering) == CAPACITY - 62  # the rest went back
    hooks.finished(end())  # never settled twice
    assert level(metering) == CAPACITY - 62


def test_a_request_that_reached_no_engine_is_refunded_whole() -> None:
    metering, _ = meter(Tenant("team-a", tokens_per_minute=CAPACITY, requests_per_minute=10))
    ex = exchange({"prompt": ["a", "b"], "max_tokens": 10, "n": 2})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    assert metering.quotas.get("team-a").requests.level == 10 - 4  # prompts x n
    hooks.finished(End(429, Outcome.ABORTED, False, time.monotonic()))  # the queue timed out
    assert level(metering) == CAPACITY and metering.quotas.get("team-a").requests.level == 10


@pytest.mark.parametrize("status", [499, 504])
def test_a_non_streaming_request_left_or_timed_out_at_an_engine_is_charged_its_reservation(status: int) -> None:
    """Its engine's progress is never seen (the answer comes in one piece at the end), and no stream ran on its
    replica to tell the engine's pace: the whole reservation, counted as estimated."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    ex = exchange({"prompt": "x" * 40, "max_tokens": 100})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex)
    hooks.finished(end(status, Outcome.ABORTED))
    assert level(metering) == CAPACITY - 110
    assert tokens(registry, "estimated") == 110 and tokens(registry, "prompt") == 0


def test_a_non_streaming_request_left_at_an_engine_is_charged_what_its_replicas_streams_say_it_made() -> None:
    """A stream on replica-0 made 10 tokens a second, its first token 0.5 s after its dispatch. A non-streaming
    request there, left 2.5 s after its dispatch, is charged its prompt and 2 s of that pace for each of its
    sequences, as estimated, and its quota settled to that; on replica-1, where no stream ran, its whole
    reservation; never more than its reservation; before the first token, its prompt."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    stream = exchange({"prompt": "x" * 40, "max_tokens": 100, "stream": True})
    hooks = chain(stream, metering.start(stream))
    begin(stream)
    stream.dispatched = 99.5
    relay(hooks, [running_chunk("a", 10, 1)], at=100.0)  # its prompt as the gateway estimated it
    relay(hooks, [running_chunk("b", 10, 11)], at=101.0)
    relay(hooks, [usage_event(10, 11), DONE], at=101.0)
    hooks.finished(end(at=101.0))
    charged = CAPACITY - level(metering)

    def left(replica: str, seconds: float, max_tokens: int = 100, n: int = 1) -> float:
        ex = exchange({"prompt": "x" * 40, "max_tokens": max_tokens, "n": n})
        hooks = chain(ex, metering.start(ex))
        hooks.arrived()
        begin(ex, replica)
        ex.dispatched = 200.0
        before = tokens(registry, "estimated") or 0
        hooks.finished(end(499, Outcome.ABORTED, at=200.0 + seconds))
        return (tokens(registry, "estimated") or 0) - before

    assert left("replica-0", 2.5) == 10 + 20
    assert CAPACITY - level(metering) == charged + 30  # the quota settled to the estimate
    assert left("replica-0", 2.5, n=2) == 10 + 40
    assert left("replica-1", 2.5) == 10 + 100
    assert left("replica-0", 30.0, max_tokens=50) == 10 + 50
    assert left("replica-0", 0.2) == 10


@pytest.mark.parametrize("kind", ["retry", "rerun"])
def test_a_non_streaming_leg_whose_engine_died_is_charged_what_it_made_before_it_ran_again(kind: str) -> None:
    """Its connection dropped 2.5 s after the dispatch (its engine died: before any answer, as vLLM sends a
    non-streaming answer whole, or mid-body) where a stream made 10 tokens a second, its first token after 0.5 s,
    and the request ran again on replica-1, which answered: the tenant pays the dead leg's prompt and 2 s of that
    pace, as estimated and on replica-0's side of the reconciliation, and the answer as reported. A connection
    that dropped as the request was written (a stale pooled one, no engine saw it) costs nothing."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    stream = exchange({"prompt": "x" * 40, "max_tokens": 100, "stream": True})
    hooks = chain(stream, metering.start(stream))
    begin(stream)
    stream.dispatched = 99.5
    relay(hooks, [running_chunk("a", 10, 1)], at=100.0)
    relay(hooks, [running_chunk("b", 10, 11)], at=101.0)
    relay(hooks, [usage_event(10, 11), DONE], at=101.0)
    hooks.finished(end(at=101.0))
    before = CAPACITY - level(metering)
    sides = {name: metering.reconciliation.drift(name) for name in ("replica-0", "replica-1")}

    ex = exchange({"prompt": "x" * 40, "max_tokens": 100})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex).started = metering.clock()
    ex.end_attempt(Outcome.FAILURE, "retry: ServerDisconnectedError", dropped=True)  # stale: at once
    begin(ex).started = metering.clock() - 2.5  # dispatched 2.5 s before it dropped
    ex.end_attempt(Outcome.FAILURE, f"{kind}: connection", dropped=True)
    begin(ex, "replica-1", kind)
    hooks.relayed(block(json.dumps({"usage": {"prompt_tokens": 10, "completion_tokens": 100}}).encode()))
    hooks.finished(end())

    assert tokens(registry, "estimated") == 10 + 20
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (10 + 10, 11 + 100)
    assert CAPACITY - level(metering) == before + 30 + 110  # the quota settled to both legs
    assert metering.reconciliation.drift("replica-0") == (sides["replica-0"][0] + 10, sides["replica-0"][1] + 20)
    assert metering.reconciliation.drift("replica-1") == (sides["replica-1"][0] + 10, sides["replica-1"][1] + 100)


def test_a_left_request_s_prompt_is_estimated_as_engines_counted_the_prompts_before_it() -> None:
    """The engine counted 12 tokens for a prompt the gateway put at 10 (four characters a token); a non-streaming
    request left at an engine with the same prompt is charged 12 for it, and so is a stream left before its first
    chunk. Measured on the demo engine: four characters a token charged 2-4% less prompt than the engine counted."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    answered = exchange({"prompt": "x" * 40, "max_tokens": 100})
    hooks = chain(answered, metering.start(answered))
    begin(answered)
    hooks.relayed(block(json.dumps({"usage": {"prompt_tokens": 12, "completion_tokens": 5}}).encode()))
    hooks.finished(end())

    for body in ({"prompt": "x" * 40, "max_tokens": 100}, {"prompt": "x" * 40, "max_tokens": 100, "stream": True}):
        ex = exchange(body)
        hooks = chain(ex, metering.start(ex))
        hooks.arrived()
        begin(ex, "replica-1")  # no stream ran there: the completion is the reservation's
        before = tokens(registry, "estimated") or 0
        hooks.finished(end(499, Outcome.ABORTED))
        assert (tokens(registry, "estimated") or 0) - before == 12 + (0 if body.get("stream") else 100)


def test_an_engine_failure_before_any_answer_costs_the_tenant_nothing() -> None:
    metering, _ = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    ex = exchange({"prompt": "x" * 40, "max_tokens": 100})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex)
    hooks.finished(end(502, Outcome.FAILURE))
    assert level(metering) == CAPACITY


def test_a_reservation_that_does_not_fit_now_is_a_429_with_retry_after() -> None:
    clock = FakeClock()
    metering, registry = meter(Tenant("team-a", tokens_per_minute=600), clock)  # 10 tokens a second
    first = exchange({"prompt": "x" * 40, "max_tokens": 390})
    chain(first, metering.start(first)).arrived()  # 400 reserved: 200 left
    second = exchange({"prompt": "x" * 40, "max_tokens": 290})
    with pytest.raises(APIError) as refused:
        chain(second, metering.start(second)).arrived()
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers == {"Retry-After": "10"}  # (300 - 200) / 10 a second
    assert registry.get_sample_value("appliance_tenant_rate_limited_total",
                                     {"tenant": "team-a", "limit": TOKENS}) == 1
    clock.advance(10)
    chain(second, metering.start(second)).arrived()


@pytest.mark.parametrize(("body", "param"), [({"prompt": "hi", "max_tokens": 700}, "max_tokens"),
                                              ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                                              ({"prompt": "hi", "max_tokens": 1, "n": 16}, "n")])
def test_a_request_that_could_never_fit_is_a_400_that_says_what_to_lower(body: dict, param: str) -> None:
    """A chat request without max_tokens may use the model's whole context (1000 here): more than a quota of 600
    tokens a minute, or one of 10 requests a minute, can ever hold; waiting would not help."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=600, requests_per_minute=10))
    ex = exchange(body, route="chat" if "messages" in body else "completions")
    with pytest.raises(APIError) as refused:
        chain(ex, metering.start(ex)).arrived()
    assert refused.value.status == 400 and refused.value.code == "exceeds_quota" and refused.value.param == param
    assert "team-a" in refused.value.message and "ever" in refused.value.message
    assert registry.get_sample_value("appliance_tenant_rate_limited_total",
                                     {"tenant": "team-a", "limit": REQUESTS}) == 0


def test_a_spent_requests_quota_refuses_before_the_queue_with_retry_after() -> None:
    metering, registry = meter(Tenant("team-a", requests_per_minute=1))
    first = exchange({"prompt": "hello"})
    chain(first, metering.start(first)).arrived()
    second = exchange({"prompt": "hello"})
    with pytest.raises(APIError) as refused:
        chain(second, metering.start(second)).arrived()
    assert refused.value.status == 429 and "Retry-After" in (refused.value.headers or {})
    assert registry.get_sample_value("appliance_tenant_rate_limited_total",
                                     {"tenant": "team-a", "limit": REQUESTS}) == 1


# -- what a stream that ended early used ----------------------------------------------------------------------------

def test_a_stream_left_mid_way_is_charged_its_running_usage_and_the_tail_the_engine_made() -> None:
    """Two chunks read 1 s apart (1 token/s over the leg), the client leaves 4 s after the last (a slow client:
    the relay had not read what the engine made meanwhile): 4 tokens of tail, as estimated; the running usage as
    reported."""
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    ex = exchange({"prompt": "x" * 40, "max_tokens": 100, "stream": True})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex)
    relay(hooks, [running_chunk("a", 9, 1)], at=100.0)
    relay(hooks, [running_chunk("b", 9, 2)], at=101.0)
    hooks.finished(end(499, Outcome.ABORTED, at=105.0))
    assert (tokens(registry, "prompt"), tokens(registry, "completion"), tokens(registry, "estimated")) == (9, 2, 4)
    assert level(metering) == CAPACITY - 15


def test_a_stream_left_before_its_first_chunk_is_charged_its_prompt() -> None:
    metering, registry = meter(Tenant("team-a", tokens_per_minute=CAPACITY))
    ex = exchange({"prompt": "x" * 40, "max_tokens": 100, "stream": True})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex)
    hooks.finished(end(499, Outcome.ABORTED))
    assert tokens(registry, "estimated") == 10 and level(metering) == CAPACITY - 10


def test_a_leg_that_broke_counts_its_running_usage_and_the_continuation_its_report() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello", "stream": True})
    hooks = chain(ex, metering.start(ex))
    begin(ex)
    relay(hooks, [running_chunk("a", 5, 1), running_chunk("b", 5, 2)])
    begin(ex, "replica-1", "continuation")  # the first leg broke: its prompt and 2 tokens were made
    relay(hooks, [running_chunk("c", 7, 1), usage_event(7, 1), DONE])
    hooks.finished(end())
    assert (tokens(registry, "prompt"), tokens(registry, "completion"), tokens(registry, "estimated")) == (12, 3, 0)


def test_running_usage_of_several_choices_adds_each_choice_and_each_prompt_once() -> None:
    running = RunningUsage(sequences=4)
    events = b"".join(running_chunk("a", 5 if i % 4 < 2 else 7, 1 + i // 4, index=i % 4) for i in range(8))
    running.feed(events, 1.0)
    assert running.usage(n=2).prompt == 12 and running.usage(n=2).completion == 8


def test_the_tail_is_bounded_by_the_reservation() -> None:
    running = RunningUsage()
    running.feed(running_chunk("a", 5, 1), 0.0)
    running.feed(running_chunk("b", 5, 101), 1.0)
    assert tail_tokens(running, 11.0, room=20) == 20
    assert tail_tokens(running, 1.0, room=20) == 0  # no gap: nothing unread
    assert tail_tokens(RunningUsage(), 11.0, room=20) == 0

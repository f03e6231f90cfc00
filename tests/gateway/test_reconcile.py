"""The tenants' accounting reconciled with the engines' own counters, per replica: the engine's side from scripted
readings (baseline, rises, restarts, replicas that come and go, unanswered polls), the tenants' side from the
metering hook (legs on their own replicas, prompts once per sequence, estimates where the work was), a seeded
storm that must end at exactly 0 drift once every request has ended and the readings caught up, and the gateway
exposing both on /metrics from its own engine poll (fake engines)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.engine.load import EngineLoad
from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.upstream.hook import Block, End
from appliance.settings import Settings
from tests.doubles import FakeClock, FakeReplica
from tests.fake_engine import Failure, FakeEngine
from tests.gateway.live import LiveGateway, wait_until
from tests.gateway.upstream.support import DONE, begin, chain, exchange, sse, usage_event


def reading(prompt: float, generation: float) -> EngineLoad:
    return EngineLoad(prompt_tokens_total=prompt, generation_tokens_total=generation, read_at=time.monotonic())


def sample(registry: CollectorRegistry, replica: str, kind: str, side: str) -> float | None:
    return registry.get_sample_value("appliance_tenant_reconciled_tokens_total",
                                     {"replica": replica, "kind": kind, "side": side})


# -- the engine's side ------------------------------------------------------------------------------------------------

def test_the_first_reading_is_a_baseline_and_later_ones_add_their_rise() -> None:
    rec = Reconciliation()
    rec.observe("r0", reading(1000, 5000))  # an engine that served others before the gateway first read it
    assert rec.engine["r0"] == [0.0, 0.0]
    rec.observe("r0", reading(1010, 5003))
    rec.observe("r0", reading(1030, 5003))
    assert rec.engine["r0"] == [30.0, 3.0]


def test_an_engine_restart_is_a_new_baseline_not_a_rise_or_a_fall() -> None:
    """Its counters start again from 0; what it counted before its first reading after the restart (its warm-up,
    made while drained) is nobody's."""
    rec = Reconciliation()
    rec.observe("r0", reading(100, 200))
    rec.observe("r0", reading(150, 260))
    rec.observe("r0", reading(7, 1))  # restarted and warmed up
    assert rec.engine["r0"] == [50.0, 60.0]
    rec.observe("r0", reading(17, 4))
    assert rec.engine["r0"] == [60.0, 63.0]


def test_a_reading_without_the_counters_changes_nothing_and_the_next_covers_the_gap() -> None:
    rec = Reconciliation()
    rec.observe("r0", reading(10, 10))
    rec.observe("r0", None)  # the poll went unanswered
    rec.observe("r0", EngineLoad(running=1.0))  # a page without the counters
    rec.observe("r0", reading(25, 40))
    assert rec.engine["r0"] == [15.0, 30.0]


def test_replicas_gone_from_the_fleet_are_forgotten_and_a_new_one_starts_from_its_baseline() -> None:
    rec = Reconciliation()
    registry = CollectorRegistry()
    registry.register(rec)
    for name in ("r0", "r1"):
        rec.observe(name, reading(0, 0))
        rec.observe(name, reading(10, 20))
        rec.charged(name, 10, 20)
    rec.retain({"r1"})
    assert sample(registry, "r0", "prompt", "engine") is None and sample(registry, "r1", "prompt", "engine") == 10
    rec.observe("r2", reading(500, 500))
    assert sample(registry, "r2", "completion", "engine") == 0 and sample(registry, "r2", "completion", "tenants") == 0
    assert rec.drift("r1") == (0, 0) and rec.drift("r2") == (0, 0)


# -- the tenants' side, from the metering hook ------------------------------------------------------------------------

def meter(reconciliation: Reconciliation) -> Metering:
    registry = CollectorRegistry()
    quotas = Quotas([Tenant("team-a")], FakeClock())
    accounting = TenantAccounting(registry, slo_ttft_seconds=1.0, ratios=quotas.ratios)
    admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    return Metering(accounting, quotas, admission, max_model_len=1000, reconciliation=reconciliation)


def running_chunk(prompt: int, completion: int, index: int = 0, finish: str | None = None) -> bytes:
    choice = {"index": index, "text": "t", "logprobs": None, "finish_reason": finish}
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo", "choices": [choice],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                          "completion_tokens": completion}})


def relay(hooks, raw: bytes, at: float) -> None:
    hooks.relayed(Block(raw, raw, at, raw.count(b"data: ")))


def finish(ex, end: End) -> None:
    """The request's end as the transport reports it: its slot given back, then the hooks told."""
    ex.settle(end.outcome)
    ex.hooks.finished(end)


def test_each_leg_of_a_continued_stream_is_charged_to_its_own_replica() -> None:
    rec = Reconciliation()
    metering = meter(rec)
    ex = exchange({"prompt": [1] * 5, "max_tokens": 10, "stream": True})
    hooks = chain(ex, metering.start(ex))
    begin(ex, "r0")
    relay(hooks, running_chunk(5, 1) + running_chunk(5, 2), 1.0)
    ex.settle(Outcome.FAILURE)
    begin(ex, "r1", "continuation")  # r0 broke after 2 tokens; r1 prefills the prompt and those 2
    relay(hooks, running_chunk(7, 1) + usage_event(7, 1) + DONE, 2.0)
    finish(ex, End(200, Outcome.SUCCESS, True, 2.0))
    assert rec.tenants == {"r0": [5, 2], "r1": [7, 1]}


def test_a_prompt_is_counted_once_per_sequence_as_the_engine_counts_it() -> None:
    """n=2: vLLM runs two sequences that each prefill the prompt (its counter rises by twice the prompt), while the
    usage states the prompt once."""
    rec = Reconciliation()
    metering = meter(rec)
    ex = exchange({"prompt": [1] * 4, "max_tokens": 3, "n": 2, "stream": True})
    hooks = chain(ex, metering.start(ex))
    begin(ex, "r0")
    relay(hooks, usage_event(4, 6) + DONE, 1.0)
    finish(ex, End(200, Outcome.SUCCESS, True, 1.0))
    assert rec.tenants == {"r0": [8, 6]}


def test_an_estimate_is_charged_to_the_replica_whose_work_it_stands_for() -> None:
    """A non-streaming request that timed out on its second attempt: its whole reservation, prompt and completion,
    on the replica that had it."""
    rec = Reconciliation()
    metering = meter(rec)
    ex = exchange({"prompt": [1] * 6, "max_tokens": 10})
    chain(ex, metering.start(ex))
    begin(ex, "r0")
    ex.settle(Outcome.FAILURE)
    begin(ex, "r1", "retry")
    finish(ex, End(504, Outcome.ABORTED, True, 1.0))
    assert rec.tenants == {"r1": [6, 10]}


def test_work_in_flight_shows_on_the_engine_side_first_and_settles_at_the_end() -> None:
    rec = Reconciliation()
    metering = meter(rec)
    rec.observe("r0", reading(0, 0))
    ex = exchange({"prompt": [1] * 3, "max_tokens": 4, "stream": True})
    hooks = chain(ex, metering.start(ex))
    begin(ex, "r0")
    relay(hooks, running_chunk(3, 1) + running_chunk(3, 2), 1.0)
    rec.observe("r0", reading(3, 2))
    assert rec.drift("r0") == (-3, -2)  # the engine did it; nobody is charged yet
    relay(hooks, running_chunk(3, 3) + running_chunk(3, 4, finish="length") + usage_event(3, 4) + DONE, 2.0)
    finish(ex, End(200, Outcome.SUCCESS, True, 2.0))
    rec.observe("r0", reading(3, 4))
    assert rec.drift("r0") == (0, 0)


# -- a seeded storm ---------------------------------------------------------------------------------------------------

@dataclass
class Engine:
    """One replica's engine as its counters see it: each sequence's prompt when it makes its first token, each
    token as it is made."""

    prompt: int = 0
    generation: int = 0

    def reading(self) -> EngineLoad:
        return reading(self.prompt, self.generation)


def stream(metering: Metering, engines: dict[str, Engine], rng: random.Random, replica: str,
           routable: list[str]) -> Iterator[str]:
    """One streamed request, a step per event, each step naming the replica working on it: read to the end, left
    after some chunk (the engine aborts it at once), or broken and continued on another replica (that engine
    prefills the prompt and the tokens sent); one or two choices."""
    n = rng.choice((1, 1, 2))
    prompt, max_tokens = rng.randint(1, 30), rng.randint(1, 12)
    ex = exchange({"prompt": [1] * prompt, "max_tokens": max_tokens, "n": n, "stream": True})
    hooks = chain(ex, metering.start(ex))
    how = rng.choice(("whole", "left", "continued")) if n == 1 else "whole"
    stop = rng.randint(1, max_tokens)  # tokens made before it was left or broke
    at = 0.0
    begin(ex, replica)
    engine = engines[replica]
    made = [0] * n
    for token in range(max_tokens):
        if how != "whole" and token == stop:
            break
        for choice in range(n):
            if made[choice] == 0:
                engine.prompt += prompt
            made[choice] += 1
            engine.generation += 1
            at += 1.0
            relay(hooks, running_chunk(prompt, made[choice], choice), at)
            yield replica
    if how == "left":
        finish(ex, End(499, Outcome.ABORTED, True, at))  # left right after the last chunk: no tail
        return
    if how == "continued":
        others = [r for r in routable if r != replica]
        if others:
            replica = rng.choice(others)
            ex.settle(Outcome.FAILURE)
            begin(ex, replica, "continuation")
            engine = engines[replica]
            engine.prompt += prompt + stop
            rest = max_tokens - stop
            for done in range(1, rest + 1):
                engine.generation += 1
                at += 1.0
                relay(hooks, running_chunk(prompt + stop, done), at)
                yield replica
            relay(hooks, usage_event(prompt + stop, rest) + DONE, at)
            finish(ex, End(200, Outcome.SUCCESS, True, at))
        else:
            finish(ex, End(502, Outcome.FAILURE, True, at))
        return
    relay(hooks, usage_event(prompt, sum(made)) + DONE, at)
    finish(ex, End(200, Outcome.SUCCESS, True, at))


def whole(metering: Metering, engines: dict[str, Engine], rng: random.Random, replica: str) -> Iterator[str]:
    """A non-streaming request: the engine's work, then its answer in one piece."""
    prompt, completion = rng.randint(1, 30), rng.randint(1, 12)
    ex = exchange({"prompt": [1] * prompt, "max_tokens": completion})
    hooks = chain(ex, metering.start(ex))
    begin(ex, replica)
    engines[replica].prompt += prompt
    engines[replica].generation += completion
    yield replica
    relay(hooks, json.dumps({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                      "total_tokens": prompt + completion}}).encode(), 0.0)
    finish(ex, End(200, Outcome.SUCCESS, True, 0.0))


def test_a_seeded_storm_ends_at_exactly_zero_drift_once_requests_end_and_readings_catch_up() -> None:
    """Requests of every shape on three replicas at once, readings at random moments, replicas restarted (drained:
    no new work, its requests end, read, counters from 0, a warm-up no tenant asked for, back in routing), one added
    that had served others before, one removed: at the end, each replica's two sides are equal, to the token."""
    rng = random.Random(20261205)
    rec = Reconciliation()
    metering = meter(rec)
    engines = {name: Engine() for name in ("r0", "r1", "r2")}
    for name, engine in engines.items():
        rec.observe(name, engine.reading())
    open_requests: list[list] = []  # [the replica working on it now, the request]
    served = restarts = 0
    routable = list(engines)
    draining: set[str] = set()
    for step in range(4000):
        live = list(engines)
        roll = rng.random()
        if roll < 0.15 and served < 400:
            replica = rng.choice(routable)
            request = stream(metering, engines, rng, replica, routable) if rng.random() < 0.75 else \
                whole(metering, engines, rng, replica)
            open_requests.append([replica, request])
            served += 1
        elif roll < 0.3:
            name = rng.choice(live)
            rec.observe(name, engines[name].reading() if rng.random() < 0.9 else None)
        elif open_requests:
            i = rng.randrange(len(open_requests))
            working = next(open_requests[i][1], None)
            if working is None:
                open_requests.pop(i)
            else:
                open_requests[i][0] = working
        if step % 500 == 250 and not draining:  # a rolling restart begins: the replica leaves routing
            draining.add(name := rng.choice(routable))
            routable.remove(name)
        for name in [name for name in draining if all(working != name for working, _ in open_requests)]:
            rec.observe(name, engines[name].reading())  # drained: its last work read
            engines[name] = Engine(prompt=7, generation=1)  # restarted and warmed up
            rec.observe(name, engines[name].reading())
            draining.remove(name)
            routable.append(name)
            restarts += 1
        if step == 2000:
            engines["r3"] = Engine(prompt=900, generation=4000)  # served others before it joined
            rec.observe("r3", engines["r3"].reading())
            routable.append("r3")
    while open_requests:  # every request ends
        _, request = open_requests.pop()
        for _ in request:
            pass
    for name, engine in engines.items():  # the readings catch up
        rec.observe(name, engine.reading())
    assert served >= 300 and restarts >= 2
    for name in engines:
        assert rec.drift(name) == (0, 0), name
        assert rec.engine[name][1] > 0, name
    rec.retain({"r0", "r1", "r3"})
    assert set(rec.engine) == {"r0", "r1", "r3"}


# -- the gateway, its poll and /metrics -------------------------------------------------------------------------------

def test_the_gateway_exposes_both_sides_from_its_own_poll_and_they_meet() -> None:
    """Two fake engines, whole and continued streams and non-streaming answers through the gateway: once its poll
    has read the engines after the last request, each replica's tenants' side equals its engine's counters'
    rise."""
    failures = [Failure(after=3)]  # the first stream breaks after 3 tokens and is continued on the other replica
    engines = [FakeEngine(failures=failures).start() for _ in range(2)]
    try:
        replicas = [FakeReplica(f"replica-{i}", e.url) for i, e in enumerate(engines)]
        settings = Settings(served_model_name="demo", routing={"migration_limit": 1, "metrics_poll_seconds": 0.05},
                            collectors={"enabled": False})
        registry = CollectorRegistry()
        with LiveGateway(create_app(settings, replicas=lambda: replicas, registry=registry)) as live:
            assert wait_until(lambda: sample(registry, "replica-1", "prompt", "engine") == 0)
            for i in range(6):
                body = {"prompt": "The import system", "max_tokens": 4 + i, "stream": i % 3 != 2}
                response = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
                assert response.status_code == 200
            assert sum(e.generation_tokens_total for e in engines) == sum(4 + i for i in range(6))

            def met() -> bool:
                return all(sample(registry, f"replica-{i}", kind, "engine")
                           == sample(registry, f"replica-{i}", kind, "tenants")
                           for i in range(2) for kind in ("prompt", "completion"))

            assert wait_until(met), registry.get_sample_value
            for i, engine in enumerate(engines):
                assert sample(registry, f"replica-{i}", "completion", "engine") == engine.generation_tokens_total
            page = httpx.get(live.url + "/metrics", timeout=10).text
            assert 'appliance_tenant_reconciled_tokens_total{kind="prompt",replica="replica-0",side="tenants"}' in page
    finally:
        for e in engines:
            e.stop()

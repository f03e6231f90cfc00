"""Work no engine reported, charged as the engine counted it once its replica comes to rest: the shares
(``apportion``, ``settle``), the rest itself (idle over two readings, counters still, nothing told between, the
engine's finished sequences those reported), every way an estimate is charged as it is instead (no rest in time,
a foreign request, a restart, a replica gone), the metering hook holding a timed-out request's estimate, and a
seeded storm whose replicas end with both sides equal to the token and every unseen request charged once."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from appliance.engine.load import EngineLoad
from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.tenants.settlement import Unseen, apportion, settle
from appliance.gateway.upstream.hook import Block, End
from tests.doubles import FakeClock
from tests.gateway.upstream.support import DONE, begin, chain, exchange, sse, usage_event

# -- the shares -------------------------------------------------------------------------------------------------------


def test_shares_follow_the_weights_and_sum_to_the_total() -> None:
    assert apportion(100, [1, 1, 2]) == [25, 25, 50]
    assert sum(apportion(10, [1, 1, 1])) == 10
    assert apportion(7, [0, 0]) in ([4, 3], [3, 4])  # no weights: equal


def test_a_capped_share_gives_what_it_cannot_take_to_the_others() -> None:
    assert apportion(30, [10, 1], caps=[12, 100]) == [12, 18]


@given(st.lists(st.tuples(st.floats(0, 1000), st.integers(0, 500)), min_size=1, max_size=12), st.data())
def test_shares_are_whole_within_their_caps_and_sum_exactly(items: list[tuple[float, int]], data) -> None:
    weights, caps = [w for w, _ in items], [c for _, c in items]
    total = data.draw(st.integers(0, sum(caps)))
    shares = apportion(total, weights, caps)
    assert sum(shares) == total
    assert all(0 <= share <= cap for share, cap in zip(shares, caps, strict=True))


def unseen(tenant: str = "a", prompt: int = 10, completion: int = 20, room: int = 100, n: int = 1) -> Unseen:
    return Unseen(tenant, n, prompt, completion, room, 0.0)


def test_the_engine_s_unseen_work_is_shared_in_proportion_to_the_estimates() -> None:
    assert settle([unseen(completion=10), unseen(completion=30)], 20, 60) == [(10, 15), (10, 45)]


def test_numbers_the_estimates_could_not_have_made_are_not_theirs() -> None:
    assert settle([unseen(room=50)], 10, 51) is None  # more completion than the request could make
    assert settle([unseen(prompt=10)], 21, 5) is None  # over twice the prompt's estimate
    assert settle([unseen()], -1, 5) is None  # the reports already exceed the engine's count
    assert settle([unseen()], 0, 0) == [(0, 0)]  # aborted while it waited: the engine made nothing


def test_a_tenant_is_charged_a_prompt_once_per_request() -> None:
    assert unseen(n=2).charge(prompt=20, completion=7) == 17


# -- the rest ---------------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """One replica's engine as its /metrics show it."""

    prompt: int = 0
    generation: int = 0
    finished: int = 0
    running: int = 0

    def reading(self) -> EngineLoad:
        return EngineLoad(prompt_tokens_total=self.prompt, generation_tokens_total=self.generation,
                          finished_total=self.finished, running=self.running, waiting=0)


class Ledger:
    """A reconciliation holding estimates, its tenants' charges counted, its clock and open legs the test's."""

    def __init__(self, hold: float = 30.0, other_gateways: bool = False) -> None:
        self.clock = FakeClock()
        self.open: Counter[str] = Counter()
        self.charges: Counter[str] = Counter()
        self.rec = Reconciliation(self.charge, hold_seconds=hold, open_legs=lambda name: self.open[name],
                                  clock=self.clock, other_gateways=other_gateways)

    def charge(self, tenant: str, tokens: int) -> None:
        self.charges[tenant] += tokens

    def read(self, name: str, engine: Engine, times: int = 1) -> None:
        for _ in range(times):
            self.clock.advance(1.0)
            self.rec.observe(name, engine.reading())


def test_a_held_estimate_is_charged_as_the_engine_counted_it_at_rest() -> None:
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation = 12, 37  # a request the client left: 37 tokens the gateway never saw
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=50, room=100)
    assert ledger.charges["a"] == 0  # held
    ledger.read("r0", engine, 2)
    assert ledger.charges["a"] == 12 + 37
    assert ledger.rec.drift("r0") == (0, 0)
    assert ledger.rec.unseen_charged[("r0", "engine")] == 1


def test_two_estimates_share_the_engine_s_count_and_reports_are_not_theirs() -> None:
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation, engine.finished = 5 + 20, 4 + 60, 1
    ledger.rec.charged("r0", 5, 4, finished=1)  # a whole answer, reported
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=10, room=100)
    ledger.rec.unseen("r0", "b", 1, prompt=10, completion=30, room=100)
    ledger.read("r0", engine, 2)
    assert (ledger.charges["a"], ledger.charges["b"]) == (10 + 15, 10 + 45)
    assert ledger.rec.drift("r0") == (0, 0)


def test_no_rest_while_the_engine_runs_the_gateway_has_a_request_there_or_counters_move() -> None:
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    engine.generation = 30
    ledger.rec.unseen("r0", "a", 1, prompt=0, completion=20, room=100)
    engine.running = 1
    ledger.read("r0", engine, 3)
    assert ledger.charges["a"] == 0
    engine.running = 0
    ledger.open["r0"] = 1
    ledger.read("r0", engine, 3)
    assert ledger.charges["a"] == 0
    ledger.open["r0"] = 0
    ledger.read("r0", engine)
    engine.generation += 1  # still counting: the rest waits for counters that stand still over two readings
    ledger.read("r0", engine)
    assert ledger.charges["a"] == 0
    ledger.read("r0", engine)
    assert ledger.charges["a"] == 31


def test_a_charge_told_between_two_readings_puts_the_rest_off() -> None:
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    ledger.rec.unseen("r0", "a", 1, prompt=0, completion=20, room=100)
    ledger.read("r0", engine)
    ledger.rec.charged("r0", 0, 0)  # a request that ended after the engine's last count: not yet read
    ledger.read("r0", engine)
    assert ledger.charges["a"] == 0
    ledger.read("r0", engine)
    assert ledger.rec.unseen_charged[("r0", "engine")] == 1


def test_sequences_finished_that_no_report_covers_are_another_gateway_s_so_the_estimate_stands() -> None:
    """Another gateway had a request on the engine: its tokens are in the counters."""
    ledger, engine = Ledger(other_gateways=True), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation, engine.finished = 12, 30, 1
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=50, room=100)
    ledger.read("r0", engine, 2)
    assert ledger.charges["a"] == 60
    assert ledger.rec.unseen_charged[("r0", "estimate")] == 1


def test_an_unseen_request_its_engine_finished_as_its_client_left_is_still_charged_from_the_count() -> None:
    """Alone in front of the engine, a finished sequence no report covers is an unseen request's whose answer
    was on its way when its client left (the engine counted it finished): one per choice of the unseen requests
    is theirs; more than that is someone else's, and the estimates stand."""
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation, engine.finished = 12 + 8, 100 + 5, 1
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=50, room=100)  # finished at the engine: 12 + 100
    ledger.rec.unseen("r0", "b", 1, prompt=10, completion=10, room=100)  # left early: 8 + 5
    ledger.read("r0", engine, 2)
    assert ledger.charges["a"] + ledger.charges["b"] == 20 + 105
    assert ledger.rec.unseen_charged[("r0", "engine")] == 2 and ledger.rec.drift("r0") == (0, 0)

    engine.prompt, engine.generation, engine.finished = engine.prompt + 12, engine.generation + 30, 3
    ledger.rec.unseen("r0", "c", 1, prompt=10, completion=50, room=100)  # two finished, one unseen request
    ledger.read("r0", engine, 2)
    assert ledger.charges["c"] == 60 and ledger.rec.unseen_charged[("r0", "estimate")] == 1


def test_an_estimate_held_too_long_is_charged_as_it_is_and_topped_up_at_the_next_rest_if_short() -> None:
    """A replica busy past the hold: the first estimate is charged as it is; the next one, held, takes its share at
    the rest with the first one's share computed beside it, so it is not charged the first one's error."""
    ledger, engine = Ledger(hold=5.0), Engine()
    ledger.read("r0", engine)
    engine.running = 1
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=20, room=100)
    ledger.clock.advance(6.0)
    ledger.rec.retain({"r0"})  # after a poll
    assert ledger.charges["a"] == 30
    ledger.rec.unseen("r0", "b", 1, prompt=10, completion=20, room=100)
    assert ledger.charges["b"] == 0  # held: its own hold has not run out
    engine.running, engine.prompt, engine.generation = 0, 20, 80  # each made 40, twice the estimates
    ledger.read("r0", engine, 2)
    assert (ledger.charges["a"], ledger.charges["b"]) == (50, 50)  # a topped up by 20, b charged its share
    assert ledger.rec.drift("r0") == (0, 0)
    assert ledger.rec.unseen_charged == Counter({("r0", "estimate"): 1, ("r0", "engine"): 1})


def test_an_expired_estimate_above_its_share_stays_and_shows_as_drift() -> None:
    ledger, engine = Ledger(hold=5.0), Engine()
    ledger.read("r0", engine)
    engine.running = 1
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=60, room=100)
    ledger.clock.advance(6.0)
    ledger.rec.retain({"r0"})
    ledger.rec.unseen("r0", "b", 1, prompt=10, completion=20, room=100)
    engine.running, engine.prompt, engine.generation = 0, 20, 40  # shares by estimate: a 30 (not 60), b 10
    ledger.read("r0", engine, 2)
    assert ledger.charges["b"] == 10 + 10  # its share (a quarter of 40), not the rest after a's estimate (0)
    assert ledger.rec.drift("r0") == (0, 60 + 10 - 40)


def test_a_replica_busy_for_very_long_keeps_a_bounded_list_and_its_estimates_stand(monkeypatch) -> None:
    monkeypatch.setattr("appliance.gateway.tenants.reconcile.MAX_EXPIRED", 3)
    ledger, engine = Ledger(hold=1.0), Engine(running=1)
    ledger.read("r0", engine)
    for _ in range(4):
        ledger.rec.unseen("r0", "a", 1, prompt=1, completion=1, room=10)
        ledger.clock.advance(2.0)
        ledger.rec.retain({"r0"})
    rest = ledger.rec._rests["r0"]
    assert rest.expired == [] and rest.untracked
    ledger.rec.unseen("r0", "b", 1, prompt=1, completion=1, room=10)  # nothing to settle against: charged at once
    assert ledger.charges == Counter({"a": 8, "b": 2})
    engine.running, engine.generation = 0, 50
    ledger.read("r0", engine, 2)  # the rest: a new interval, tracked again
    assert not ledger.rec._rests["r0"].untracked and ledger.charges == Counter({"a": 8, "b": 2})


def test_a_restart_or_a_replica_gone_charges_what_it_held_as_estimated() -> None:
    ledger, engine = Ledger(), Engine()
    for name in ("r0", "r1"):
        ledger.read(name, engine)
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=5, room=100)
    ledger.rec.unseen("r1", "b", 1, prompt=10, completion=7, room=100)
    ledger.read("r0", Engine(prompt=-1))  # counters went down: a new engine process
    ledger.rec.retain({"r0"})
    assert (ledger.charges["a"], ledger.charges["b"]) == (15, 17)


def dead_engine(gap: float, reported: tuple[int, int] = (0, 0)) -> Ledger:
    """r0's engine counted 10 prompt and 20 completion tokens a second until it died, ``gap`` seconds after its last
    reading, holding two estimates of 10 + 30 (broken requests that ran again elsewhere); a new process follows."""
    ledger, engine = Ledger(), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation, engine.running = 10, 20, 2
    ledger.read("r0", engine)
    ledger.rec.charged("r0", *reported)
    ledger.rec.unseen("r0", "a", 1, prompt=10, completion=30, room=100)
    ledger.rec.unseen("r0", "b", 1, prompt=10, completion=30, room=100)
    ledger.clock.advance(gap)
    ledger.rec.observe("r0", None)  # the first poll it does not answer
    ledger.read("r0", Engine(), 3)  # a new process: its counters from 0
    return ledger


def test_a_dead_engine_s_estimates_are_charged_no_more_than_it_can_have_made() -> None:
    """Its rise since the last rest (10, 20) plus its rate over the gap (0.5 s: 5, 10), less what reports covered:
    (15, 30) of the 20 + 60 estimated. Each estimate within its own; the others' shares never above theirs."""
    ledger = dead_engine(0.5)
    assert ledger.charges["a"] + ledger.charges["b"] == 15 + 30
    assert max(ledger.charges.values()) <= 10 + 30
    assert ledger.rec.unseen_charged[("r0", "estimate")] == 2
    reported = dead_engine(0.5, reported=(6, 20))  # a stream's leg reported there: not the estimates' work
    assert reported.charges["a"] + reported.charges["b"] == (15 - 6) + (30 - 20)


def test_a_dead_engine_that_can_have_made_more_charges_the_estimates_as_they_are() -> None:
    ledger = dead_engine(5.0)  # its rate over 5 s: more than the estimates
    assert (ledger.charges["a"], ledger.charges["b"]) == (40, 40)


def test_a_replica_that_stops_answering_holds_its_estimates_until_its_new_process_answers() -> None:
    """An engine restarting for longer than the hold (vLLM: a minute or more): its held estimates wait for the new
    process's first reading, and take its death's bound then, instead of expiring as they are meanwhile."""
    ledger, engine = Ledger(hold=30.0), Engine()
    ledger.read("r0", engine)
    engine.prompt, engine.generation, engine.running = 10, 20, 2
    ledger.read("r0", engine)
    ledger.rec.unseen("r0", "a", 1, prompt=20, completion=60, room=100)
    ledger.clock.advance(0.5)
    ledger.rec.observe("r0", None)
    for _ in range(90):  # 90 s without an answer
        ledger.clock.advance(1.0)
        ledger.rec.observe("r0", None)
        ledger.rec.expire()
    assert ledger.charges["a"] == 0 and len(ledger.rec._rests["r0"].held) == 1
    ledger.read("r0", Engine())
    assert ledger.charges["a"] == 15 + 30  # its bound: 10 + 10 x 0.5 prompt, 20 + 20 x 0.5 completion (of 80)


def test_without_a_hold_an_estimate_is_charged_at_once() -> None:
    ledger, engine = Ledger(hold=0.0), Engine()
    ledger.read("r0", engine)
    ledger.rec.unseen("r0", "a", 2, prompt=20, completion=5, room=100)
    assert ledger.charges["a"] == 15


def test_held_requests_and_how_each_was_charged_are_on_metrics() -> None:
    ledger, engine = Ledger(), Engine()
    registry = CollectorRegistry()
    registry.register(ledger.rec)
    ledger.read("r0", engine)
    ledger.rec.unseen("r0", "a", 1, prompt=1, completion=1, room=10)
    assert registry.get_sample_value("appliance_tenant_unseen_held", {"replica": "r0"}) == 1
    engine.prompt = engine.generation = 1
    ledger.read("r0", engine, 2)
    assert registry.get_sample_value("appliance_tenant_unseen_held", {"replica": "r0"}) == 0
    assert registry.get_sample_value("appliance_tenant_unseen_requests_total",
                                     {"replica": "r0", "charged": "engine"}) == 1


# -- the metering hook ------------------------------------------------------------------------------------------------


def meter(ledger: Ledger) -> tuple[Metering, CollectorRegistry]:
    registry = CollectorRegistry()
    quotas = Quotas([Tenant("team-a")], FakeClock())
    accounting = TenantAccounting(registry, slo_ttft_seconds=1.0, ratios=quotas.ratios)
    ledger.rec.charge = accounting.estimated
    admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    return Metering(accounting, quotas, admission, max_model_len=1000, reconciliation=ledger.rec), registry


def estimated(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("appliance_tenant_tokens_total", {"tenant": "team-a", "kind": "estimated"}) or 0


def test_a_timed_out_request_is_charged_what_its_engine_made_not_its_reservation() -> None:
    """No stream ran on the replica, so the estimate is the whole reservation (8 + 100); the engine made 23."""
    ledger, engine = Ledger(), Engine()
    metering, registry = meter(ledger)
    ledger.read("r0", engine)
    ex = exchange({"prompt": [1] * 8, "max_tokens": 100})
    chain(ex, metering.start(ex))
    begin(ex, "r0")
    engine.prompt, engine.generation = 8, 23
    ex.settle(Outcome.ABORTED)
    ex.hooks.finished(End(504, Outcome.ABORTED, True, 1.0))
    assert estimated(registry) == 0
    ledger.read("r0", engine, 2)
    assert estimated(registry) == 8 + 23
    assert ledger.rec.drift("r0") == (0, 0)


# -- a seeded storm ---------------------------------------------------------------------------------------------------


def running_chunk(prompt: int, completion: int) -> bytes:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo",
                "choices": [{"index": 0, "text": "t", "logprobs": None, "finish_reason": None}],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                          "completion_tokens": completion}})  # vLLM's order


def request(metering: Metering, engine: Engine, rng: random.Random, replica: str, ledger: Ledger) -> Iterator[None]:
    """One request on ``replica``, a step per token: a stream read whole or left (its tail unread), a
    non-streaming answer whole or timed out (its work unseen), one choice; or raced: its engine finished it as
    its client left, and the gateway never read the end (the engine counts it finished, no report says so)."""
    prompt, max_tokens = rng.randint(1, 40), rng.randint(1, 16)
    stream = rng.random() < 0.5
    ends = rng.choice(("whole", "cut", "cut", "raced"))
    made = rng.randint(0, max_tokens) if ends == "cut" else max_tokens
    ex = exchange({"prompt": [1] * prompt, "max_tokens": max_tokens, "stream": stream})
    hooks = chain(ex, metering.start(ex))
    begin(ex, replica)
    ledger.open[replica] += 1
    engine.running += 1
    at = float(rng.randint(0, 5))
    for token in range(made):
        if token == 0:
            engine.prompt += prompt
        engine.generation += 1
        at += 1.0
        if stream and (ends == "whole" or token < made - 1):  # a cut stream's last token is its unread tail
            raw = running_chunk(prompt, token + 1)
            hooks.relayed(Block(raw, raw, at, 1))
        yield
    engine.running -= 1
    if ends != "cut":
        engine.finished += 1
    if ends == "whole":
        raw = (usage_event(prompt, made) + DONE if stream else
               json.dumps({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": made,
                                                    "total_tokens": prompt + made}}).encode())
        hooks.relayed(Block(raw, raw, at, raw.count(b"data: ")))
    ex.settle(Outcome.SUCCESS if ends == "whole" else Outcome.ABORTED)
    ledger.open[replica] -= 1
    status = 200 if ends == "whole" else 499 if stream else 504
    hooks.finished(End(status, Outcome.SUCCESS if ends == "whole" else Outcome.ABORTED, True, at + 0.5))


@pytest.mark.parametrize(("hold", "deaths"), [(1e9, False), (3.0, False), (1e9, True)],
                         ids=["long-hold", "short-hold", "engines-die"])
def test_a_seeded_storm_settles_every_unseen_request_once_and_both_sides_meet(hold: float, deaths: bool) -> None:
    """Requests of every ending on two replicas at once, readings at random moments (some unanswered), pauses
    where a replica comes to rest: at the end every unseen request was charged exactly once. Where none waited
    past the hold, all were charged from the engine's count and both sides are equal to the token; with a short
    hold, the ones charged as estimated were topped up where short, so the tenants' side is never below the
    engine's. With engines that die now and then (an unanswered poll, then a new process counting from 0; the
    requests open there go on counting on the dead one), still every unseen request is charged exactly once."""
    rng = random.Random(20261206)
    for _round in range(5):
        ledger = Ledger(hold=hold)
        metering, registry = meter(ledger)
        told = Counter[str]()
        original = ledger.rec.unseen

        def counted(name: str, *args: int | str, original=original, told=told) -> None:
            told[name] += 1
            original(name, *args)  # type: ignore[arg-type]

        ledger.rec.unseen = counted  # type: ignore[method-assign]
        engines = {"r0": Engine(), "r1": Engine()}
        for name, engine in engines.items():
            ledger.read(name, engine)
        open_requests: list[Iterator[None]] = []
        died = 0
        for _step in range(3000):
            roll = rng.random()
            if deaths and roll < 0.004:
                name = rng.choice(list(engines))
                ledger.clock.advance(rng.uniform(0.1, 1.0))
                ledger.rec.observe(name, None)
                engines[name], died = Engine(), died + 1
            elif roll < 0.08:
                name = rng.choice(list(engines))
                open_requests.append(request(metering, engines[name], rng, name, ledger))
            elif roll < 0.2:
                name = rng.choice(list(engines))
                ledger.clock.advance(1.0)
                ledger.rec.observe(name, engines[name].reading() if rng.random() < 0.9 else None)
                ledger.rec.retain(set(engines))
            elif open_requests:
                i = rng.randrange(len(open_requests))
                if next(open_requests[i], "ended") == "ended":
                    open_requests.pop(i)
        for pending in open_requests:
            for _ in pending:
                pass
        for name, engine in engines.items():
            ledger.read(name, engine, 2)
        assert sum(told.values()) > 20
        for name in engines:
            charged = ledger.rec.unseen_charged
            assert charged[(name, "engine")] + charged[(name, "estimate")] == told[name], name
            if deaths:
                continue
            if hold > 1e6:
                assert charged[(name, "estimate")] == 0, name  # every one waited for a rest and the engine's count
                assert ledger.rec.drift(name) == (0, 0), name
            else:
                assert min(ledger.rec.drift(name)) >= 0, name
        assert estimated(registry) > 0
        assert died > 0 or not deaths

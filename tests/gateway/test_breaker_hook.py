"""The shape breaker on the request path, against fake engines that fail on one input (a poison) as vLLM does:
a poison is tried on one more replica at most, then refused with 422 without reaching an engine, and never counts
toward ejection; an engine whose different requests fail is still ejected; an outage is not blamed on inputs; a
stream silent past the idle timeout from an engine that answers /health is a long prefill, not a failure."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from appliance.context import context_of
from appliance.gateway.breaker.hook import REFUSED_CODE, ShapeBreaker
from appliance.gateway.routing.router import Router
from appliance.gateway.upstream.failures import ENGINE_DEAD
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import CountingModel, FakeEngine, Poison
from tests.gateway.live import app_clients

MARKER = "<<raise>>"
POISONED = f"please {MARKER} now"


@pytest.fixture
def engines():
    poisons = [Poison(MARKER)]
    engines = [FakeEngine(model=CountingModel(prefix=" t"), tokens=3, poisons=poisons).start() for _ in range(3)]
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture
def gateway(engines):
    """make(**settings): a gateway over the three engines, routing round robin (replica-0 first)."""
    fleet = [FakeReplica(f"replica-{i}", engine.url) for i, engine in enumerate(engines)]
    yield from app_clients(fleet, lambda **overrides: Settings(
        served_model_name="demo", routing={"scorers": {"policy": "round_robin"}}, **overrides))


def router(client: TestClient) -> Router:
    return context_of(client.app).gateway.router


def hook(client: TestClient) -> ShapeBreaker:
    return next(h for h in context_of(client.app).gateway.upstream.hooks if isinstance(h, ShapeBreaker))


def counted(client: TestClient) -> dict[str, tuple[int, int]]:
    """Each replica's failures in a row and ejections so far."""
    return {name: (h.consecutive_failures, h.ejections) for name, h in router(client).ejector.health.items()}


def no_failure_counted(client: TestClient) -> bool:
    return all(value == (0, 0) for value in counted(client).values())


def serve_everywhere(client: TestClient) -> None:
    """One healthy request per replica (round robin): each has served within the window."""
    for i in range(3):
        assert client.post("/v1/completions", json={"prompt": f"healthy {i}", "max_tokens": 3}).status_code == 200


def stream_events(client: TestClient, path: str, body: dict) -> tuple[int, list[dict]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        return response.status_code, [json.loads(line[6:]) for line in lines]


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_poison_answered_500_fails_on_two_replicas_then_is_refused_and_ejects_none(gateway, engines):
    client = gateway()
    serve_everywhere(client)
    first = client.post("/v1/completions", json={"prompt": POISONED, "max_tokens": 3})
    assert first.status_code == 422, first.text
    error = first.json()["error"]
    assert error["code"] == REFUSED_CODE and error["type"] == "invalid_request_error"
    assert "Internal server error" in error["message"]  # what the engines answered
    assert sum(e.poisoned for e in engines) == 2  # one replica, and one more to tell the input from the engine
    for _ in range(10):
        again = client.post("/v1/completions", json={"prompt": POISONED, "max_tokens": 3, "user": "someone"})
        assert again.status_code == 422 and again.json()["error"]["code"] == REFUSED_CODE
    assert sum(e.poisoned for e in engines) == 2  # refused without reaching an engine
    assert no_failure_counted(client), counted(client)
    assert client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3}).status_code == 200
    assert metric(client, "appliance_breaker_refusals_total") == 10
    assert metric(client, "appliance_breaker_open") == 1
    assert metric(client, 'appliance_breaker_verdicts_total{fault="input"}') == 2
    assert metric(client, 'appliance_breaker_verdicts_total{fault="engine"}') == 0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": POISONED, "max_tokens": 3}),  # the error event is the stream's first
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": POISONED}], "max_tokens": 3}),  # mid-stream
])
def test_a_streamed_poison_is_continued_once_then_ends_with_the_422_event(gateway, engines, path, body):
    client = gateway()
    serve_everywhere(client)
    status, events = stream_events(client, path, body)
    assert status == 200 and events[-1]["error"]["code"] == REFUSED_CODE, events
    assert sum(e.poisoned for e in engines) == 2  # the continuation was the one try elsewhere
    refused = client.post(path, json={**body, "stream": True})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == REFUSED_CODE
    assert sum(e.poisoned for e in engines) == 2
    assert no_failure_counted(client), counted(client)


def test_a_stream_that_is_not_continued_relays_the_engines_error_and_still_opens_the_breaker(gateway, engines):
    """Stop strings: migration does not continue the stream, so nothing frames it for a break. The engine's error
    event reaches the client as it came (not counted, as before); the breaker still learns the shape from it."""
    client = gateway()
    serve_everywhere(client)
    body = {"prompt": POISONED, "max_tokens": 3, "stop": ["never"]}
    for _ in range(2):  # round robin: two different replicas
        status, events = stream_events(client, "/v1/completions", body)
        assert status == 200 and events[-1]["error"] == {"message": "Internal server error",
                                                         "type": "InternalServerError", "param": None, "code": 500}
    refused = client.post("/v1/completions", json={**body, "stream": True})
    assert refused.status_code == 422 and sum(e.poisoned for e in engines) == 2
    assert no_failure_counted(client), counted(client)


@pytest.fixture
def pair(engines):
    """make(ejection_seconds, **settings): a gateway over two of the engines, round robin, replica-1 ejected for
    ``ejection_seconds`` once each has served a request (as a TTFT outlier on a loaded host is)."""
    fleet = [FakeReplica(f"replica-{i}", engine.url) for i, engine in enumerate(engines[:2])]
    opened = app_clients(fleet, lambda **overrides: Settings(
        served_model_name="demo", routing={"scorers": {"policy": "round_robin"},
                                           "eject_base_seconds": overrides.pop("ejection_seconds")}, **overrides))

    def make(ejection_seconds: float, **overrides: object) -> TestClient:
        client = next(opened)(ejection_seconds=ejection_seconds, **overrides)
        serve_everywhere(client)
        router(client).ejector.eject("replica-1", "TTFT outlier: 0.86s vs peers' median 0.14s")
        return client

    yield make
    next(opened, None)


def test_a_poison_waits_for_the_only_other_replica_to_end_its_ejection_to_be_told(pair, engines):
    """The only other replica sits out a short ejection when a poison fails: the request waits for it, as a retry
    does, and is told there (422), rather than answered the engine's 500 and counted against the one replica left
    in rotation (three such in a row ejected it too)."""
    client = pair(0.5)
    first = client.post("/v1/completions", json={"prompt": POISONED, "max_tokens": 3})
    assert first.status_code == 422 and first.json()["error"]["code"] == REFUSED_CODE, first.text
    assert [e.poisoned for e in engines] == [1, 1, 0]
    assert router(client).health_of("replica-0").consecutive_failures == 0
    assert hook(client).verdicts["input"] == 2 and hook(client).verdicts["engine"] == 0


def test_a_poison_the_other_replica_cannot_take_within_the_queue_timeout_gets_the_engines_answer(pair, engines):
    """The only other replica stays ejected past the queue timeout: nothing can tell, so the client gets what the
    engine answered (not the 503 of a replica-less wait), and the failure counts against that engine."""
    client = pair(60.0, admission={"queue_timeout_seconds": 0.3})
    answer = client.post("/v1/completions", json={"prompt": POISONED, "max_tokens": 3})
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["message"] == "Internal server error"
    assert answer.headers["x-appliance-replica"] == "replica-0"
    assert [e.poisoned for e in engines] == [1, 0, 0]
    assert router(client).health_of("replica-0").consecutive_failures == 1
    assert hook(client).verdicts["engine"] == 1 and hook(client).verdicts["input"] == 0


def test_an_engine_whose_different_requests_fail_is_still_ejected(gateway, engines):
    """Each failure on replica-0 is confirmed on another replica, where that request succeeds: the engine's fault,
    counted as before; the client gets the other replica's answer."""
    client = gateway()
    engines[0].fail_status = 500
    for i in range(12):
        answer = client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 3})
        assert answer.status_code == 200, answer.text
    assert router(client).health_of("replica-0").ejections >= 1
    assert hook(client).verdicts["engine"] >= 3 and hook(client).verdicts["input"] == 0
    assert router(client).health_of("replica-1").ejections == router(client).health_of("replica-2").ejections == 0


def test_an_outage_is_not_blamed_on_the_inputs(gateway, engines):
    """Every engine fails everything, and has served nothing within the window: once each has failed other
    requests, no input is at fault and every failure counts (only the first shape cannot be told from a poison)."""
    client = gateway(breaker={"window_seconds": 0.5})
    serve_everywhere(client)
    for engine in engines:
        engine.fail_status = 500
    time.sleep(0.6)
    statuses = [client.post("/v1/completions", json={"prompt": f"question {i}", "max_tokens": 3}).status_code
                for i in range(8)]
    assert statuses.count(422) <= 1 and statuses.count(500) >= 7, statuses
    assert hook(client).breaker is not None and hook(client).breaker.open_count() <= 1
    assert sum(h.ejections for h in router(client).ejector.health.values()) >= 1


def test_an_engine_core_that_died_is_the_engines_failure_at_once(gateway, engines):
    client = gateway()
    engines[0].fail_status, engines[0].fail_message = 500, ENGINE_DEAD + ". See stack trace (above)."
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 500  # not confirmed elsewhere: its answer says why
    assert router(client).health_of("replica-0").consecutive_failures == 1
    assert hook(client).verdicts == {"input": 0, "engine": 0, "long_prefill": 0}


def test_with_the_breaker_off_an_error_answer_counts_as_before(gateway, engines):
    client = gateway(breaker={"enabled": False})
    serve_everywhere(client)
    for _ in range(3):
        answer = client.post("/v1/completions", json={"prompt": POISONED, "max_tokens": 3})
        assert answer.status_code == 500
    assert sum(e.poisoned for e in engines) == 3  # never tried elsewhere
    assert sum(failures for failures, _ in counted(client).values()) == 3


def test_a_half_open_breaker_lets_one_trial_through_and_opens_again_when_it_fails(gateway, engines):
    client = gateway(breaker={"cooldown_seconds": 0.3})
    serve_everywhere(client)
    assert client.post("/v1/completions", json={"prompt": POISONED}).status_code == 422
    assert client.post("/v1/completions", json={"prompt": POISONED}).status_code == 422
    assert sum(e.poisoned for e in engines) == 2
    time.sleep(0.35)
    serve_everywhere(client)
    trial = client.post("/v1/completions", json={"prompt": POISONED})
    assert trial.status_code == 422 and sum(e.poisoned for e in engines) == 3  # one trial, not confirmed again
    assert client.post("/v1/completions", json={"prompt": POISONED}).status_code == 422
    assert sum(e.poisoned for e in engines) == 3
    assert no_failure_counted(client), counted(client)


def test_a_first_byte_later_than_the_idle_timeout_from_a_healthy_engine_is_a_long_prefill(gateway, engines):
    client = gateway(upstream_idle_timeout_seconds=0.5)
    engines[0].first_token_delay = 2.0  # replica-0 (round robin's first) takes long to prefill
    status, events = stream_events(client, "/v1/completions", {"prompt": "a long prompt", "max_tokens": 3})
    assert status == 200 and events[-1]["error"]["code"] == "upstream_timeout", events
    assert "health check" in events[-1]["error"]["message"]
    assert [len(e.received) for e in engines] == [1, 0, 0]  # not sent again elsewhere: as long there
    assert no_failure_counted(client), counted(client)
    assert hook(client).verdicts["long_prefill"] == 1
    assert router(client).in_flight() == 0


def test_a_first_byte_later_than_the_idle_timeout_from_an_engine_that_fails_health_is_its_failure(gateway, engines):
    client = gateway(upstream_idle_timeout_seconds=0.5)
    engines[0].first_token_delay, engines[0].health_status = 2.0, 503
    status, events = stream_events(client, "/v1/completions", {"prompt": "a prompt", "max_tokens": 3})
    assert status == 200 and "error" not in events[-1], events  # sent again elsewhere, as before
    assert "".join(e["choices"][0]["text"] for e in events) == " t0 t1 t2"
    assert router(client).health_of("replica-0").consecutive_failures == 1
    assert hook(client).verdicts["long_prefill"] == 0

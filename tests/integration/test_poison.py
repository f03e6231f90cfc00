"""A request that makes vLLM raise, on the 2 real vLLM replicas of the shared appliance: sent 20 times among
healthy requests, it ejects no replica, every other request is served, and it reaches the engines twice (once on
each replica, which tells the input's fault from an engine's), then is refused with 422 without reaching one.

The poison is a structured output vLLM 0.32 accepts and then fails on. With the structured-output backend "auto"
(the default), the front end picks a backend per request: xgrammar when xgrammar accepts the constraint, else
llguidance (vllm/sampling_params.py, _validate_structured_outputs). The engine core, though, builds one backend,
from the first structured-output request it ever gets, and compiles every later grammar with it
(vllm/v1/structured_output/__init__.py, grammar_init: "We only support a single backend"). Once an engine has
served one request xgrammar accepts (here a choice), the JSON schema {"type": "array", "minItems": 1}, which
xgrammar's strict mode rejects and the front end therefore hands to llguidance, is compiled by xgrammar in the
core: "minItems is greater than the number of prefixItems, but additional items are not allowed: 1 > 0". The
scheduler finishes the request with an error and vLLM answers 500 {"error": {"message": "Internal server error",
"type": "InternalServerError", ...}} (streamed: 200, then that 5xx error event and [DONE]), on every such replica,
every time, the engine staying healthy. Before the shape breaker, each counted as the replica's failure: three in
a row ejected it. (No earlier test on the shared appliance sends a structured output; if one fixed an engine on
llguidance first, this schema would be served there, and the test says so.)

About 30 s on the shared appliance (its engines already up). The same run with `breaker.enabled` off (what the
gateway did before): 20 engine errors and a replica ejected.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine

POISON = {"model": "demo", "prompt": "Three numbers:", "max_tokens": 8,
          "structured_outputs": {"json": {"type": "array", "minItems": 1}}}
PRIMER = {"model": "demo", "prompt": "Yes or no?", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
TIMES = 20


def samples(url: str, names: Iterable[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    wanted = set(names)
    page = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(page)
            for s in family.samples if s.name in wanted}


def gateway_counts(url: str) -> dict[str, float]:
    found = samples(url, ["appliance_replica_ejections_total", "appliance_breaker_refusals_total",
                          "appliance_breaker_verdicts_total"])
    out: dict[str, float] = {}
    for (name, labels), value in found.items():
        label = ",".join(v for _, v in labels)
        out[f"{name}{{{label}}}" if label else name] = value
    return out


def engine_errors(appliance) -> float:
    """Requests the engines themselves finished with an error (vLLM's own counter), both replicas."""
    total = 0.0
    for index in range(2):
        found = samples(f"http://127.0.0.1:{appliance.engine_port(index)}", ["vllm:request_success_total"])
        total += sum(v for (_, labels), v in found.items() if dict(labels).get("finished_reason") == "error")
    return total


def healthy(url: str, i: int, served: list[str], failures: list[str]) -> None:
    """A healthy request, streamed or not, completions or chat: it must be answered in full."""
    stream, chat = i % 2 == 0, i % 3 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": "demo", "max_tokens": 8, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Say something about the number {i}."}]
    else:
        body["prompt"] = f"The number {i} is"
    answer = httpx.post(url + path, json=body, timeout=120)
    finishes = []
    if stream:
        for line in answer.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    failures.append(f"{path} {answer.status_code}: {line[:300]}")
                finishes += [c["finish_reason"] for c in event.get("choices") or [] if c.get("finish_reason")]
    elif answer.status_code == 200:
        finishes = [c["finish_reason"] for c in answer.json()["choices"]]
    if answer.status_code != 200 or not finishes:
        failures.append(f"{path} {answer.status_code}: {answer.text[:300]}")
        return
    served.append(answer.headers["x-appliance-replica"])


def prime(url: str) -> set[str]:
    """Structured outputs xgrammar accepts, until both replicas served one (a few at once: least in flight spreads
    them): each engine core's backend is then xgrammar, as on a fleet whose clients use structured outputs."""
    primed: set[str] = set()
    for _ in range(6):
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=PRIMER, timeout=120), range(4)))
        assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
        primed |= {a.headers["x-appliance-replica"] for a in answers}
        if len(primed) == 2:
            break
    return primed


def in_rotation(url: str, timeout: float = 60) -> None:
    """Both replicas in routing and neither ejected (a TTFT outlier on a loaded host is ejected for a few
    seconds; one that sat out its health checks is back once it answers them)."""
    deadline = time.monotonic() + timeout
    while (ready := httpx.get(f"{url}/health/ready", timeout=10).json())["routable_replicas"] != 2 \
            or ready["ejected_replicas"]:
        assert time.monotonic() < deadline, ready
        time.sleep(0.5)


def poison(url: str, stream: bool) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**POISON, "stream": stream}, timeout=120)


def test_a_prompt_that_makes_vllm_raise_sent_20_times_ejects_no_replica_and_the_rest_is_served(appliance):
    url = appliance.url
    assert len(prime(url)) == 2
    served: list[str] = []
    failures: list[str] = []
    warm = [threading.Thread(target=healthy, args=(url, i, served, failures)) for i in range(4)]
    for worker in warm:  # a fleet in service
        worker.start()
    for worker in warm:
        worker.join(180)
    assert len(served) == 4 and not failures, (served, failures)
    in_rotation(url)  # a fleet whose two replicas can each tell: the breaker's case, not a replica's outage
    before, errors_before = gateway_counts(url), engine_errors(appliance)

    # A client sending it again and again: three whole answers (500 each, before: three failures in a row on the
    # replica prefix affinity keeps sending it to), then streamed, then a healthy request; and healthy requests at
    # once with it from other clients.
    answers: list[httpx.Response] = []
    background = [threading.Thread(target=healthy, args=(url, 200 + i, served, failures)) for i in range(4)]
    for i in range(TIMES):
        answers.append(poison(url, stream=i % 4 == 3))
        if i % 4 == 3:
            healthy(url, 100 + i, served, failures)
        if i == TIMES // 2:
            for worker in background:
                worker.start()
    for worker in background:
        worker.join(180)
    first = answers[0]

    after, errors_after = gateway_counts(url), engine_errors(appliance)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    print(f"poison x{TIMES}: statuses {[a.status_code for a in answers]}, engine errors "
          f"{errors_after - errors_before:.0f}, healthy served {len(served)} (by {sorted(set(served))}), gateway "
          f"counters moved: { {k: v for k, v in delta.items() if v} }")
    assert not failures, failures
    assert first.status_code != 200, "an engine served the schema: its structured-output backend is llguidance"
    assert all(a.status_code == 422 and a.json()["error"]["code"] == "request_fails_reproducibly" for a in answers), \
        [a.text[:200] for a in answers if a.status_code != 422]
    assert "Internal server error" in first.json()["error"]["message"]  # what the engines answered it
    assert errors_after - errors_before == 2  # one replica, one more to tell; then refused before any engine
    assert delta.get("appliance_breaker_refusals_total") == TIMES - 1
    assert delta.get('appliance_breaker_verdicts_total{input}') == 2
    assert not delta.get('appliance_breaker_verdicts_total{engine}')
    assert not any(v for k, v in delta.items() if k.startswith("appliance_replica_ejections_total")), delta
    ready = httpx.get(f"{url}/health/ready", timeout=10).json()
    assert ready["ejected_replicas"] == 0 and ready["routable_replicas"] == 2, ready

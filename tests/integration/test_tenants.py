"""Tenants on a real vLLM engine: each tenant's token counters are exactly what the engine reported, a spent
quota is a 429 with Retry-After, each tenant's prefix cache is its own (the gateway's cache salt), and the tenants'
priority reaches vLLM's scheduler (``engine.scheduling_policy: priority``).

A mixed run by two tenants (completions and chat; streams with and without ``stream_options.include_usage``, and
non-streaming requests): each tenant's prompt / completion / cached-prompt counters equal the sum of the usage the
engine reported for its requests, and the two tenants together equal the engine's own counters' deltas
(``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:prompt_tokens_cached_total``) over the run.
The streams whose clients did not ask for usage are counted from the usage the gateway asked for and hid: their
clients see no usage event, and what they cost is known (the same prompt as a request that reported it;
``ignore_eos`` makes the completion exactly ``max_tokens``).

Its own one-replica appliance (``serve``), so no other test's traffic reaches the engine during the run. The engine
runs 2 sequences at once and the gateway sends it up to 8 (the admission limit pinned above ``max_num_seqs``), so
requests wait in vLLM's own queue, where the priority test needs them; the other tests do not depend on either.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ApplianceProcess, serving

pytestmark = pytest.mark.engine

METRICS_TOKEN = "tenants-metrics"
ADMIN_TOKEN = "tenants-admin"
TENANTS = [{"name": "team-a", "api_keys": ["key-a"]},
           {"name": "team-b", "api_keys": ["key-b"], "weight": 2},
           {"name": "team-q", "api_keys": ["key-q"], "requests_per_minute": 1},
           {"name": "team-hi", "api_keys": ["key-hi"], "priority": 9}]
ENGINE_ENV = {"APPLIANCE_ENGINE__SCHEDULING_POLICY": "priority", "APPLIANCE_ENGINE__MAX_NUM_SEQS": "2",
              "APPLIANCE_ADMISSION__INITIAL_LIMIT": "8", "APPLIANCE_ADMISSION__MIN_LIMIT": "8",
              "APPLIANCE_ADMISSION__MAX_LIMIT": "8"}
# Long enough (several KV blocks) that the requests after the first of each prompt reuse its prefix cache, so the
# cached-prompt counters move too.
PROMPTS = {"completions": "The import system of Python finds modules, loads them and binds them. " * 24,
           "chat": "Name three uses of the with statement, and say why each one matters. " * 24}


@pytest.fixture(scope="module")
def single(demo_model_int8, tmp_path_factory):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("tenants"), replicas=1,
                           env={"APPLIANCE_TENANTS": json.dumps(TENANTS), "APPLIANCE_METRICS_TOKEN": METRICS_TOKEN,
                                "APPLIANCE_ADMIN_TOKEN": ADMIN_TOKEN, **ENGINE_ENV})
    with serving(app) as running:
        yield running


def samples(url: str, name: str) -> dict[tuple, float]:
    # The gateway's /metrics names the tenants and their usage: closed to all but Prometheus once keys are set.
    text = httpx.get(url, headers={"authorization": f"Bearer {METRICS_TOKEN}"}, timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def engine_total(app: ApplianceProcess, name: str) -> float:
    return sum(samples(f"http://127.0.0.1:{app.engine_port(0)}/metrics", name).values())


def tenant_tokens(app: ApplianceProcess, tenant: str, kind: str) -> float:
    return samples(f"{app.url}/metrics", "appliance_tenant_tokens_total")[(("kind", kind), ("tenant", tenant))]


def request(app: ApplianceProcess, key: str, route: str, *, stream: bool, usage: bool, max_tokens: int
            ) -> tuple[dict | None, bytes]:
    """One request; the usage its client was sent (None: it did not ask for any) and the raw answer."""
    body: dict = {"model": "demo", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    body.update({"prompt": PROMPTS[route]} if route == "completions" else
                {"messages": [{"role": "user", "content": PROMPTS[route]}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    headers = {"authorization": f"Bearer {key}"}
    if not stream:
        response = httpx.post(app.url + path, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"], response.content
    body.update(stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
    with httpx.stream("POST", app.url + path, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        raw = response.read()
    events = [json.loads(line[6:]) for line in raw.decode().split("\n")
              if line.startswith("data: {")]
    reported = [event["usage"] for event in events if event.get("usage")]
    assert raw.endswith(b"data: [DONE]\n\n")
    if not usage:
        assert not reported and b'"usage"' not in raw  # the usage the gateway asked for is hidden
        return None, raw
    assert len(reported) == 1 and events[-1]["choices"] == []
    return reported[0], raw


# (tenant key, route, stream, client asks for usage, max_tokens)
RUN = [("key-a", "completions", False, False, 12), ("key-b", "chat", True, True, 9),
       ("key-a", "chat", True, False, 7), ("key-b", "completions", True, False, 10),
       ("key-a", "completions", True, True, 5), ("key-b", "chat", False, False, 6),
       ("key-a", "chat", False, False, 8), ("key-b", "completions", True, True, 11),
       ("key-a", "completions", True, False, 4), ("key-b", "chat", True, False, 3)]


def test_each_tenants_counters_are_what_the_engine_reported(single):
    app = single
    names = {"key-a": "team-a", "key-b": "team-b"}
    kinds = ("prompt", "completion", "cached_prompt")
    engine_names = {"prompt": "vllm:prompt_tokens_total", "completion": "vllm:generation_tokens_total",
                    "cached_prompt": "vllm:prompt_tokens_cached_total"}
    before_engine = {kind: engine_total(app, name) for kind, name in engine_names.items()}
    before = {tenant: {kind: tenant_tokens(app, tenant, kind) for kind in kinds} for tenant in names.values()}

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: request(app, r[0], r[1], stream=r[2], usage=r[3], max_tokens=r[4]), RUN))

    seen_prompt = {route: usage["prompt_tokens"] for (_, route, *_), (usage, _) in zip(RUN, results, strict=True)
                   if usage is not None}
    assert set(seen_prompt) == {"completions", "chat"}
    details = [usage.get("prompt_tokens_details") for usage, _ in results if usage is not None]
    assert all(isinstance(d, dict) and "cached_tokens" in d for d in details), details  # the engine flag is on
    expected = {tenant: {"prompt": 0, "completion": 0} for tenant in names.values()}
    visible_cached = {tenant: 0 for tenant in names.values()}
    for (key, route, _stream, _asked, max_tokens), (usage, _raw) in zip(RUN, results, strict=True):
        tenant = names[key]
        if usage is None:  # hidden from its client: same prompt as a request that reported it; ignore_eos
            expected[tenant]["prompt"] += seen_prompt[route]
            expected[tenant]["completion"] += max_tokens
        else:
            assert usage["completion_tokens"] == max_tokens
            expected[tenant]["prompt"] += usage["prompt_tokens"]
            expected[tenant]["completion"] += usage["completion_tokens"]
            visible_cached[tenant] += usage["prompt_tokens_details"]["cached_tokens"]

    after_engine = {kind: engine_total(app, name) for kind, name in engine_names.items()}
    counted = {tenant: {kind: tenant_tokens(app, tenant, kind) - before[tenant][kind] for kind in kinds}
               for tenant in names.values()}
    for tenant in names.values():
        assert counted[tenant]["prompt"] == expected[tenant]["prompt"], (tenant, counted, expected)
        assert counted[tenant]["completion"] == expected[tenant]["completion"], (tenant, counted, expected)
        assert counted[tenant]["cached_prompt"] >= visible_cached[tenant]
    assert sum(visible_cached.values()) > 0  # the prefix cache served some: the cached counters are tested too
    print(f"tenants: {counted}; engine deltas: "
          f"{ {kind: after_engine[kind] - before_engine[kind] for kind in kinds} }")
    for kind in kinds:  # both tenants together: exactly the engine's own counters
        assert sum(counted[t][kind] for t in names.values()) == after_engine[kind] - before_engine[kind], kind
    requests = samples(f"{app.url}/metrics", "appliance_tenant_requests_total")
    assert requests[(("code", "200"), ("tenant", "team-a"))] == 5
    assert requests[(("code", "200"), ("tenant", "team-b"))] == 5


def reconciled(app: ApplianceProcess) -> dict[tuple[str, str], float]:
    """The gateway's reconciliation of its one replica: (kind, side) -> tokens (nothing before its first poll)."""
    found = samples(f"{app.url}/metrics", "appliance_tenant_reconciled_tokens_total")
    assert len({dict(labels)["replica"] for labels in found}) <= 1, found
    return {(dict(labels)["kind"], dict(labels)["side"]): value for labels, value in found.items()}


def settled(app: ApplianceProcess, engine_names: dict[str, str], timeout: float = 60
            ) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """The engine's counters and the gateway's reconciliation at a moment they agree: both unchanged over three of
    the gateway's engine polls (routing.metrics_poll_seconds, 1 s), so its last poll read the engine after the last
    token of the work before. Read at once after that work, the gateway's side may still lack its last second."""
    deadline = time.monotonic() + timeout
    while True:
        engine = {kind: engine_total(app, name) for kind, name in engine_names.items()}
        gateway = reconciled(app)
        time.sleep(3)
        if gateway and engine == {kind: engine_total(app, name) for kind, name in engine_names.items()} and \
                gateway == reconciled(app):
            return engine, gateway
        assert time.monotonic() < deadline, "the engine or the gateway's reading of it never settled"


def leave_stream(app: ApplianceProcess, key: str, route: str, chunks: int) -> None:
    """A stream its client leaves after reading ``chunks`` content events (so the engine had started it)."""
    body: dict = {"model": "demo", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    body.update({"prompt": PROMPTS[route]} if route == "completions" else
                {"messages": [{"role": "user", "content": PROMPTS[route]}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    with httpx.stream("POST", app.url + path, json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=120) as response:
        assert response.status_code == 200
        read = 0
        for line in response.iter_lines():
            read += line.startswith("data: {")
            if read >= chunks:
                break  # the client leaves: the connection closes with the stream unread


def time_out(app: ApplianceProcess, key: str, route: str, seconds: float) -> None:
    """A non-streaming request whose client gives up after ``seconds``, usually long before its 400 tokens are
    made (the prompts are about 490 tokens: 400 more fit the demo model's 1,024). The demo engine alone makes
    several hundred tokens a second: an answer in time is an answered request, charged as reported, and the
    tokens must meet all the same."""
    body: dict = {"model": "demo", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    body.update({"prompt": PROMPTS[route]} if route == "completions" else
                {"messages": [{"role": "user", "content": PROMPTS[route]}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    try:
        response = httpx.post(app.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=seconds)
    except httpx.TimeoutException:
        return
    assert response.status_code == 200, response.text


def unseen(app: ApplianceProcess) -> dict[str, float]:
    """The gateway's unseen requests by how they were charged, and how many wait for a rest."""
    charged = samples(f"{app.url}/metrics", "appliance_tenant_unseen_requests_total")
    held = samples(f"{app.url}/metrics", "appliance_tenant_unseen_held")
    counts = {how: sum(v for labels, v in charged.items() if dict(labels)["charged"] == how)
              for how in ("engine", "estimate")}
    return {**counts, "held": sum(held.values())}


def test_the_tenants_charges_reconcile_with_the_engines_counters(single):
    """Whole streams, non-streaming answers, streams left after a few chunks and non-streaming requests timed out
    by their clients, by two tenants at once: once every request has ended and the gateway's poll read the engine
    again, its engine side rose exactly as the engine's own counters; once the replica came to rest, the work no
    engine reported (the left streams' unread tails, the timed-out answers) was charged as the engine counted it,
    so what the tenants were charged for that replica is the engine's count, to the token."""
    app = single
    unseen_before = unseen(app)
    engine_names = {"prompt": "vllm:prompt_tokens_total", "completion": "vllm:generation_tokens_total"}
    before_engine, before = settled(app, engine_names)
    whole = [("key-a", "completions", True, False, 48), ("key-b", "chat", True, True, 40),
             ("key-a", "chat", False, False, 32), ("key-b", "completions", True, False, 56)]
    left = [("key-a", "completions", 3), ("key-b", "chat", 6), ("key-a", "chat", 2), ("key-b", "completions", 9)]
    timed_out = [("key-a", "completions", 0.15), ("key-b", "chat", 0.3)]
    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(time_out, app, key, route, seconds) for key, route, seconds in timed_out]
        done += [pool.submit(request, app, key, route, stream=stream, usage=usage, max_tokens=max_tokens)
                 for key, route, stream, usage, max_tokens in whole]
        done += [pool.submit(leave_stream, app, key, route, chunks) for key, route, chunks in left]
        for future in done:
            future.result()

    def caught_up() -> bool:
        engine = {kind: engine_total(app, name) - before_engine[kind] for kind, name in engine_names.items()}
        now = reconciled(app)
        return all(now[(kind, "engine")] - before[(kind, "engine")] == engine[kind] for kind in engine_names)

    deadline = time.monotonic() + 30
    while not caught_up():  # vLLM ends the left streams' sequences within a step; the poll reads it a second later
        assert time.monotonic() < deadline, "the gateway's engine side never caught up with the engine's counters"
        time.sleep(0.5)
    time.sleep(2)
    assert caught_up()  # and stays there: nothing was still running
    while unseen(app)["held"]:  # the replica at rest: two idle readings a second apart
        assert time.monotonic() < deadline + 30, f"the unseen work was never settled: {unseen(app)}"
        time.sleep(0.5)
    after, counts = reconciled(app), unseen(app)
    rise = {key: after[key] - before[key] for key in after}
    charged = {how: counts[how] - unseen_before[how] for how in ("engine", "estimate")}
    print(f"reconciled rises: {rise}; unseen requests charged: {charged}")
    records = [(r.get("stream"), r.get("status"), len(r.get("attempts") or []))
               for tenant in ("team-a", "team-b")
               for r in httpx.get(f"{app.url}/admin/requests", params={"tenant": tenant, "limit": 8}, timeout=30,
                                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()["requests"]]
    for kind in engine_names:
        engine, tenants = rise[(kind, "engine")], rise[(kind, "tenants")]
        assert engine > 0
        assert tenants == engine, (kind, tenants, engine, charged)
    # Each left or timed-out request is unseen work unless its engine finished first (the gateway read the final
    # usage before it saw the client go): how many depends on the host's pace, that all were charged as the engine
    # counted them does not
    assert charged["estimate"] == 0 and 1 <= charged["engine"] <= len(left) + len(timed_out), (charged, records)


def test_a_spent_quota_is_a_429_with_retry_after(single):
    app = single
    usage, _ = request(app, "key-q", "completions", stream=False, usage=True, max_tokens=2)
    assert usage["completion_tokens"] == 2
    body = {"model": "demo", "prompt": PROMPTS["completions"], "max_tokens": 2}
    refused = httpx.post(f"{app.url}/v1/completions", json=body, headers={"authorization": "Bearer key-q"},
                         timeout=30)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "team-q" in error["message"]
    assert "key-q" not in refused.text
    limited = samples(f"{app.url}/metrics", "appliance_tenant_rate_limited_total")
    assert limited[(("limit", "requests"), ("tenant", "team-q"))] == 1
    ratio = samples(f"{app.url}/metrics", "appliance_tenant_quota_remaining_ratio")
    assert ratio[(("limit", "requests"), ("tenant", "team-q"))] < 0.5
    # the other tenants are not limited
    assert request(app, "key-a", "completions", stream=False, usage=True, max_tokens=2)[0] is not None


def cached_tokens(app: ApplianceProcess, key: str, prompt: str) -> int:
    response = httpx.post(f"{app.url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                          json={"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prompt_cached_by_one_tenant_is_not_cached_for_another(single):
    """The probe cache salting closes: tenant A's prompt is in the engine's prefix cache for A (a second request
    finds it), tenant B sending the very same prompt finds nothing cached, even with A's own salt as its
    ``cache_salt``, and A still finds its own."""
    app = single
    prompt = "A system prompt that only team-a ever sends, with its customer's name in it. " * 20
    assert cached_tokens(app, "key-a", prompt) == 0
    assert cached_tokens(app, "key-a", prompt) > 0
    assert cached_tokens(app, "key-b", prompt) == 0
    assert cached_tokens(app, "key-b", prompt) > 0  # B's own cache, now
    assert cached_tokens(app, "key-a", prompt) > 0


def engine_holds(app: ApplianceProcess) -> tuple[float, float]:
    """The requests the engine runs and the ones waiting in its own queue, as its /metrics says now."""
    url = f"http://127.0.0.1:{app.engine_port(0)}/metrics"
    return (sum(samples(url, "vllm:num_requests_running").values()),
            sum(samples(url, "vllm:num_requests_waiting").values()))


def flood_then_high(app: ApplianceProcess) -> tuple[bool, list[dict], dict]:
    """6 long streams of team-a, then a short one of team-hi as soon as the engine holds all 6 (2 running, 4
    waiting: on a loaded host a fixed pause was too short or too long). Whether the engine was then seen holding
    all 7 (2 running, 5 waiting: team-hi's in its queue before any stream ended), and the gateway's records."""

    def stream(name: str, key: str, max_tokens: int) -> None:
        body = {"model": "demo", "prompt": f"Request {name}: tell a long story.", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{app.url}/v1/completions", json=body, timeout=300,
                          headers={"authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            assert response.read().endswith(b"data: [DONE]\n\n")

    with ThreadPoolExecutor(7) as pool:
        flood = [pool.submit(stream, f"a{i}", "key-a", 960) for i in range(6)]
        deadline = time.monotonic() + 60
        while engine_holds(app) != (2, 4) and time.monotonic() < deadline and not any(f.done() for f in flood):
            time.sleep(0.05)  # (not there in time: the records show it, and the scenario runs again)
        high = pool.submit(stream, "hi", "key-hi", 4)
        queued = False
        while not queued and time.monotonic() < deadline + 60 and not any(f.done() for f in (*flood, high)):
            queued = engine_holds(app) == (2, 5)
            time.sleep(0.05)
        for future in (*flood, high):
            future.result()

    def records(tenant: str, count: int) -> list[dict]:
        answer = httpx.get(f"{app.url}/admin/requests", params={"tenant": tenant, "limit": count}, timeout=30,
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        return answer.json()["requests"]

    return queued, records("team-a", 6), records("team-hi", 1)[0]


def test_the_tenants_priority_reaches_vllms_scheduler(single):
    """team-a sends 6 long streams: the gateway (limit 8) dispatches all of them, the engine runs 2 and queues 4
    in its own queue. Then team-hi (priority 9) sends a short one. With priority scheduling vLLM runs it as soon as
    one of the first two ends, ahead of the 4 waiting: at most those 2 of team-a's end before it; first come
    first served, it would run after all 4 waiting ones. The precondition is read from the engine: its own gauges
    showed 2 running and 5 waiting, so team-hi's request was in vLLM's queue before the first wave ended (the
    gateway having sent it in time is not enough: a host that holds every process up for seconds can hold the
    engine's API server up until the first wave has ended). Should the test never see that, the scenario runs
    again. Ends are the gateway's own times (its request records), so a test process starved of CPU on a busy
    host reads them right."""
    app = single
    deadline = time.monotonic() + 30  # the policy comes with the gateway's load poll, within a poll of ready
    while (policy := samples(f"{app.url}/metrics", "appliance_replica_scheduling_policy"))[
            (("policy", "priority"), ("replica", "replica-0"))] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert policy[(("policy", "priority"), ("replica", "replica-0"))] == 1, policy
    for _ in range(5):
        queued, flood, high = flood_then_high(app)
        if queued:
            break
    else:
        pytest.fail(f"team-hi's request was never seen in vLLM's queue with team-a's 6: {flood}, {high}")
    ends = sorted(r["arrived_at"] + r["e2e_seconds"] for r in flood)
    before = sum(1 for end in ends if end < high["arrived_at"] + high["e2e_seconds"])
    print(f"team-a streams that ended before team-hi's: {before} of 6 (first come first served: 6)")
    assert before <= 2, (flood, high)


def stream_events(url: str, path: str, body: dict, key: str) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        raw = response.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


def by_choice(events: list[dict]) -> dict[int, dict]:
    """Each choice as a client puts it together: its role (chat), whether it has text, its finish reason, the
    fingerprint on its finishing chunk and whether any other chunk carries one. Not where its chunks are cut: vLLM
    merges a choice's tokens into fewer chunks when its API server falls behind the engine core, so two answers of
    the same tokens may be cut differently (seen on a loaded machine). Not the text itself: top_k 1 does not make
    the demo model's answers the same on the CPU engine, whose logits move with a sequence's place in the batch and
    with what the prefix cache held (the gateway salts the cache per tenant), so a near tie between two tokens goes
    either way: the two samples of one prompt came back as "x" and "a" directly and as "a" and "x" through the
    gateway, on a loaded machine. The relay's bytes are compared exactly against the fake engine's in the unit
    tests (tests/gateway/test_hidden_usage.py)."""
    choices: dict[int, dict] = {}
    for event in events:
        assert len(event["choices"]) == 1, event  # vLLM writes one choice a chunk
        choice = event["choices"][0]
        delta = choice.get("delta")
        entry = choices.setdefault(choice["index"], {
            "object": event["object"], "model": event["model"], "text": False, "finish_reason": None,
            "role": delta.get("role") if delta is not None else None, "fingerprint": None,
            "fingerprint_elsewhere": False})
        entry["text"] = entry["text"] or bool(delta.get("content") if delta is not None else choice.get("text"))
        if choice.get("finish_reason"):
            entry["finish_reason"], entry["fingerprint"] = choice["finish_reason"], event.get("system_fingerprint")
        elif "system_fingerprint" in event:
            entry["fingerprint_elsewhere"] = True
    return choices


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_multi_choice_stream_without_usage_is_what_the_engine_sends_such_a_client(single, route):
    """Several choices (chat: n=2; completions: 2 prompts x n=2) streamed without ``include_usage``: the engine
    itself writes its fingerprint on every finishing chunk and nowhere else, and on the usage event only when one is
    asked for; through the gateway (which asks for usage and hides it) the client gets each choice's events exactly
    as the engine sends them directly, twice (by the second, the gateway has learnt the engine's fingerprint and
    holds nothing)."""
    app = single
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    # top_k 1: the same tokens every time (vLLM refuses n > 1 with temperature 0)
    body: dict = {"model": "demo", "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "top_k": 1, "n": 2,
                  "stream": True}
    body.update({"messages": [{"role": "user", "content": "Name a colour."}]} if route == "chat" else
                {"prompt": ["Once upon a time", "The capital of France is"]})
    engine = f"http://127.0.0.1:{app.engine_port(0)}"
    direct = stream_events(engine, path, body, app.engine_key())
    finishing = [e for e in direct if e["choices"][0].get("finish_reason")]
    assert len(finishing) == (2 if route == "chat" else 4)
    fingerprints = {e.get("system_fingerprint") for e in finishing}
    assert len(fingerprints) == 1 and isinstance(next(iter(fingerprints)), str), finishing
    assert all("system_fingerprint" not in e for e in direct if not e["choices"][0].get("finish_reason"))
    with_usage = stream_events(engine, path, {**body, "stream_options": {"include_usage": True}}, app.engine_key())
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["system_fingerprint"] in fingerprints
    assert all("system_fingerprint" not in e for e in with_usage[:-1])
    for _ in range(2):
        relayed = by_choice(stream_events(app.url, path, body, "key-a"))
        assert all(choice["text"] for choice in relayed.values()), relayed
        assert relayed == by_choice(direct)

"""Tenants on a real vLLM engine: each tenant's token counters are exactly what the engine reported, and a spent
quota is a 429 with Retry-After.

A mixed run by two tenants (completions and chat; streams with and without ``stream_options.include_usage``, and
non-streaming requests): each tenant's prompt / completion / cached-prompt counters equal the sum of the usage the
engine reported for its requests, and the two tenants together equal the engine's own counters' deltas
(``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:prompt_tokens_cached_total``) over the run.
The streams whose clients did not ask for usage are counted from the usage the gateway asked for and hid: their
clients see no usage event, and what they cost is known (the same prompt as a request that reported it;
``ignore_eos`` makes the completion exactly ``max_tokens``).

Its own one-replica appliance (``serve``), so no other test's traffic reaches the engine during the run.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ApplianceProcess, serving

pytestmark = pytest.mark.engine

METRICS_TOKEN = "tenants-metrics"
TENANTS = [{"name": "team-a", "api_keys": ["key-a"]},
           {"name": "team-b", "api_keys": ["key-b"], "weight": 2},
           {"name": "team-q", "api_keys": ["key-q"], "requests_per_minute": 1}]
# Long enough (several KV blocks) that the requests after the first of each prompt reuse its prefix cache, so the
# cached-prompt counters move too.
PROMPTS = {"completions": "The import system of Python finds modules, loads them and binds them. " * 24,
           "chat": "Name three uses of the with statement, and say why each one matters. " * 24}


@pytest.fixture(scope="module")
def single(demo_model_int8, tmp_path_factory):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("tenants"), replicas=1,
                           env={"APPLIANCE_TENANTS": json.dumps(TENANTS), "APPLIANCE_METRICS_TOKEN": METRICS_TOKEN})
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

"""Tenant metering as a hook, without a transport: the quota before the queue, charges per event, the engines'
usage counted every leg, the usage event the gateway asked for hidden from the client."""

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
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.quota import REQUESTS, Quotas
from appliance.gateway.upstream.hook import End
from appliance.http.errors import APIError
from tests.gateway.upstream.support import DONE, block, chain, chunk, exchange, usage_event


def meter(tenant: Tenant | None = None) -> tuple[Metering, CollectorRegistry]:
    registry = CollectorRegistry()
    quotas = Quotas([tenant or Tenant("team-a")])
    accounting = TenantAccounting(registry, slo_ttft_seconds=1.0, ratios=quotas.ratios)
    accounting.configure(["team-a"])
    admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    return Metering(accounting, quotas, admission), registry


def tokens(registry: CollectorRegistry, kind: str) -> float | None:
    return registry.get_sample_value("appliance_tenant_tokens_total", {"tenant": "team-a", "kind": kind})


def test_a_stream_asks_for_usage_and_the_client_never_sees_it() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello", "stream": True})
    hooks = chain(ex, metering.start(ex))
    assert json.loads(ex.body)["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert hooks.frames
    events = [chunk("a"), chunk("b", finish="length"), usage_event(3, 2), DONE]
    out = b""
    for event in events:
        b = block(event)
        hooks.relayed(b)
        out += b.out
    assert out == events[0] + events[1] + DONE
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (3, 2)


def test_a_client_that_asked_for_usage_keeps_it_and_every_leg_is_counted() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello", "stream": True, "stream_options": {"include_usage": True}})
    body = ex.body
    hooks = chain(ex, metering.start(ex))
    assert ex.body == body  # nothing to ask: the client's bytes go as they came
    for event in (chunk("a"), usage_event(3, 1), usage_event(4, 1)):  # two legs, two reports
        b = block(event)
        hooks.relayed(b)
        assert b.out == event
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (7, 2)


def test_a_spent_quota_refuses_before_the_queue_with_retry_after() -> None:
    metering, registry = meter(Tenant("team-a", requests_per_minute=1))
    first = exchange({"prompt": "hello"})
    chain(first, metering.start(first)).arrived()
    second = exchange({"prompt": "hello"})
    with pytest.raises(APIError) as refused:
        chain(second, metering.start(second)).arrived()
    assert refused.value.status == 429 and "Retry-After" in (refused.value.headers or {})
    assert registry.get_sample_value("appliance_tenant_rate_limited_total",
                                     {"tenant": "team-a", "limit": REQUESTS}) == 1


def test_a_non_streaming_answer_is_counted_from_its_body() -> None:
    metering, registry = meter()
    ex = exchange({"prompt": "hello"})
    hooks = chain(ex, metering.start(ex))
    assert not hooks.frames
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}).encode()
    b = block(body)
    hooks.relayed(b)
    assert b.out == body and b.usage == {"prompt_tokens": 5, "completion_tokens": 4}
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    assert (tokens(registry, "prompt"), tokens(registry, "completion")) == (5, 4)

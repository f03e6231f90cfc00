"""Who used what: per-tenant requests, tokens, latency and quota refusals, as Prometheus metrics and as a summary
for ``appliance status``.

Tokens are what the engines reported in their ``usage`` (``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``), so the tenants' counters add up to the engines' own counters. Streams
ask the engine for usage even when the client did not, and hide that usage from the client (``ask_for_usage``,
``HiddenUsage``).

Streams ask for the running usage too (``continuous_usage_stats``, hidden likewise), so a stream that never gets
its final usage event (its client left, its engine broke off) counts the last running usage its engine sent, as
``prompt`` and ``completion``. A stream continued on another replica counts every leg: the broken one's running
usage and the continuation's report (its prompt is the original prompt plus the tokens already sent, prefilled
again). What no engine reported but the tenant is charged for (the tokens an engine made after a leaving client's
last chunk, the reservation of a non-streaming request that was left or timed out: ``tenants.metering``) counts as
``estimated``, never in the other two.

Labels come from the configuration only (the tenant's name; fixed ``kind``, ``limit`` and the HTTP status), never
from anything a client sends; every configured tenant's series exist from the start: 0 is an answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.gateway.observation.metrics import LATENCY_BUCKETS, buckets_with
from appliance.gateway.tenants.quota import LIMITS
from appliance.gateway.tenants.usage import Usage

KINDS = ("prompt", "completion", "cached_prompt", "estimated")  # appliance_tenant_tokens_total's ``kind``
STARTING_CODES = ("200", "429")  # requests series created for every tenant up front (others appear when seen)


@dataclass
class _Tally:
    """The summary's numbers for one tenant (the counters' values, kept plainly for ``summary``)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    estimated_tokens: int = 0
    rate_limited: int = 0


class TenantAccounting:
    """The per-tenant metrics of the request path. ``appliance_tenant_in_flight_requests`` and
    ``appliance_tenant_queued_requests`` are admission's state, read at scrape in ``gateway/fleet_metrics.py``."""

    def __init__(self, registry: CollectorRegistry, *, slo_ttft_seconds: float,
                 ratios: Callable[[], Iterable[tuple[str, str, float]]] = lambda: ()) -> None:
        self.requests = Counter("appliance_tenant_requests", "Requests answered by the gateway, by tenant and HTTP "
                                "status.", ["tenant", "code"], registry=registry)
        self.tokens = Counter("appliance_tenant_tokens", "Tokens the engines reported in their usage, by tenant and "
                              "kind (prompt, completion, cached_prompt: prompt tokens served from the prefix "
                              "cache; estimated: tokens charged that no engine reported).", ["tenant", "kind"],
                              registry=registry)
        self.ttft = Histogram("appliance_tenant_ttft_seconds", "Time to first token as the client sees it "
                              "(streamed requests), by tenant.", ["tenant"],
                              buckets=buckets_with(LATENCY_BUCKETS, [slo_ttft_seconds]), registry=registry)
        self.queue_wait = Histogram("appliance_tenant_queue_wait_seconds", "Time a request waited in the "
                                    "gateway's admission queue, by tenant.", ["tenant"],
                                    buckets=buckets_with(LATENCY_BUCKETS, [0.001]), registry=registry)
        self.rate_limited = Counter("appliance_tenant_rate_limited", "Requests answered 429 because the tenant's "
                                    "quota was spent, by tenant and limit (tokens, requests).", ["tenant", "limit"],
                                    registry=registry)
        registry.register(_QuotaCollector(ratios))
        self._tallies: dict[str, _Tally] = {}

    def configure(self, names: Iterable[str]) -> None:
        """Create every configured tenant's series (start, reload). A removed tenant's series stay: counters that
        vanished would read as a reset."""
        for name in names:
            self._tally(name)
            for code in STARTING_CODES:
                self.requests.labels(name, code)
            for kind in KINDS:
                self.tokens.labels(name, kind)
            for limit in LIMITS:
                self.rate_limited.labels(name, limit)
            self.ttft.labels(name)
            self.queue_wait.labels(name)

    def _tally(self, name: str) -> _Tally:
        tally = self._tallies.get(name)
        if tally is None:
            tally = self._tallies[name] = _Tally()
        return tally

    def answered(self, tenant: str, status: int) -> None:
        self.requests.labels(tenant, str(status)).inc()
        self._tally(tenant).requests += 1

    def used(self, tenant: str, usage: Usage) -> None:
        tally = self._tally(tenant)
        for kind, value in (("prompt", usage.prompt), ("completion", usage.completion),
                            ("cached_prompt", usage.cached_prompt)):
            if value:
                self.tokens.labels(tenant, kind).inc(value)
        tally.prompt_tokens += usage.prompt
        tally.completion_tokens += usage.completion
        tally.cached_prompt_tokens += usage.cached_prompt

    def estimated(self, tenant: str, tokens: int) -> None:
        """Tokens charged to ``tenant`` that no engine reported (the gateway's estimate of work it did)."""
        if tokens > 0:
            self.tokens.labels(tenant, "estimated").inc(tokens)
            self._tally(tenant).estimated_tokens += tokens

    def limited(self, tenant: str, limit: str) -> None:
        self.rate_limited.labels(tenant, limit).inc()
        self._tally(tenant).rate_limited += 1

    def summary(self) -> list[dict[str, Any]]:
        """Each tenant's totals since start, the heaviest (prompt + completion + estimated tokens) first."""
        rows = [{"tenant": name, **{f.name: getattr(tally, f.name) for f in fields(_Tally)}}
                for name, tally in self._tallies.items()]
        rows.sort(key=lambda row: (-(row["prompt_tokens"] + row["completion_tokens"] + row["estimated_tokens"]),
                                   row["tenant"]))
        return rows


class _QuotaCollector(Collector):
    """``appliance_tenant_quota_remaining_ratio``, read from the live buckets at scrape time (only tenants with
    that quota; a bucket in debt reads below 0)."""

    def __init__(self, ratios: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        self._ratios = ratios

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily("appliance_tenant_quota_remaining_ratio", "Level of each tenant's quota bucket "
                                  "over its capacity (one minute's worth): 1 full, 0 spent, below 0 in debt.",
                                  labels=["tenant", "limit"])
        for tenant, limit, ratio in self._ratios():
            gauge.add_metric([tenant, limit], ratio)
        yield gauge

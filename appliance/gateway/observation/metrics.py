"""The gateway's Prometheus metrics observed on the request path: latency as clients see it, and how the router
decides (a few microseconds each). The fleet's state is read at scrape time by ``gateway/fleet_metrics.py``."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from appliance.gateway.routing.scorers import PrefixScorer

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0,
                   60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


# Client routes whose answers appliance_requests_total counts, by path; the label is the proxy's route name.
CLIENT_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
COUNTED = "appliance.counted"  # set in the ASGI scope once a request's answer is counted
# appliance_stream_migrations_total's labels (appliance.gateway.migration names the same values).
MIGRATION_REASONS = ("connection", "idle_timeout", "engine_error", "drain")
MIGRATION_OUTCOMES = ("continued", "failed", "ineligible", "exhausted")


def buckets_with(base: Iterable[float], thresholds: Iterable[float]) -> tuple[float, ...]:
    """Histogram buckets that include the SLO thresholds, so burn-rate rules on them are exact."""
    return tuple(sorted(set(base) | {float(t) for t in thresholds}))


class RequestMetrics:
    """Per-request observations, labelled by route (``completions`` / ``chat``) and status code."""

    def __init__(self, registry: CollectorRegistry, *, slo_ttft_seconds: float,
                 slo_e2e_seconds: float | None = None) -> None:
        ttft_buckets = buckets_with(LATENCY_BUCKETS, [slo_ttft_seconds])
        e2e_buckets = buckets_with(LATENCY_BUCKETS, [slo_e2e_seconds] if slo_e2e_seconds else [])
        self.requests = Counter("appliance_requests", "Requests answered by the gateway, by route and HTTP status.",
                                ["route", "code"], registry=registry)
        self.ttft = Histogram("appliance_request_ttft_seconds",
                              "Time to first token as the client sees it (streamed requests): from arrival at "
                              "the gateway to the first streamed chunk.", ["route"], buckets=ttft_buckets,
                              registry=registry)
        self.e2e = Histogram("appliance_request_e2e_seconds",
                             "End-to-end request latency at the gateway, arrival to last byte.", ["route"],
                             buckets=e2e_buckets, registry=registry)
        self.itl = Histogram("appliance_request_itl_seconds",
                             "Inter-token latency: gap between consecutive streamed chunks (one token each).",
                             ["route"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("appliance_request_tpot_seconds",
                              "Time per output token of a streamed request: (E2E - TTFT) / (chunks - 1).",
                              ["route"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram("appliance_request_queue_wait_seconds",
                                    "Time a request waited in the gateway's admission queue.",
                                    buckets=buckets_with(LATENCY_BUCKETS, [0.001]), registry=registry)
        self.tokens = Counter("appliance_tokens", "Tokens processed, from the engines' usage reports.",
                              ["kind"], registry=registry)
        # Stream migration (appliance.gateway.migration): reason and outcome are from fixed tuples there.
        self.migrations = Counter("appliance_stream_migrations", "Broken upstream answers the gateway tried to "
                                  "continue on another replica, by why they broke (connection, idle_timeout, "
                                  "engine_error, drain) and what came of it (continued, failed, ineligible, "
                                  "exhausted).", ["reason", "outcome"], registry=registry)
        self.migration_replayed_tokens = Counter("appliance_stream_migration_replayed_tokens",
                                                 "Tokens a continuation made its new replica prefill again: the "
                                                 "original prompt plus the tokens already sent.", registry=registry)
        self.migration_added_seconds = Histogram("appliance_stream_migration_added_seconds",
                                                 "Time from a stream's break to the first event of its "
                                                 "continuation relayed to the client.", ["route"],
                                                 buckets=LATENCY_BUCKETS, registry=registry)
        for reason in MIGRATION_REASONS:  # every series from the start: 0 is an answer, an absent series is not
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(reason, outcome)
        for route in CLIENT_ROUTES.values():
            self.migration_added_seconds.labels(route)

    def count_unproxied(self, path: str, scope: MutableMapping[str, Any], status: int) -> None:
        """Count a client route's answer the proxy never saw (rejected by validation, auth, size, drain, or an
        unexpected error), so appliance_requests_total holds every answer, not only the forwarded ones."""
        route = CLIENT_ROUTES.get(path)
        if route is not None and not scope.get(COUNTED):
            scope[COUNTED] = True
            self.requests.labels(route, str(status)).inc()

    def observe_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.tokens.labels("prompt").inc(usage.get("prompt_tokens") or 0)
        self.tokens.labels("completion").inc(usage.get("completion_tokens") or 0)


ROUTING_DURATION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RoutingMetrics:
    """How the router decides: its cost, which scorer decided, how much prefix matched, the prefix index's size.

    Labels are bounded by construction: ``policy`` is one of two names, ``decided_by`` one of
    ``appliance.gateway.routing.DECIDERS``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram("appliance_routing_duration_seconds",
                                  "Time the router took to choose a replica for one request (filters, scorers, "
                                  "prompt hashing, index update).", buckets=ROUTING_DURATION_BUCKETS,
                                  registry=registry)
        self.decisions = Counter("appliance_routing_decisions", "Routing decisions, by policy and by the scorer "
                                 "that separated the chosen replica from the runner-up (tie_*: a tie-breaker; "
                                 "index: nothing did; single: one candidate).", ["policy", "decided_by"],
                                 registry=registry)
        self.prefix_match = Histogram("appliance_routing_prefix_match_ratio",
                                      "Share of the prompt whose prefix was recently sent to the chosen replica.",
                                      buckets=RATIO_BUCKETS, registry=registry)


class PrefixIndexCollector(Collector):
    """The prefix index's size and churn, read at scrape time from the live policy."""

    def __init__(self, prefix: PrefixScorer) -> None:
        self._prefix = prefix

    def collect(self) -> Iterable[Metric]:
        index = self._prefix.index
        yield GaugeMetricFamily("appliance_routing_prefix_index_entries",
                                "Prompt blocks (per replica) in the prefix-affinity index.", value=len(index))
        yield GaugeMetricFamily("appliance_routing_prefix_index_bytes",
                                "Accounted memory of the prefix-affinity index (bounded by "
                                "routing.scorers.prefix.index_bytes).", value=index.bytes)
        yield CounterMetricFamily("appliance_routing_prefix_index_evictions",
                                  "Blocks evicted from the prefix-affinity index to stay within its budget.",
                                  value=index.evictions)
        yield CounterMetricFamily("appliance_routing_prefix_yields",
                                  "Decisions where a replica holding the prefix was passed over for its load "
                                  "(bounded load).", value=self._prefix.yields)
        yield CounterMetricFamily("appliance_routing_prefix_forgotten",
                                  "Times a replica's prefix entries were dropped because it restarted or lost "
                                  "its engine.", value=self._prefix.forgotten)
